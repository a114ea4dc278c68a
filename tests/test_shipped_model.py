"""The shipped model (python/sharpi/models/stdlib-moe-q8_0.gguf) against transformers.

Oracle: transformers' Qwen3MoeForCausalLM holding the file's own weights, dequantized by the `gguf`
package (an implementation independent of sharpi's reader and kernels). The file was written by
llama.cpp's converter; qwen3moe uses NeoX RoPE, so the converter did not reorder q/k rows and the
tensors load into transformers' layout as they are (experts: ggml ne [n_embd, n_ff, n_expert] is
numpy [n_expert, n_ff, n_embd], transformers' layout).

Checked:
- the held-out loss the model card states is what transformers computes on these weights (±0.02),
  on the held-out token stream kept in tests/data (so the check does not depend on the local stdlib);
- sharpi follows transformers' greedy path for 32 steps on 4 held-out prompts, with every step's
  logits within the stated relative error, in exact mode (f32 math on the dequantized weights: the
  oracle's arithmetic) to the foundation budget 1e-3. The default fast mode (q8_0 activations, as
  llama.cpp does) is held to exact mode in test_fast_mode.py (same 16 greedy tokens, >= 95% top-1
  agreement), not to transformers;
- the routing trace in tests/data is what transformers computes (it is test data for predictors,
  so it must be the shipped model's real routing);
- where llama-cpp-python is installed, llama.cpp follows the same greedy path.

Skips when torch or transformers are missing.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from ci_policy import require_llama_cpp

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "python" / "sharpi" / "models" / "stdlib-moe-q8_0.gguf"
CARD = REPO / "python" / "sharpi" / "models" / "MODEL_CARD.md"
DATA = Path(__file__).resolve().parent / "data"
HELDOUT = DATA / "stdlib_moe_heldout_tokens.npz"
TRACE = DATA / "stdlib_moe_trace.npz"

N_PROMPTS = 4
PROMPT_TOKENS = 32
GREEDY_STEPS = 32


def _field(reader, key):
    field = reader.fields[key]
    value = field.parts[field.data[0]]
    return bytes(value).decode() if field.types[0] == gguf.GGUFValueType.STRING else value.tolist()[0]


@pytest.fixture(scope="module")
def hf_model():
    """transformers model with the shipped file's dequantized weights (float32, eval mode)."""
    torch.set_num_threads(2)
    reader = gguf.GGUFReader(str(MODEL))
    assert _field(reader, "general.architecture") == "qwen3moe"
    tensors = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        tensors[t.name] = torch.from_numpy(
            np.asarray(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type), dtype=np.float32)
            .reshape(shape)
            .copy()
        )
    p = "qwen3moe."
    n_layer = _field(reader, p + "block_count")
    config = transformers.Qwen3MoeConfig(
        vocab_size=tensors["token_embd.weight"].shape[0],
        hidden_size=_field(reader, p + "embedding_length"),
        num_hidden_layers=n_layer,
        num_attention_heads=_field(reader, p + "attention.head_count"),
        num_key_value_heads=_field(reader, p + "attention.head_count_kv"),
        head_dim=_field(reader, p + "attention.key_length"),
        moe_intermediate_size=_field(reader, p + "expert_feed_forward_length"),
        intermediate_size=4 * _field(reader, p + "expert_feed_forward_length"),
        num_experts=_field(reader, p + "expert_count"),
        num_experts_per_tok=_field(reader, p + "expert_used_count"),
        norm_topk_prob=True,  # llama.cpp's qwen3moe always renormalises the top-k weights
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings="output.weight" not in tensors,
        max_position_embeddings=_field(reader, p + "context_length"),
        rms_norm_eps=float(_field(reader, p + "attention.layer_norm_rms_epsilon")),
        rope_parameters={"rope_type": "default", "rope_theta": float(_field(reader, p + "rope.freq_base"))},
    )
    config._attn_implementation = "eager"
    model = transformers.Qwen3MoeForCausalLM(config).to(torch.float32)
    sd = {
        "model.embed_tokens.weight": tensors["token_embd.weight"],
        "model.norm.weight": tensors["output_norm.weight"],
    }
    if "output.weight" in tensors:
        sd["lm_head.weight"] = tensors["output.weight"]
    for il in range(n_layer):
        b, h = f"blk.{il}.", f"model.layers.{il}."
        pairs = {
            "input_layernorm.weight": "attn_norm.weight",
            "post_attention_layernorm.weight": "ffn_norm.weight",
            "self_attn.q_proj.weight": "attn_q.weight",
            "self_attn.k_proj.weight": "attn_k.weight",
            "self_attn.v_proj.weight": "attn_v.weight",
            "self_attn.o_proj.weight": "attn_output.weight",
            "self_attn.q_norm.weight": "attn_q_norm.weight",
            "self_attn.k_norm.weight": "attn_k_norm.weight",
            "mlp.gate.weight": "ffn_gate_inp.weight",
            "mlp.experts.down_proj": "ffn_down_exps.weight",
        }
        for hf_name, gguf_name in pairs.items():
            sd[h + hf_name] = tensors[b + gguf_name]
        sd[h + "mlp.experts.gate_up_proj"] = torch.cat(
            [tensors[b + "ffn_gate_exps.weight"], tensors[b + "ffn_up_exps.weight"]], 1
        )
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected, unexpected
    assert set(missing) <= {"lm_head.weight"}, missing
    if "output.weight" not in tensors:
        model.tie_weights()
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model.eval()


