"""`sharpi inspect`: what is in a GGUF file, seen through sharpi's own reader (_core.GgufFile).

inspect_summary(path) returns the facts as a dict; inspect_report(path) renders them as text:
architecture and hyper-parameters, tokenizer, quant mix (bytes per type), bytes in routed experts vs
dense weights, experts per layer with the bytes of one expert (the unit the expert cache moves), and
the tensor list. A split model (NAME-0000i-of-0000K.gguf, any shard named) is inspected as a whole:
the shards are listed and each tensor says which one holds it. Read-only: it opens the file without
mapping the data and reads no tensor bytes.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import OrderedDict

import gguf

from . import _core, _internal

_EXPERT_TENSOR = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")
_LAYER = re.compile(r"^blk\.(\d+)\.")


def _file_type_name(value) -> str:
    try:
        return gguf.LlamaFileType(int(value)).name.replace("MOSTLY_", "").replace("ALL_", "")
    except (ValueError, TypeError):
        return str(value)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def inspect_summary(path) -> dict:
    f = _core.GgufFile(path, map_data=False)
    md = f.metadata()
    tensors = f.tensors()
    arch = md.get("general.architecture", "?")
    prefix = f"{arch}."
    hparams = OrderedDict((k[len(prefix) :], v) for k, v in md.items() if k.startswith(prefix))

    # Derived values llama.cpp also derives when keys are absent (qwen2moe has no key_length, OLMoE and
    # Mixtral no expert_feed_forward_length).
    by_name = {t["name"]: t for t in tensors}
    derived = OrderedDict()
    n_embd, n_head = hparams.get("embedding_length"), hparams.get("attention.head_count")
    if "attention.key_length" not in hparams and n_embd and n_head:
        derived["head_dim"] = n_embd // n_head
    gate0 = next((t for t in tensors if _EXPERT_TENSOR.match(t["name"]) and "_gate_" in t["name"]), None)
    if gate0 is not None and "expert_feed_forward_length" not in hparams:
        derived["expert_feed_forward_length"] = gate0["shape"][1]
    if "vocab_size" not in hparams and "token_embd.weight" in by_name:
        derived["vocab_size"] = by_name["token_embd.weight"]["shape"][1]

    attention = _attention_summary(hparams, any(name.endswith(".attn_sinks.weight") for name in by_name))
    q_norm = next((t for t in tensors if t["name"].endswith(".attn_q_norm.weight")), None)
    if q_norm is not None and attention.get("kind") in ("mha", "gqa"):
        # Per head (weights of head_dim: qwen3, glm4moe) or over the whole projection (olmoe, minimax-m2).
        whole = q_norm["shape"][0] == (hparams.get("attention.head_count") or 0) * attention["head_dim"]
        attention["qk_norm"] = "whole projection" if whole and attention["head_dim"] != q_norm["shape"][0] else "per head"
    routing = _routing_summary(arch, hparams, by_name)
    if arch == "llama4":
        attention["llama4"] = _llama4_summary(hparams, "rope_freqs.weight" in by_name)
    if arch == "deepseek4":
        attention["deepseek4"] = _deepseek4_summary(hparams)
        # One shared kv head that is both K and V, plus the compressor state, in one f32 row.
        attention["kind"] = "shared-kv mqa"
        attention["kv_cache_floats_per_token_layer"] = max(attention["deepseek4"]["kv_row_floats"], default=0)

    by_type: dict[str, dict] = {}
    for t in tensors:
        e = by_type.setdefault(t["type_name"], {"tensors": 0, "bytes": 0, "elements": 0})
        e["tensors"] += 1
        e["bytes"] += t["nbytes"]
        e["elements"] += t["n_elements"]

    layers: dict[int, dict] = {}
    routed = 0
    for t in tensors:
        m = _EXPERT_TENSOR.match(t["name"])
        if not m:
            continue
        il, which = int(m.group(1)), m.group(2)
        n_expert = t["shape"][2] if len(t["shape"]) == 3 else 1
        entry = layers.setdefault(
            il, {"layer": il, "n_expert": n_expert, "types": {}, "bytes_per_expert": 0, "bytes": 0}
        )
        entry["types"][which] = t["type_name"]
        entry["bytes_per_expert"] += t["nbytes"] // n_expert
        entry["bytes"] += t["nbytes"]
        routed += t["nbytes"]
    total = sum(t["nbytes"] for t in tensors)

    # Multi-token-prediction blocks (qwen3next, qwen35moe, glm4moe, deepseek): the last nextn_predict_layers of
    # block_count. sharpi loads the file with them and never runs them.
    nextn = OrderedDict()
    n_nextn = int(hparams.get("nextn_predict_layers", 0) or 0)
    if n_nextn > 0 and "block_count" in hparams:
        first = int(hparams["block_count"]) - n_nextn
        mtp = [t for t in tensors if _block_index(t["name"]) is not None and _block_index(t["name"]) >= first]
        nextn = OrderedDict(
            n_layer=n_nextn,
            blocks=list(range(first, first + n_nextn)),
            tensors=len(mtp),
            bytes=sum(t["nbytes"] for t in mtp),
        )
    # Hybrid archs: which trunk layers are Gated DeltaNet (recurrent) and which attention.
    recurrent = hparams.get("attention.recurrent_layers")
    layer_kinds = None
    if recurrent is not None:
        flags = list(recurrent.tolist() if hasattr(recurrent, "tolist") else recurrent)[: len(recurrent) - n_nextn]
        layer_kinds = "".join("R" if x else "A" for x in flags)
    kv_per_layer, ff_per_layer = hparams.get("attention.head_count_kv"), hparams.get("feed_forward_length")
    if arch == "nemotron_h_moe" and not isinstance(kv_per_layer, int) and not isinstance(ff_per_layer, int):
        # One mixer per block, in the HF config's hybrid_override_pattern letters.
        kv, ff = list(kv_per_layer), list(ff_per_layer)
        n_trunk = len(kv) - n_nextn
        layer_kinds = "".join("*" if kv[i] else "E" if ff[i] else "M" for i in range(n_trunk))

    tok = OrderedDict()
    if "tokenizer.ggml.model" in md:
        tok["model"] = md["tokenizer.ggml.model"]
        tok["pre"] = md.get("tokenizer.ggml.pre")
        tok["n_tokens"] = len(md.get("tokenizer.ggml.tokens", []))
        tok["n_merges"] = len(md.get("tokenizer.ggml.merges", []))
        for key in ("bos_token_id", "eos_token_id", "padding_token_id", "add_bos_token"):
            if f"tokenizer.ggml.{key}" in md:
                tok[key] = md[f"tokenizer.ggml.{key}"]
        tok["chat_template"] = "tokenizer.chat_template" in md

    shards = f.shards
    for i, shard in enumerate(shards):
        shard["tensor_bytes"] = sum(t["nbytes"] for t in tensors if t["shard"] == i)
    return OrderedDict(
        path=f.path,
        file_size=sum(shard["file_size"] for shard in shards),
        shards=shards,
        version=f.version,
        alignment=f.alignment,
        data_offset=f.data_offset,
        n_metadata=len(md),
        n_tensors=len(tensors),
        arch=arch,
        name=md.get("general.name"),
        file_type=_file_type_name(md["general.file_type"]) if "general.file_type" in md else None,
        hparams=hparams,
        derived=derived,
        attention=attention,
        routing=routing,
        tokenizer=tok,
        bytes_by_type=OrderedDict(sorted(by_type.items(), key=lambda kv: -kv[1]["bytes"])),
        tensor_bytes=total,
        routed_expert_bytes=routed,
        dense_bytes=total - routed,
        expert_layers=[layers[k] for k in sorted(layers)],
        nextn=nextn,
        layer_kinds=layer_kinds,
        expert_reader=_internal.reader_choice(f.path),  # what --reader auto runs on this file, and why
        # The CUDA device here (cuda::describe: "no CUDA device (no NVIDIA driver)" on a machine without one).
        device=OrderedDict(present=_internal.cuda_available(), describe=_internal.cuda_describe()),
        # The CPU kernels this process picks (SHARPI_ISA caps the ISA; AMX tiles serve fast-mode
        # prefill of Q4_K / Q6_K weights where the CPU and OS allow, unless SHARPI_AMX=0).
        cpu_kernels=OrderedDict(isa=_internal.active_isa(),
                                amx_prefill=_internal.amx_available() and _internal.active_isa() == "avx512"),
        cufile_reader=_internal.cufile_probe(),  # whether --reader cufile could run here, and what is missing
        tensors=[
            OrderedDict(
                name=t["name"],
                type=t["type_name"],
                shape=t["shape"],
                nbytes=t["nbytes"],
                file_offset=t["file_offset"],
                shard=t["shard"],
            )
            for t in tensors
        ],
    )


def _attention_summary(hparams: dict, has_sinks: bool = False) -> OrderedDict:
    """How the file's attention works, in words sharpi's engine uses: "mla" (multi-head latent
    attention, deepseek2: the KV cache holds one latent per position) or "mha" (GQA/MHA), with the
    per-position KV cache floats per layer; gpt-oss's sliding window (even layers) and sinks."""
    n_head = hparams.get("attention.head_count")
    out = OrderedDict()
    if "attention.kv_lora_rank" in hparams:
        kv_lora, n_rot = hparams["attention.kv_lora_rank"], hparams.get("rope.dimension_count", 0)
        k_mla, v_mla = hparams.get("attention.key_length_mla"), hparams.get("attention.value_length_mla")
        out["kind"] = "mla"
        out["q_lora_rank"] = hparams.get("attention.q_lora_rank", 0)  # 0: one q projection
        out["kv_lora_rank"] = kv_lora
        out["rope_dims"] = n_rot
        out["head_dim_qk"] = k_mla
        out["head_dim_v"] = v_mla
        # deepseek32 (DeepSeek Sparse Attention): the lightning indexer's key of each position is
        # cached in the same row after the latent, and attention reads only the indexer's top_k.
        index_key = hparams.get("attention.indexer.key_length", 0)
        if index_key:
            out["indexer_heads"] = hparams.get("attention.indexer.head_count")
            out["indexer_key_length"] = index_key
            out["indexer_top_k"] = hparams.get("attention.indexer.top_k")
        out["kv_cache_floats_per_token_layer"] = kv_lora + n_rot + index_key
        # The latent row is stored in --cache-type-k's type (f16 by default, f32 in exact mode) and
        # is also the values (V is a view of it, as in llama.cpp): --cache-type-v must name the same.
        out["latent_cache_type"] = "cache_type_k (f16; exact mode f32); cache_type_v must match"
        out["latent_bytes_per_token_layer"] = _latent_row_bytes(kv_lora + n_rot + index_key)
        if n_head and k_mla and v_mla:
            out["expanded_kv_floats_per_token_layer"] = n_head * (k_mla + v_mla)
    elif n_head:
        n_head_kv = hparams.get("attention.head_count_kv", n_head)
        if isinstance(n_head_kv, (list, tuple)) or hasattr(n_head_kv, "tolist"):
            # nemotron_h_moe: one entry per block, 0 on the blocks without attention.
            n_head_kv = max(list(n_head_kv.tolist() if hasattr(n_head_kv, "tolist") else n_head_kv)) or n_head
            out["rope"] = "none (NoPE)"
        head_dim = hparams.get("attention.key_length") or hparams["embedding_length"] // n_head
        out["kind"] = "mha" if n_head_kv == n_head else "gqa"
        out["head_dim"] = head_dim
        out["kv_cache_floats_per_token_layer"] = 2 * n_head_kv * head_dim
        n_rot = hparams.get("rope.dimension_count")
        if n_rot and n_rot < head_dim and "rope" not in out:  # partial RoPE (glm4moe, minimax-m2: half of each head)
            out["rope_dims"] = n_rot
    if "rope.scaling.type" in hparams:
        out["rope_scaling"] = hparams["rope.scaling.type"]
    if hparams.get("attention.sliding_window"):
        out["sliding_window"] = hparams["attention.sliding_window"]
        out["sliding_layers"] = "even (0, 2, ...); odd layers full"
    out["sinks"] = has_sinks
    return out


