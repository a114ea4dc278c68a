"""`sharpi make-model`: synthetic GGUF models with real shapes, real metadata and a working tokenizer.

What it writes: one GGUF v3 file laid out exactly as llama.cpp's convert_hf_to_gguf.py (float / q8_0
outputs) or llama-quantize (every other quant) would write that architecture: the same tensor names,
ggml shapes, metadata keys and value types, and the same per-tensor type choices for the K_M mixes.
Weights are synthetic:
  - "float" weights (default for models under ~64 MiB, e.g. every "tiny"): normal draws with scales
    chosen so hidden states stay O(1) (linear layers 1/sqrt(fan_in), unit-scale embeddings,
    norms 1 + N(0, 0.05), routers wide enough that top-k is not a coin toss), then quantized properly
    (gguf.quants.quantize for the 32-element types, sharpi.quantize's numpy K-quant quantizers otherwise);
  - "random" weights (default above ~64 MiB): random quantized blocks whose f16 scale fields are
    overwritten with scales calibrated so the dequantized values have the same standard deviation as
    the float weights would. Generated and streamed to disk chunk by chunk (never the whole model in
    RAM) through an O_DIRECT double-buffered writer: the Qwen3-30B-A3B Q4_K_M file (17.3 GiB) takes
    ~18 s of CPU and ~40 s of wall time on the shared 2-core machine, RSS ~240 MB;
  - "sparse": no data at all (a hole; every weight reads as 0): full-size directories in no time.
Weights are drawn directly in llama.cpp's layout: for arch "llama" that is the converter's permuted
q/k row order (normal RoPE); there is no Hugging Face original to permute from.
Owns only the output file (written to `<path>.tmp`, renamed when complete) and a tokenizer cache
(~/.cache/sharpi/tokenizers or $SHARPI_CACHE_DIR); it never reads or modifies anything else.

Tokenizer: a byte-level BPE trained on Python standard-library sources, ChatML chat template
(sharpi.synthetic_tokenizer).

What this module owns: the GGUF metadata, the O_DIRECT writer, write_model() and the CLI. The
parts it assembles are one module each, and data flows from them into here:
  tensor_plan.py          the tensors of each architecture and the ggml type each gets (QUANTS)
  synthetic_weights.py    the bytes of one tensor, drawn from (seed, tensor name)
  quantize.py             numpy quantizers, float32 -> ggml blocks
  synthetic_tokenizer.py  the trained BPE tokenizer and its GGUF metadata
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

import gguf
import numpy as np

from . import presets
from ._core import InvalidArgument
from .presets import HYBRID_ARCHES, MLA_ARCHES, HParams
from .progress import bar
from .progress import write as progress_write
from .synthetic_tokenizer import FIM_TOKENS, SPECIAL_TOKENS, tokenizer_metadata
from .synthetic_weights import tensor_data
from .tensor_plan import QUANTS, QuantRecipe, plan_tensors, quant_recipe

QT = gguf.GGMLQuantizationType

# ==================================================================================================
# Metadata
# ==================================================================================================


def _write_hybrid_metadata(w: gguf.GGUFWriter, hp: HParams) -> None:
    """The Gated DeltaNet keys of qwen3next / qwen35moe, as the converter writes them."""
    a = hp.arch
    for key, value in (
        ("ssm.conv_kernel", hp.ssm_d_conv),
        ("ssm.state_size", hp.ssm_d_state),
        ("ssm.group_count", hp.ssm_n_group),
        ("ssm.time_step_rank", hp.ssm_dt_rank),
        ("ssm.inner_size", hp.ssm_d_inner),
        ("full_attention_interval", hp.full_attention_interval),
        ("rope.dimension_count", hp.n_rot or hp.head_dim),
    ):
        w.add_uint32(f"{a}.{key}", value)
    recurrent = [(il + 1) % hp.full_attention_interval != 0 for il in range(hp.n_layer)]
    w.add_array(f"{a}.attention.recurrent_layers", recurrent + [False] * hp.n_layer_nextn)
    if hp.n_layer_nextn:
        w.add_uint32(f"{a}.nextn_predict_layers", hp.n_layer_nextn)
    if a == "qwen35moe":
        # Interleaved MRoPE sections (llama.cpp requires the key); for text they act as plain RoPE.
        half = (hp.n_rot or hp.head_dim) // 2
        first = (half + 2) // 3
        w.add_array(f"{a}.rope.dimension_sections", [first, first, half - 2 * first, 0])


def _write_metadata(
    w: gguf.GGUFWriter, hp: HParams, recipe: QuantRecipe, tok: dict, preset: str, seed: int, weights: str
) -> None:
    """Keys and value types as convert_hf_to_gguf.py writes them for hp.arch."""
    w.add_type("model")
    w.add_name(f"sharpi synthetic {preset} {hp.arch}")
    w.add_block_count(hp.n_layer + hp.n_layer_nextn)  # the nextn (MTP) blocks count too
    w.add_context_length(hp.n_ctx_train)
    w.add_embedding_length(hp.n_embd)
    # feed_forward_length is the HF "intermediate_size": the expert width for Mixtral and OLMoE, the
    # dense width (unused by the MoE layers) for the Qwen MoE models.
    dense_ff_key = hp.arch in ("qwen2moe", "qwen3moe", "glm4moe", "llama4") + MLA_ARCHES or not hp.is_moe
    if hp.arch == "nemotron_h_moe":
        # Per block: the expert width on MoE blocks, the KV heads on attention blocks, 0 elsewhere;
        # an MTP block ("B") holds both (the converter registers it as attention and MoE).
        blocks = hp.layer_pattern + "B" * hp.n_layer_nextn
        w.add_feed_forward_length([hp.n_ff_exp if c in "EB" else 0 for c in blocks])
        w.add_head_count(hp.n_head)
        w.add_head_count_kv([hp.n_head_kv if c in "*B" else 0 for c in blocks])
    else:
        if hp.arch != "deepseek4":  # V4's config has no intermediate_size
            w.add_feed_forward_length(hp.n_ff if dense_ff_key else hp.n_ff_exp)
        w.add_head_count(hp.n_head)
        w.add_head_count_kv(hp.n_head_kv)
    if hp.arch in MLA_ARCHES:
        _write_deepseek2_metadata(w, hp)
    if hp.arch == "gpt-oss":
        # GptOssModel.set_gguf_parameters: head_dim explicit, the window, the expert width, YaRN.
        w.add_key_length(hp.head_dim)
        w.add_value_length(hp.head_dim)
        w.add_sliding_window(hp.n_swa)
        w.add_expert_feed_forward_length(hp.n_ff_exp)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(hp.yarn_factor)
        w.add_rope_scaling_orig_ctx_len(hp.yarn_n_ctx_orig)
    if hp.arch == "nemotron_h_moe":
        w.add_layer_norm_eps(hp.rms_eps)  # the converter's only epsilon key for it
    else:
        w.add_rope_freq_base(hp.rope_freq_base)
        w.add_layer_norm_rms_eps(hp.rms_eps)
    if hp.is_moe:
        w.add_expert_count(hp.n_expert)
        w.add_expert_used_count(hp.n_expert_used)
    # key_length / value_length exist when the HF config has head_dim: Qwen3 always, Llama when set.
    key_length_archs = ("qwen3", "qwen3moe", "glm4moe", "llama4", "minimax-m2", "deepseek4") + HYBRID_ARCHES
    if hp.arch in key_length_archs or (hp.arch == "llama" and hp.q_width != hp.n_embd):
        w.add_key_length(hp.head_dim)
        w.add_value_length(hp.head_dim)
    w.add_file_type(int(recipe.ftype))
    if hp.arch in ("qwen2moe", "qwen3moe") + HYBRID_ARCHES:
        w.add_expert_feed_forward_length(hp.n_ff_exp)
    if hp.arch in ("qwen2moe",) + HYBRID_ARCHES:
        w.add_expert_shared_feed_forward_length(hp.n_ff_shexp)
    if hp.arch in HYBRID_ARCHES:
        _write_hybrid_metadata(w, hp)
    if hp.arch == "glm4moe":
        _write_glm4moe_metadata(w, hp)
    if hp.arch == "nemotron_h_moe":
        _write_nemotron_h_moe_metadata(w, hp)
    if hp.arch == "minimax-m2":
        # MiniMaxM2Model.set_gguf_parameters: the expert width and rotary_dim; the common keys before
        # include expert_gating_func from the config's scoring_func ("sigmoid" in MiniMax-M2's).
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_feed_forward_length(hp.n_ff_exp)
        w.add_rope_dimension_count(hp.n_rot or hp.head_dim)
    if hp.arch == "deepseek4":
        _write_deepseek4_metadata(w, hp)
    if hp.arch in ("llama", "llama4"):
        w.add_vocab_size(hp.n_vocab)
        w.add_rope_dimension_count(hp.head_dim)
    if hp.arch == "llama4":
        # Llama4Model.set_gguf_parameters (llama3 RoPE scaling goes to the rope_freqs tensor, no key).
        w.add_interleave_moe_layer_step(hp.moe_layer_step)
        w.add_expert_feed_forward_length(hp.n_ff_exp)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["token_type"])
    w.add_token_merges(tok["merges"])
    w.add_bos_token_id(tok["bos_token_id"])
    w.add_eos_token_id(tok["eos_token_id"])
    w.add_pad_token_id(tok["padding_token_id"])
    w.add_add_bos_token(False)
    w.add_chat_template(tok["chat_template"])
    if tok["fim_ids"] is not None:  # as convert_hf_to_gguf.py writes a coder model's FIM tokens
        for key, token_id in zip((gguf.Keys.Tokenizer.FIM_PRE_ID, gguf.Keys.Tokenizer.FIM_SUF_ID,
                                  gguf.Keys.Tokenizer.FIM_MID_ID), tok["fim_ids"]):
            w.add_uint32(key, token_id)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    # sharpi's own provenance keys (ignored by other readers).
    w.add_bool("sharpi.synthetic", True)
    w.add_string("sharpi.preset", preset)
    w.add_uint32("sharpi.seed", seed)
    w.add_string("sharpi.weights", weights)


def _write_deepseek4_metadata(w: gguf.GGUFWriter, hp: HParams) -> None:
    """The keys DeepseekV4Model.set_gguf_parameters writes after the common ones (by key name: the
    installed gguf package may predate V4's writer methods)."""
    a, n = hp.arch, hp.n_layer + hp.n_layer_nextn  # per-block arrays count the MTP blocks
    w.add_uint32(f"{a}.expert_gating_func", 4)  # sqrt(softplus) (llama.cpp's enum)
    w.add_rope_dimension_count(hp.n_rot)
    w.add_q_lora_rank(hp.n_lora_q)
    w.add_sliding_window(hp.n_swa)
    w.add_expert_feed_forward_length(hp.n_ff_exp)
    w.add_expert_shared_count(hp.n_ff_shexp // hp.n_ff_exp)
    w.add_expert_weights_scale(hp.expert_weights_scale)
    w.add_expert_weights_norm(True)
    w.add_array(f"{a}.swiglu_clamp_exp", [float(hp.swiglu_clamp)] * n)
    w.add_array(f"{a}.swiglu_clamp_shexp", [float(hp.swiglu_clamp)] * n)
    w.add_uint32(f"{a}.attention.indexer.head_count", hp.indexer_n_head)
    w.add_uint32(f"{a}.attention.indexer.key_length", hp.indexer_head_dim)
    w.add_uint32(f"{a}.attention.indexer.top_k", hp.indexer_top_k)
    w.add_uint32(f"{a}.attention.output_group_count", hp.o_groups)
    w.add_uint32(f"{a}.attention.output_lora_rank", hp.o_lora_rank)
    # The MTP blocks are sliding-window only (ratio 0), as DeepSeek-V4's config lists its block.
    w.add_array(f"{a}.attention.compress_ratios", [int(r) for r in hp.compress_ratios] + [0] * hp.n_layer_nextn)
    w.add_float32(f"{a}.attention.compress_rope_freq_base", hp.compress_rope_freq_base)
    w.add_uint32(f"{a}.hyper_connection.count", hp.hc_mult)
    w.add_uint32(f"{a}.hyper_connection.sinkhorn_iterations", hp.hc_sinkhorn_iters)
    w.add_float32(f"{a}.hyper_connection.epsilon", hp.hc_eps)
    w.add_uint32(f"{a}.hash_layer_count", hp.n_hash_layers)
    w.add_uint32(f"{a}.embedding_length_out", hp.n_embd * hp.hc_mult)
    if hp.n_layer_nextn:  # as the converter's --mtp sidecar writes it
        w.add_uint32(f"{a}.nextn_predict_layers", hp.n_layer_nextn)


def _write_nemotron_h_moe_metadata(w: gguf.GGUFWriter, hp: HParams) -> None:
    """The keys NemotronHModel (over Mamba2Model) writes after the common ones: expert groups, the
    vocabulary size, the Mamba-2 shape, head widths and the MoE layout (no expert_gating_func: llama.cpp
    hard-codes sigmoid for nemotron_h_moe)."""
    a = hp.arch
    w.add_expert_group_count(1)
    w.add_expert_group_used_count(1)
    w.add_vocab_size(hp.n_vocab)
    w.add_rope_dimension_count(hp.n_embd // hp.n_head)  # the converter writes it; nothing rotates
    for key, value in (
        ("ssm.conv_kernel", hp.ssm_d_conv),
        ("ssm.state_size", hp.ssm_d_state),
        ("ssm.group_count", hp.ssm_n_group),
        ("ssm.inner_size", hp.ssm_d_inner),
        ("ssm.time_step_rank", hp.ssm_dt_rank),
    ):
        w.add_uint32(f"{a}.{key}", value)
    w.add_bool(f"{a}.rope.scaling.finetuned", False)
    w.add_key_length(hp.head_dim)
    w.add_value_length(hp.head_dim)
    w.add_expert_feed_forward_length(hp.n_ff_exp)
    w.add_expert_shared_feed_forward_length(hp.n_ff_shexp)
    w.add_expert_shared_count(1)
    w.add_expert_weights_norm(True)
    w.add_expert_weights_scale(hp.expert_weights_scale)
    if hp.n_layer_nextn:
        w.add_nextn_predict_layers(hp.n_layer_nextn)


def _write_glm4moe_metadata(w: gguf.GGUFWriter, hp: HParams) -> None:
    """The keys Glm4MoeModel.set_gguf_parameters writes after the common ones: partial RoPE, the
    expert layout, leading dense layers, sigmoid gating, routed scaling, top-k renormalisation
    (norm_topk_prob is true in every GLM-4.5/4.6/4.7 config) and the MTP block count."""
    w.add_rope_dimension_count(hp.n_rot or hp.head_dim // 2)
    w.add_expert_feed_forward_length(hp.n_ff_exp)
    w.add_expert_shared_count(hp.n_ff_shexp // hp.n_ff_exp)
    w.add_leading_dense_block_count(hp.n_layer_dense_lead)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_scale(hp.expert_weights_scale)
    w.add_expert_weights_norm(True)
    if hp.n_layer_nextn:
        w.add_nextn_predict_layers(hp.n_layer_nextn)


def _write_deepseek2_metadata(w: gguf.GGUFWriter, hp: HParams) -> None:
    """The MLA, routing and YaRN keys DeepseekV2Model.set_gguf_parameters writes (MLA as MQA over the
    latent: key_length = kv_lora_rank + n_rot, value_length = kv_lora_rank)."""
    w.add_leading_dense_block_count(hp.n_layer_dense_lead)
    w.add_vocab_size(hp.n_vocab)
    if hp.n_lora_q:
        w.add_q_lora_rank(hp.n_lora_q)
    w.add_kv_lora_rank(hp.n_lora_kv)
    w.add_key_length(hp.n_lora_kv + hp.n_rot)
    w.add_value_length(hp.n_lora_kv)
    w.add_key_length_mla(hp.head_dim)
    w.add_value_length_mla(hp.head_dim_v)
    w.add_expert_feed_forward_length(hp.n_ff_exp)
    w.add_expert_shared_count(hp.n_ff_shexp // hp.n_ff_exp)
    w.add_expert_weights_scale(hp.expert_weights_scale)
    w.add_rope_dimension_count(hp.n_rot)
    if hp.yarn_factor > 1.0:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(hp.yarn_factor)
        w.add_rope_scaling_orig_ctx_len(hp.yarn_n_ctx_orig)
        w.add_rope_scaling_yarn_log_mul(0.1 * hp.yarn_mscale_all_dim)
        if hp.arch == "deepseek32":  # the converter's beta keys (DeepSeek's configs: 32 and 1)
            w.add_rope_scaling_yarn_beta_fast(32.0)
            w.add_rope_scaling_yarn_beta_slow(1.0)
    if hp.arch == "deepseek32":
        # DeepseekV32Model: V3's routing keys (in the common keys' place for the groups), the MTP
        # block count, then the DSA indexer.
        if hp.n_expert_group:
            w.add_expert_group_count(hp.n_expert_group)
            w.add_expert_group_used_count(hp.n_expert_group_used)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_norm(True)
        if hp.n_layer_nextn:
            w.add_nextn_predict_layers(hp.n_layer_nextn)
        w.add_indexer_head_count(hp.indexer_n_head)
        w.add_indexer_key_length(hp.indexer_head_dim)
        w.add_indexer_top_k(hp.indexer_top_k)


# ==================================================================================================
# Writing
# ==================================================================================================

FLOAT_WEIGHTS_LIMIT = 64 << 20  # models below this get real float weights by default
SINK_BUFFER = 32 << 20  # O_DIRECT write unit (a multiple of 4 KiB)


class _DirectSink:
    """Sequential file writer for multi-GB outputs: O_DIRECT writes of page-aligned 32 MiB buffers from
    a background thread, double-buffered so generation (main thread) overlaps the disk.

    Owns the fd and two anonymous-mmap (page-aligned) buffers. Why O_DIRECT: on the project machines
    buffered writes of a 17 GB file run at 0.2-0.4 GB/s under dirty-page throttling, O_DIRECT at the
    disk's ~1 GB/s, and it leaves the page cache (other people's working sets) alone. The last partial
    buffer is zero-padded to 4 KiB and the file truncated back to its exact length. Falls back to
    buffered writes where O_DIRECT is refused (tmpfs). Never reads the file; single producer thread.
    """

    def __init__(self, path: Path):
        import mmap
        import queue
        import threading

        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        try:
            self._fd = os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o644)
        except OSError:
            self._fd = os.open(path, flags, 0o644)
        self._bufs = [mmap.mmap(-1, SINK_BUFFER) for _ in range(2)]
        self._free: queue.Queue = queue.Queue()
        self._full: queue.Queue = queue.Queue()
        for i in range(len(self._bufs)):
            self._free.put(i)
        self._error: BaseException | None = None
        self._cur = self._free.get()
        self._fill = 0
        self._size = 0
        self._thread = threading.Thread(target=self._drain, name="make-model-writer", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while True:
            item = self._full.get()
            if item is None:
                return
            i, n = item
            try:
                if self._error is None:
                    view, done = memoryview(self._bufs[i]), 0
                    while done < n:
                        done += os.write(self._fd, view[done:n])
            except BaseException as e:  # noqa: BLE001 -- re-raised in the producer on its next call
                self._error = e
            self._free.put(i)

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def tell(self) -> int:
        return self._size

    def write(self, data) -> None:
        mv = memoryview(data).cast("B")
        while len(mv):
            self._check()
            take = min(len(mv), SINK_BUFFER - self._fill)
            self._bufs[self._cur][self._fill : self._fill + take] = mv[:take]
            self._fill += take
            self._size += take
            mv = mv[take:]
            if self._fill == SINK_BUFFER:
                self._full.put((self._cur, SINK_BUFFER))
                self._cur, self._fill = self._free.get(), 0

    def close(self) -> None:
        try:
            if self._fill:
                padded = -(-self._fill // 4096) * 4096
                self._bufs[self._cur][self._fill : padded] = bytes(padded - self._fill)
                self._full.put((self._cur, padded))
            self._full.put(None)
            self._thread.join()
            self._check()
            os.ftruncate(self._fd, self._size)
        finally:
            os.close(self._fd)
            for b in self._bufs:
                b.close()


def write_model(
    path,
    arch: str | None = None,
    preset: str = "tiny",
    quant: str = "f32",
    seed: int = 0,
    vocab_size: int | None = None,
    *,
    weights: str = "auto",
    pure: bool = False,
    fim: bool = False,
    progress: Callable[[str], None] | None = None,
    progress_bar: bool = False,
    **overrides,
) -> dict:
    """Writes a synthetic model and returns a summary dict.

    arch: one of presets.ARCHES, or None for the preset's own (qwen3moe for "tiny"); a preset that
    fixes its arch (every one but "tiny") rejects a different one. quant: a key of QUANTS.
    vocab_size: overrides the preset's vocabulary size. weights: "float" (normal draws, quantized),
    "random" (random blocks with calibrated scales, streamed), "auto" (float below 64 MiB, else random)
    or "sparse" (no data written: the file is extended with a hole, every weight reads as zero; full
    size shapes in no time and no disk, for tests of readers, planners and inspect).
    pure: every weight matrix in the quant's base type (llama-quantize --pure). fim: the vocabulary
    has fill-in-the-middle tokens (<|fim_prefix|> <|fim_suffix|> <|fim_middle|>, named by
    tokenizer.ggml.fim_pre/suf/mid_token_id), as a coder model's has. progress: called
    with a line after each large tensor; progress_bar: a bar of the bytes written on stderr
    (sharpi.progress: shown on a terminal only). overrides: any
    presets.HParams field (n_layer=4, n_expert=16, ...). Raises InvalidArgument on bad arguments.
    """
    t0 = time.perf_counter()
    if vocab_size is not None:
        overrides["n_vocab"] = vocab_size
    hp = presets.resolve(arch, preset, **overrides)
    recipe = quant_recipe(quant)
    if weights not in ("auto", "float", "random", "sparse"):
        raise InvalidArgument(f"weights must be 'auto', 'float', 'random' or 'sparse', not '{weights}'")
    specs = plan_tensors(hp, quant, pure)
    total = sum(s.nbytes for s in specs)
    if weights == "auto":
        weights = "float" if total < FLOAT_WEIGHTS_LIMIT else "random"

    tok = tokenizer_metadata(hp.n_vocab, fim=fim)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), hp.arch)
    _write_metadata(w, hp, recipe, tok, preset, seed, weights)
    for s in specs:
        dtype = np.float16 if s.type == QT.F16 else np.float32
        w.add_tensor_info(
            s.name,
            s.numpy_shape,
            np.dtype(dtype),
            s.nbytes,
            raw_dtype=None if s.type in (QT.F32, QT.F16) else s.type,
        )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()

    t_data = time.perf_counter()
    alignment = w.data_alignment
    try:
        header = tmp.read_bytes()
        data_start = -(-len(header) // alignment) * alignment
        if weights == "sparse":
            end = data_start + sum(-(-s.nbytes // alignment) * alignment for s in specs)
            os.truncate(tmp, end)
        else:
            sink = _DirectSink(tmp)
            written = bar(desc=f"writing {path.name}", total=total, unit="B", disable=not progress_bar)
            try:
                sink.write(header)
                sink.write(bytes(data_start - len(header)))
                for i, s in enumerate(specs):
                    start = sink.tell()
                    for chunk in tensor_data(s, seed, weights):
                        chunk = np.ascontiguousarray(chunk)
                        sink.write(chunk)
                        written.update(chunk.nbytes)
                    if sink.tell() - start != s.nbytes:
                        raise AssertionError(
                            f"{s.name}: wrote {sink.tell() - start} bytes, expected {s.nbytes}"
                        )
                    sink.write(bytes(-s.nbytes % alignment))
                    if progress and (s.nbytes > 64 << 20 or i == len(specs) - 1):
                        progress(
                            f"{s.name} {s.type.name.lower()} {s.nbytes / 2**20:.0f} MiB "
                            f"({sink.tell() / 2**30:.2f} GiB written)"
                        )
            finally:
                written.close()
                sink.close()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    t_end = time.perf_counter()

    size = path.stat().st_size
    by_type: dict[str, int] = {}
    for s in specs:
        by_type[s.type.name.lower()] = by_type.get(s.type.name.lower(), 0) + s.nbytes
    return {
        "path": str(path),
        "arch": hp.arch,
        "preset": preset,
        "quant": quant,
        "file_type": int(recipe.ftype),
        "hparams": dataclasses.asdict(hp),
        "weights": weights,
        "seed": seed,
        "n_tensors": len(specs),
        "file_size": size,
        "tensor_bytes": total,
        "bytes_by_type": by_type,
        "seconds": t_end - t0,
        "data_seconds": t_end - t_data,
        "write_gbps": total / max(t_end - t_data, 1e-9) / 1e9,
        "tokenizer": {
            "n_vocab": hp.n_vocab,
            "n_trained": tok["n_trained"],
            "bos_token_id": tok["bos_token_id"],
            "eos_token_id": tok["eos_token_id"],
            "padding_token_id": tok["padding_token_id"],
            "special_tokens": list(SPECIAL_TOKENS) + (list(FIM_TOKENS) if fim else []),
        },
    }


# ==================================================================================================
# Command line (the `sharpi make-model` subcommand reuses add_arguments / run)
# ==================================================================================================


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("output", help="path of the .gguf file to write")
    p.add_argument(
        "--arch",
        choices=presets.ARCHES,
        default=None,
        help="architecture (default: the preset's; qwen3moe for tiny)",
    )
    p.add_argument("--preset", choices=list(presets.PRESETS), default="tiny")
    p.add_argument("--quant", choices=list(QUANTS), default="f32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=None)
    p.add_argument("--weights", choices=["auto", "float", "random", "sparse"], default="auto")
    p.add_argument("--pure", action="store_true", help="every weight matrix in the quant's base type")
    p.add_argument("--fim", action="store_true",
                   help="add fill-in-the-middle tokens (<|fim_prefix|> <|fim_suffix|> <|fim_middle|>) to the vocabulary")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help=f"override a hyper-parameter ({', '.join(presets.FIELDS)}); repeatable",
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


def parse_overrides(items: list[str]) -> dict:
    """`--set FIELD=VALUE` items as write_model keyword overrides, typed by HParams' fields."""
    types = {f.name: f.type for f in dataclasses.fields(HParams)}
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in types or key == "arch":
            raise InvalidArgument(
                f"--set expects FIELD=VALUE with FIELD one of {', '.join(presets.FIELDS)}: '{item}'"
            )
        kind = types[key]
        if kind == "tuple":  # deepseek4's compress_ratios: comma-separated integers
            out[key] = tuple(int(v) for v in value.split(",") if v.strip())
        elif kind == "str":
            out[key] = value
        elif kind == "float":
            out[key] = float(value)
        elif kind == "bool":
            out[key] = value.lower() in ("1", "true", "yes")
        else:
            out[key] = int(value)
    return out


def run(args: argparse.Namespace) -> dict:
    info = write_model(
        args.output,
        arch=args.arch,
        preset=args.preset,
        quant=args.quant,
        seed=args.seed,
        vocab_size=args.vocab_size,
        weights=args.weights,
        pure=args.pure,
        fim=args.fim,
        progress=None if args.json else lambda msg: progress_write("  " + msg),
        progress_bar=True,
        **parse_overrides(args.set),
    )
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(
            f"wrote {info['path']}: {info['arch']} {info['preset']} {info['quant']}, {info['n_tensors']} tensors, "
            f"{info['file_size'] / 2**30:.2f} GiB in {info['seconds']:.1f} s "
            f"(data {info['write_gbps']:.2f} GB/s, {info['weights']} weights)"
        )
    return info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="sharpi make-model", description=__doc__.split("\n")[0])
    add_arguments(p)
    run(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