@pytest.fixture(scope="module")
def prompts():
    """4 held-out prompts: the first 32 tokens of each traced held-out file (starting at its BOS)."""
    trace = np.load(TRACE)
    return [
        trace["tokens"][s : s + PROMPT_TOKENS].astype(np.int64).tolist()
        for s in trace["seq_start"][:N_PROMPTS]
    ]


@pytest.fixture(scope="module")
def reference_paths(hf_model, prompts):
    """Per prompt: (greedy token sequence, logits [len(prompt) + GREEDY_STEPS - 1 ... ] per position)."""
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(GREEDY_STEPS):
                logits = hf_model(input_ids=torch.tensor([ids])).logits[0, -1]
                ids.append(int(torch.argmax(logits)))
            # One pass over the whole path gives the logits after every position (causal model).
            logits = hf_model(input_ids=torch.tensor([ids])).logits[0].double().numpy()
            out.append((ids, logits))
    return out


def _stated_heldout_ce() -> float:
    match = re.search(
        r"held-out cross-entropy[^\n]*?:\s*\**([0-9]+\.[0-9]+)", CARD.read_text(encoding="utf-8")
    )
    assert match, f"{CARD} does not state the held-out cross-entropy"
    return float(match.group(1))


def test_shipped_file_is_small_and_from_the_converter():
    assert MODEL.stat().st_size <= 20 * 1000 * 1000
    reader = gguf.GGUFReader(str(MODEL))
    assert _field(reader, "tokenizer.ggml.pre") == "gpt-2"
    assert _field(reader, "tokenizer.ggml.model") == "gpt2"
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == "Q8_0"
    assert types["blk.0.ffn_gate_inp.weight"] == "F32"  # routers stay f32 in quantized files


@pytest.mark.slow
def test_heldout_loss_matches_model_card(hf_model):
    """Every window of the held-out stream: each token after the window's first is predicted from
    those before it in the window; mean cross-entropy in nats per predicted token."""
    data = np.load(HELDOUT)
    tokens, seq_len = data["tokens"].astype(np.int64), int(data["seq_len"])
    windows = [tokens[i : i + seq_len] for i in range(0, len(tokens), seq_len)]
    windows = [w for w in windows if len(w) >= 2]
    nll, count = 0.0, 0
    with torch.no_grad():
        full = [w for w in windows if len(w) == seq_len]
        batches = [full[i : i + 8] for i in range(0, len(full), 8)] + [
            [w] for w in windows if len(w) != seq_len
        ]
        for batch in batches:
            ids = torch.from_numpy(np.stack(batch))
            logits = hf_model(input_ids=ids).logits[:, :-1].double()
            nll += torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum"
            ).item()
            count += ids[:, 1:].numel()
    assert count == len(tokens) - len(windows)
    ce = nll / count
    stated = _stated_heldout_ce()
    assert abs(ce - stated) <= 0.02, f"transformers gives {ce:.4f} nats/token, the card states {stated}"
    assert ce <= 3.0, f"held-out cross-entropy {ce:.4f} above the 3.0 target"