def _routing_summary(arch: str, hparams: dict, by_name: dict) -> OrderedDict:
    """How a MoE file routes, in llama.cpp's terms: gating function (softmax unless
    expert_gating_func says sigmoid; glm4moe and minimax-m2 default to sigmoid), whether a selection
    bias (exp_probs_b) steers the choice, top-k renormalisation (minimax-m2 always renormalises, as
    llama.cpp hard-codes it), the routed weight scale, expert groups, shared experts and leading
    dense layers. Empty for a dense file."""
    if not hparams.get("expert_count"):
        return OrderedDict()
    sigmoid_default = ("glm4moe", "minimax-m2", "nemotron_h_moe")  # llama.cpp's per-arch default
    gating = int(hparams.get("expert_gating_func", 2 if arch in sigmoid_default else 1) or 1)
    out = OrderedDict(gating={2: "sigmoid", 4: "sqrt(softplus)"}.get(gating, "softmax"))
    out["selection_bias"] = any(n.endswith(".exp_probs_b.bias") for n in by_name)
    if "expert_weights_norm" in hparams or arch == "minimax-m2":
        out["weights_norm"] = bool(hparams.get("expert_weights_norm", True))
    out["weights_scale"] = float(hparams.get("expert_weights_scale", 1.0) or 1.0)
    if int(hparams.get("expert_group_count", 1) or 1) > 1:
        out["groups"] = f"{hparams['expert_group_used_count']} of {hparams['expert_group_count']}"
    shared = hparams.get("expert_shared_count")
    if shared is None and any(n.endswith(".ffn_gate_shexp.weight") for n in by_name):
        shared = 1
    out["shared_experts"] = int(shared or 0)
    out["shared_gate"] = any(n.endswith(".ffn_gate_inp_shexp.weight") for n in by_name)
    out["leading_dense_layers"] = int(hparams.get("leading_dense_block_count", 0) or 0)
    ungated = not any(n.endswith(".ffn_gate_exps.weight") for n in by_name)
    out["expert_ffn"] = "down(relu(up x)^2), no gate" if ungated else "down(silu(gate x) * up x)"
    if hparams.get("moe_latent_size"):  # Nemotron 3 Super: experts run in a down-projected space
        out["expert_ffn"] += f", in a latent of {int(hparams['moe_latent_size'])} (ffn_latent_down / _up)"
    return out