def test_trace_is_the_models_routing(hf_model):
    """The shipped routing trace holds what the shipped weights select (ids and probabilities)."""
    trace = np.load(TRACE)
    top_k = int(trace["top_k"])
    starts = list(trace["seq_start"]) + [len(trace["tokens"])]
    for i in range(len(starts) - 1):
        ids = torch.from_numpy(trace["tokens"][starts[i] : starts[i + 1]].astype(np.int64))[None]
        with torch.no_grad():
            out = hf_model(input_ids=ids, output_router_logits=True)
        probs = torch.softmax(torch.stack(out.router_logits).float(), dim=-1)  # [layers, tokens, experts]
        recorded = trace["experts"][starts[i] : starts[i + 1]]  # [tokens, layers, k]
        top = torch.topk(probs, top_k, dim=-1)
        expected = top.indices.permute(1, 0, 2).numpy()
        # Rows are sets; a float16-level near-tie may swap ranks but not membership.
        same = np.sort(recorded, axis=-1) == np.sort(expected, axis=-1)
        assert same.mean() > 0.999, f"sequence {i}: {np.argwhere(~same.all(-1))[:5]}"
        np.testing.assert_allclose(
            trace["scores"][starts[i] : starts[i + 1]].astype(np.float32),
            top.values.permute(1, 0, 2).numpy(),
            atol=2e-3,
        )


def _rel_error(got, want):
    return float(np.max(np.abs(np.asarray(got, dtype=np.float64) - want)) / np.max(np.abs(want)))


def test_sharpi_follows_transformers(reference_paths):
    import sharpi

    budget = 1e-3
    session = sharpi.Session(str(MODEL), threads=2, exact=True)
    for n, (path, want) in enumerate(reference_paths):
        session.reset()
        prompt = path[:PROMPT_TOKENS]
        got = session.decode(prompt, all_logits=True)
        assert got.shape == (PROMPT_TOKENS, want.shape[1])
        err = _rel_error(got, want[:PROMPT_TOKENS])
        assert err <= budget, f"prompt {n}: prefill logits rel. error {err:.2e} > {budget}"
        last = got[-1]
        for step in range(GREEDY_STEPS):
            pos = PROMPT_TOKENS + step
            token = int(np.argmax(last))
            margin = np.sort(want[pos - 1])[-1] - np.sort(want[pos - 1])[-2]
            assert token == path[pos], (
                f"prompt {n} step {step}: sharpi picks {token}, transformers {path[pos]} (top-2 margin {margin:.3g})"
            )
            if step == GREEDY_STEPS - 1:
                break
            last = session.decode([token], all_logits=True)[-1]
            err = _rel_error(last, want[pos])
            assert err <= budget, f"prompt {n} step {step}: logits rel. error {err:.2e} > {budget}"


def test_sharpi_tokenizer_matches_training_tokenization():
    """The tokenizer sharpi builds from the file's metadata splits held-out text into the ids the
    model was trained and evaluated on (the trace holds `tokenizers`' own encoding of those files)."""
    import sharpi

    session = sharpi.Session(str(MODEL), threads=1)
    trace = np.load(TRACE)
    offsets = trace["token_str_offsets"]
    starts = list(trace["seq_start"]) + [len(trace["tokens"])]
    for i in range(len(starts) - 1):
        lo, hi = starts[i], starts[i + 1]
        assert trace["tokens"][lo] == 0  # every traced sequence starts at a file's <|endoftext|>
        # Token i is bytes [offsets[i], offsets[i + 1]); the cut after the last traced token may fall
        # inside a character, so the text stops at the last complete one.
        raw = bytes(trace["token_str_utf8"][offsets[lo + 1] : offsets[hi]])
        text = raw.decode("utf-8", errors="ignore")
        ids = session.tokenize(text)
        want = trace["tokens"][lo:hi].tolist()
        assert ids[0] == 0, "add_bos_token is set: the prompt must start with <|endoftext|>"
        # The cut may also split the final word differently; everything before it must match.
        n = len(want) - 8
        assert ids[:n] == want[:n], (
            f"sequence {i}: first difference at {next(j for j in range(n) if ids[j] != want[j])}"
        )
        if text.encode("utf-8") == raw:
            assert session.detokenize(want[1:]) == text


def test_llama_cpp_follows_transformers(reference_paths):
    llama_cpp = require_llama_cpp()
    llm = llama_cpp.Llama(model_path=str(MODEL), n_ctx=256, n_threads=2, logits_all=True, verbose=False)
    for n, (path, want) in enumerate(reference_paths):
        llm.reset()
        llm.eval(path[:PROMPT_TOKENS])
        for step in range(GREEDY_STEPS):
            pos = PROMPT_TOKENS + step
            token = int(np.argmax(np.asarray(llm.scores[pos - 1])))
            assert token == path[pos], (
                f"prompt {n} step {step}: llama.cpp picks {token}, transformers {path[pos]}"
            )
            llm.eval([token])