def _llama4_summary(hparams: dict, has_rope_freqs: bool) -> OrderedDict:
    """Llama 4's layer pattern as llama.cpp runs it (and model/archs/llama4.cpp: the file carries none
    of these numbers): without attention.sliding_window = 0, layers il % 4 < 3 rotate q/k and attend
    within chunks of 8192 positions ("C"), every fourth is global without RoPE, its queries scaled by
    the attention temperature ("G"); MoE on layers (il + 1) % interleave_moe_layer_step == 0."""
    n_layer = int(hparams.get("block_count", 0))
    step = int(hparams.get("interleave_moe_layer_step", 0) or 0)
    chunked = int(hparams.get("attention.sliding_window", 1) or 0) != 0
    if chunked:
        kinds = "".join("C" if il % 4 < 3 else "G" for il in range(n_layer))
    else:
        kinds = "".join("F" if (il + 1) % n_layer else "N" for il in range(n_layer))
    return OrderedDict(
        chunk=8192 if chunked else 0,
        layer_kinds=kinds,
        moe_layers=[il for il in range(n_layer) if step > 0 and (il + 1) % step == 0],
        qk_l2_norm=int(hparams.get("expert_count", 0) or 0) != 128,
        temperature="ln(floor((p + 1) / 8192) + 1) * 0.1 + 1 on the NoPE layers" if chunked else None,
        rope_freqs=has_rope_freqs,
    )


def _deepseek4_summary(hparams: dict) -> OrderedDict:
    """DeepSeek-V4's layer pattern and state (model/archs/deepseek4.cpp): per layer "S" (sliding
    window only), "C" (compressed sparse attention, ratio 4, Lightning Indexer top-k) or "H" (heavily
    compressed, ratio 128); the hyper-connection streams, the hash-routed leading layers, and the
    f32 KV row sharpi keeps per position and layer (HParams::dsv4_kv_row)."""
    raw = hparams.get("attention.compress_ratios")
    ratios = [int(r) for r in (raw.tolist() if hasattr(raw, "tolist") else raw or [])]
    n_layer = int(hparams.get("block_count", 0)) - int(hparams.get("nextn_predict_layers", 0) or 0)
    ratios = ratios[:n_layer]
    head_dim = int(hparams.get("attention.key_length", 0) or 0)
    idx_dim = int(hparams.get("attention.indexer.key_length", 0) or 0)

    def row(r: int) -> int:
        coff = 2 if r == 4 else 1
        return head_dim + ((2 * coff + 1) * head_dim if r else 0) + (5 * idx_dim if r == 4 else 0)

    return OrderedDict(
        layer_kinds="".join({0: "S", 4: "C", 128: "H"}.get(r, "?") for r in ratios),
        sliding_window=int(hparams.get("attention.sliding_window", 0) or 0),
        indexer_top_k=int(hparams.get("attention.indexer.top_k", 0) or 0),
        hc_streams=int(hparams.get("hyper_connection.count", 1) or 1),
        hash_layers=int(hparams.get("hash_layer_count", 0) or 0),
        output_groups=int(hparams.get("attention.output_group_count", 0) or 0),
        kv_row_floats=[row(r) for r in ratios],
    )


def _latent_row_bytes(width: int) -> OrderedDict:
    """Bytes of one MLA latent row of `width` elements in each KV cache type (the block types need
    width % 32 == 0; None where they cannot tile it)."""
    return OrderedDict(
        [
            ("f32", 4 * width),
            ("f16", 2 * width),
            ("q8_0", width // 32 * 34 if width % 32 == 0 else None),
            ("q4_0", width // 32 * 18 if width % 32 == 0 else None),
        ]
    )


def _block_index(name: str):
    """N for a blk.N.* tensor, else None."""
    if not name.startswith("blk."):
        return None
    head = name[4:].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _value_str(v) -> str:
    if hasattr(v, "tolist"):
        v = v.tolist()
    if isinstance(v, list) and len(v) > 8:
        return f"[{', '.join(map(str, v[:8]))}, ... ({len(v)} values)]"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def inspect_report(path, list_tensors: bool = True) -> str:
    s = inspect_summary(path)
    out = []
    w = out.append
    w(
        f"{s['path']}: GGUF v{s['version']}, {_fmt_bytes(s['file_size'])}, alignment {s['alignment']}, "
        f"data at {s['data_offset']:#x}, {s['n_metadata']} metadata keys, {s['n_tensors']} tensors"
        + (f", split over {len(s['shards'])} files" if len(s["shards"]) > 1 else "")
    )
    if len(s["shards"]) > 1:
        w("shards:")
        for i, shard in enumerate(s["shards"]):
            w(
                f"  {i + 1:>3}  {shard['path']}  {_fmt_bytes(shard['file_size'])}, {shard['n_tensors']} tensors "
                f"({_fmt_bytes(shard['tensor_bytes'])})"
            )
    w(
        f"arch {s['arch']}"
        + (f"  name '{s['name']}'" if s["name"] else "")
        + (f"  file type {s['file_type']}" if s["file_type"] else "")
    )
    w("")
    w("hyper-parameters:")
    for k, v in s["hparams"].items():
        w(f"  {k:<40} {_value_str(v)}")
    for k, v in s["derived"].items():
        w(f"  {k:<40} {_value_str(v)}   (derived from shapes)")
    a = s["attention"]
    if a.get("kind") == "mla":
        w(
            f"attention: MLA, q {'LoRA rank ' + str(a['q_lora_rank']) if a['q_lora_rank'] else 'one projection'}, "
            f"latent kv_lora_rank {a['kv_lora_rank']} + RoPE {a['rope_dims']}, head q/k {a['head_dim_qk']} v "
            f"{a['head_dim_v']}; KV cache {a['kv_cache_floats_per_token_layer']} floats/token/layer "
            f"(expanded heads would take {a.get('expanded_kv_floats_per_token_layer', '?')})"
        )
        if a.get("indexer_top_k"):
            w(
                f"  sparse attention (DSA): lightning indexer of {a['indexer_heads']} heads x "
                f"{a['indexer_key_length']}, each query attends to its top {a['indexer_top_k']} positions; "
                "the indexer key is cached in the latent row"
            )
        row_bytes = a["latent_bytes_per_token_layer"]
        sizes = ", ".join(f"{t} {'n/a' if b is None else b}" for t, b in row_bytes.items())
        w(f"  latent cache type: {a['latent_cache_type']}; bytes/token/layer {sizes}")
    elif a:
        w(f"attention: {a['kind'].upper()}, KV cache {a['kv_cache_floats_per_token_layer']} floats/token/layer")
        if a.get("rope_dims"):
            w(f"  partial RoPE: the first {a['rope_dims']} of {a['head_dim']} dimensions of each head")
        if a.get("qk_norm"):
            w(f"  q/k RMSNorm: {a['qk_norm']}")
        if a.get("rope"):
            w(f"  RoPE: {a['rope']}")
    r = s.get("routing")
    if r:
        w(
            f"routing: {r['gating']}{' + selection bias (exp_probs_b)' if r['selection_bias'] else ''}"
            + (f", top-k weights {'renormalised' if r['weights_norm'] else 'as scored'}" if "weights_norm" in r else "")
            + f", scale {r['weights_scale']:g}"
            + (f", expert groups {r['groups']}" if "groups" in r else "")
            + f", {r['shared_experts']} shared expert(s){' (gated)' if r['shared_gate'] else ''}"
            + f", {r['leading_dense_layers']} leading dense layer(s)"
        )
        w(f"  expert FFN: {r['expert_ffn']}")
    if a.get("sliding_window"):
        w(f"  sliding window {a['sliding_window']} on layers {a['sliding_layers']}")
    if a.get("sinks"):
        w("  attention sinks: one learned logit per head (attn_sinks)")
    if a.get("deepseek4"):
        d = a["deepseek4"]
        w(
            f"  deepseek4 layers (S sliding window {d['sliding_window']}, C compressed sparse ratio 4 top-"
            f"{d['indexer_top_k']}, H heavily compressed ratio 128): {d['layer_kinds']}; "
            f"{d['hc_streams']} hyper-connection streams; {d['hash_layers']} hash-routed layer(s); "
            f"{d['output_groups']} output groups; f32 KV row floats/position per layer {d['kv_row_floats']}"
        )
    if a.get("llama4"):
        m = a["llama4"]
        w(
            f"  llama4 layers (C = chunked RoPE, {m['chunk']} positions; G = global NoPE with temperature; "
            f"F = full RoPE; N = NoPE): {m['layer_kinds']}"
        )
        w(
            f"  MoE layers {m['moe_layers']} (top-1 sigmoid on the expert input + shared expert), dense "
            f"SwiGLU elsewhere; L2 q/k norm {'on' if m['qk_l2_norm'] else 'off'} (RoPE layers); "
            f"rope_freqs {'present' if m['rope_freqs'] else 'absent'}"
        )
    if s["tokenizer"]:
        t = s["tokenizer"]
        w("")
        w(
            f"tokenizer: {t['model']} (pre '{t.get('pre')}'), {t['n_tokens']} tokens, {t['n_merges']} merges, "
            + ", ".join(
                f"{k} {t[k]}"
                for k in ("bos_token_id", "eos_token_id", "padding_token_id", "add_bos_token")
                if k in t
            )
            + (", chat template" if t["chat_template"] else "")
        )
    w("")
    w("quant mix:")
    total = s["tensor_bytes"] or 1
    for name, e in s["bytes_by_type"].items():
        w(
            f"  {name:<8} {e['tensors']:>6} tensors {_fmt_bytes(e['bytes']):>12} {100 * e['bytes'] / total:6.2f} %  "
            f"{8 * e['bytes'] / max(e['elements'], 1):5.2f} bits/weight"
        )
    w(f"  {'total':<8} {s['n_tensors']:>6} tensors {_fmt_bytes(s['tensor_bytes']):>12}")
    w("")
    w(
        f"routed experts: {_fmt_bytes(s['routed_expert_bytes'])} ({100 * s['routed_expert_bytes'] / total:.1f} %), "
        f"dense (attention, embeddings, norms, routers, shared experts): {_fmt_bytes(s['dense_bytes'])}"
    )
    if s["layer_kinds"] and s["arch"] == "nemotron_h_moe":
        w(f"blocks (M = Mamba-2, E = MoE, * = attention without RoPE): {s['layer_kinds']}")
    elif s["layer_kinds"]:
        w(f"layers (R = Gated DeltaNet, A = gated attention): {s['layer_kinds']}")
    if s["nextn"]:
        n = s["nextn"]
        w(
            f"nextn (multi-token prediction): {n['n_layer']} block(s) {n['blocks']}, {n['tensors']} tensors, "
            f"{_fmt_bytes(n['bytes'])}; the first drafts with --spec-type draft-mtp (Session(mtp=True))"
        )
    w(f"expert reader (--reader auto): {s['expert_reader']['reader']} ({s['expert_reader']['why']})")
    # Said once: without a device the cuFile line only points back at it (no library hints, no CUDA errors).
    device = s["device"]
    w(f"device: {device['describe']}" + ("" if device["present"] else ": running on the CPU"))
    kernels = s["cpu_kernels"]
    w(f"CPU kernels: {kernels['isa']}"
      + ("; fast-mode prefill of Q4_K / Q6_K weights on AMX-INT8 tiles" if kernels["amx_prefill"] else ""))
    cufile = s["cufile_reader"]
    if cufile["usable"]:
        w(f"cuFile reader (--reader cufile): {cufile['library']} loads and a device is present")
    elif not device["present"]:
        w("cuFile reader (--reader cufile): unavailable: needs a CUDA device")
    else:
        w(f"cuFile reader (--reader cufile): unavailable: {cufile['why']}")
    if s["expert_layers"]:
        w("experts per layer (one expert = its gate, up and down slices):")
        w(
            f"  {'layer':>5} {'experts':>7} {'gate':>6} {'up':>6} {'down':>6} {'bytes/expert':>14} {'layer bytes':>12}"
        )
        for e in s["expert_layers"]:
            ty = e["types"]
            w(
                f"  {e['layer']:>5} {e['n_expert']:>7} {ty.get('gate', '-'):>6} {ty.get('up', '-'):>6} "
                f"{ty.get('down', '-'):>6} {_fmt_bytes(e['bytes_per_expert']):>14} {_fmt_bytes(e['bytes']):>12}"
            )
    if list_tensors:
        w("")
        w("tensors:")
        width = max((len(t["name"]) for t in s["tensors"]), default=10)
        split = len(s["shards"]) > 1
        for t in s["tensors"]:
            where = f"  shard {t['shard'] + 1}" if split else ""
            w(
                f"  {t['name']:<{width}} {t['type']:<7} {t['shape']!s:<22} {_fmt_bytes(t['nbytes']):>12}{where}"
            )
    return "\n".join(out) + "\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="GGUF file (any shard of a split model)")
    p.add_argument("--no-tensors", action="store_true", help="leave out the tensor list")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


def run(args: argparse.Namespace) -> None:
    if args.json:
        print(json.dumps(inspect_summary(args.model), indent=2, default=str))
    else:
        sys.stdout.write(inspect_report(args.model, list_tensors=not args.no_tensors))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="sharpi inspect", description=__doc__.split("\n")[0])
    add_arguments(p)
    run(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
