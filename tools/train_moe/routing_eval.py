"""How predictable is the trained model's routing? Recall table and routing traces on held-out text.

Owns the JSON file given as --json and the trace file given as --trace; reads the shipped GGUF (its
dequantized weights, so the numbers describe the file users run) and the run's token streams.

For every target MoE layer T and every token (that has a previous token in its window), each
predictor proposes k = top_k experts for layer T, and recall@k = |proposed ∩ selected| / k:
- next-gate, distance d (the "L+d" columns, L = T - d): layer T's router applied to the hidden
  state one or two layers earlier. Precisely: h_L is the residual stream entering layer L's MoE
  block (after L's attention, before its ffn_norm); the prediction is
  topk(router_T(ffn_norm_T(h_L))), i.e. layer T's own norm and router on the earlier state.
- previous token: the experts the previous token (same window) selected at layer T.
- popularity: layer T's k most selected experts, counted on training text (not on held-out text).
The same numbers for the same architecture with random weights (transformers' initialisation,
seeded) show why predictors must be judged on a trained model.

The trace (format of the project's shared traces README) holds the first --trace-tokens tokens of
--trace-seqs held-out files, each window starting at the file's <|endoftext|>:
  experts int16 [tokens, layers, top_k]   selected experts, in rank order
  scores float16 [tokens, layers, top_k]  softmax router probabilities of the selected experts
                                          (before the top-k renormalisation the model applies)
  router_logits float16 [tokens, layers, n_expert]
  hidden float16 [tokens, layers, hidden] the residual stream entering each MoE block (pre-ffn_norm)
  seq_start int64, num_experts, top_k, moe_layer_ids int16, tokens int32,
  token_str_utf8 uint8 + token_str_offsets int64, hidden_kind (a string saying what `hidden` is)

    python tools/train_moe/routing_eval.py --gguf python/sharpi/models/stdlib-moe-q8_0.gguf \
        --run runs/stdlib-moe --json runs/stdlib-moe/routing_eval.json --trace tests/data/stdlib_moe_trace.npz
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see train.py

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def run_with_states(model, ids):
    """Forward ids [batch, seq]; returns (router_logits [n_layer, batch*seq, n_expert],
    residual inputs of the MoE blocks [n_layer, batch*seq, hidden]) as float32 torch tensors."""
    import torch

    captured = []
    hooks = [
        layer.post_attention_layernorm.register_forward_pre_hook(
            lambda module, inputs: captured.append(inputs[0].detach().reshape(-1, inputs[0].shape[-1]))
        )
        for layer in model.model.layers
    ]
    try:
        with torch.no_grad():
            out = model(input_ids=ids, output_router_logits=True)
    finally:
        for hook in hooks:
            hook.remove()
    return torch.stack([r.float() for r in out.router_logits]), torch.stack(captured).float()


def next_gate_logits(model, residual, source: int, target: int):
    """Layer `target`'s router on layer `source`'s residual stream, through target's ffn_norm."""
    import torch

    layer = model.model.layers[target]
    with torch.no_grad():
        return torch.nn.functional.linear(
            layer.post_attention_layernorm(residual[source]), layer.mlp.gate.weight
        )


def recall(predicted, selected, k: int) -> np.ndarray:
    """Per token |predicted ∩ selected| / k; both [n, k] integer arrays."""
    hits = (predicted[:, :, None] == selected[:, None, :]).any(axis=2).sum(axis=1)
    return hits / k


def popularity(model, train_tokens, arch, seq_len: int, n_windows: int, seed: int) -> np.ndarray:
    """[n_layer, n_expert] selection counts on n_windows training windows."""
    import torch

    rng = np.random.default_rng([seed, 7])
    starts = rng.integers(0, len(train_tokens) - seq_len, size=n_windows)
    counts = np.zeros((arch.num_hidden_layers, arch.num_experts))
    for i in range(0, n_windows, 8):
        ids = torch.from_numpy(
            np.stack([train_tokens[s : s + seq_len] for s in starts[i : i + 8]]).astype(np.int64)
        )
        router_logits, _ = run_with_states(model, ids)
        selected = torch.topk(router_logits, arch.num_experts_per_tok, dim=-1).indices.numpy()
        for il in range(arch.num_hidden_layers):
            counts[il] += np.bincount(selected[il].reshape(-1), minlength=arch.num_experts)
    return counts


def recall_table(model, arch, windows, popular_counts, max_distance: int = 2) -> dict:
    """{"by_layer": {T: {...}}, "mean": {...}}; every entry averaged over all predicted tokens."""
    import torch

    k = arch.num_experts_per_tok
    n_layer = arch.num_hidden_layers
    popular = np.argsort(-popular_counts, axis=1, kind="stable")[:, :k]
    sums: dict = {}
    counts: dict = {}

    def add(key, values):
        sums[key] = sums.get(key, 0.0) + float(values.sum())
        counts[key] = counts.get(key, 0) + values.size

    for window in windows:
        ids = torch.from_numpy(window[None, :].astype(np.int64))
        router_logits, residual = run_with_states(model, ids)
        selected = torch.topk(router_logits, k, dim=-1).indices.numpy()  # [n_layer, seq, k]
        for target in range(n_layer):
            actual = selected[target][1:]  # tokens with a previous token in the window
            add((target, "prev_token"), recall(selected[target][:-1], actual, k))
            add((target, "popularity"), recall(np.broadcast_to(popular[target], actual.shape), actual, k))
            for d in range(1, max_distance + 1):
                if target - d < 0:
                    continue
                logits = next_gate_logits(model, residual, target - d, target)
                predicted = torch.topk(logits, k, dim=-1).indices.numpy()[1:]
                add((target, f"next_gate_d{d}"), recall(predicted, actual, k))
    by_layer = {}
    for (target, name), total in sums.items():
        by_layer.setdefault(target, {})[name] = total / counts[(target, name)]
    mean = {}
    for name in {n for (_, n) in sums}:
        layers = [t for (t, n) in sums if n == name]
        mean[name] = float(np.mean([by_layer[t][name] for t in layers]))
    return {"k": k, "by_layer": {str(t): by_layer[t] for t in sorted(by_layer)}, "mean_over_layers": mean}


def byte_level_decoder() -> dict:
    """Inverse of the byte-level BPE alphabet (GPT-2's bytes_to_unicode): printable Latin-1 bytes stand
    for themselves, the other 68 bytes for code points 256, 257, ... in byte order."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    )
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def token_bytes(tokenizer, token_id: int, decoder: dict) -> bytes:
    """The exact bytes a token stands for (a token may hold part of a UTF-8 character)."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if token_id in tokenizer.all_special_ids:
        return piece.encode("utf-8")
    return bytes(decoder[c] for c in piece)


def write_trace(model, arch, tokenizer, heldout_tokens, path: Path, n_seqs: int, n_tokens: int) -> dict:
    """Routing trace of the first n_tokens of n_seqs held-out files (evenly spread over the stream)."""
    import torch

    file_starts = np.flatnonzero(heldout_tokens == 0)
    long_enough = [s for s in file_starts if s + n_tokens <= len(heldout_tokens)]
    chosen = [long_enough[i] for i in np.linspace(0, len(long_enough) - 1, n_seqs).astype(int)]
    fields = {name: [] for name in ("experts", "scores", "router_logits", "hidden", "tokens")}
    for start in chosen:
        window = heldout_tokens[start : start + n_tokens].astype(np.int64)
        router_logits, residual = run_with_states(model, torch.from_numpy(window[None, :]))
        probs = torch.softmax(router_logits, dim=-1)
        top = torch.topk(probs, arch.num_experts_per_tok, dim=-1)
        fields["experts"].append(top.indices.permute(1, 0, 2).numpy().astype(np.int16))
        fields["scores"].append(top.values.permute(1, 0, 2).numpy().astype(np.float16))
        fields["router_logits"].append(router_logits.permute(1, 0, 2).numpy().astype(np.float16))
        fields["hidden"].append(residual.permute(1, 0, 2).numpy().astype(np.float16))
        fields["tokens"].append(window.astype(np.int32))
    arrays = {name: np.concatenate(values) for name, values in fields.items()}
    decoder = byte_level_decoder()
    pieces = [token_bytes(tokenizer, int(t), decoder) for t in arrays["tokens"]]
    offsets = np.concatenate([[0], np.cumsum([len(p) for p in pieces])]).astype(np.int64)
    np.savez_compressed(
        path,
        **arrays,
        seq_start=np.arange(0, n_seqs * n_tokens, n_tokens, dtype=np.int64),
        num_experts=np.int64(arch.num_experts),
        top_k=np.int64(arch.num_experts_per_tok),
        moe_layer_ids=np.arange(arch.num_hidden_layers, dtype=np.int16),
        token_str_utf8=np.frombuffer(b"".join(pieces), dtype=np.uint8),
        token_str_offsets=offsets,
        hidden_kind=np.array(
            "residual stream entering the MoE block: after the layer's attention, before ffn_norm"
        ),
    )
    return {
        "path": str(path),
        "tokens": len(arrays["tokens"]),
        "bytes": path.stat().st_size,
        "heldout_offsets": [int(s) for s in chosen],
    }


def format_table(results: dict) -> str:
    k = results["trained"]["k"]
    lines = [
        f"recall@{k} (k = top_k predictions) on held-out text; L = the layer the predictor runs at",
        (
            f"{'target':>6} | {'model':>7} | {'next-gate L+1':>13} {'next-gate L+2':>13} "
            f"{'prev-token':>10} {'popularity':>10}"
        ),
    ]
    for target in results["trained"]["by_layer"]:
        for name in ("trained", "random"):
            row = results[name]["by_layer"][target]
            cells = [
                f"{row[key]:.3f}" if key in row else "-"
                for key in ("next_gate_d1", "next_gate_d2", "prev_token", "popularity")
            ]
            lines.append(
                f"{target:>6} | {name:>7} | {cells[0]:>13} {cells[1]:>13} {cells[2]:>10} {cells[3]:>10}"
            )
    for name in ("trained", "random"):
        m = results[name]["mean_over_layers"]
        cells = [
            f"{m[key]:.3f}" if key in m else "-"
            for key in ("next_gate_d1", "next_gate_d2", "prev_token", "popularity")
        ]
        lines.append(f"{'mean':>6} | {name:>7} | {cells[0]:>13} {cells[1]:>13} {cells[2]:>10} {cells[3]:>10}")
    return "\n".join(lines)


def main(argv=None) -> None:
    import bpe_tokenizer
    import torch
    from gguf_weights import load_model
    from model import build_model
    from train import heldout_windows

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", type=Path, required=True)
    p.add_argument("--run", type=Path, required=True, help="train.py run folder (token streams, tokenizer)")
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--trace", type=Path, default=None)
    p.add_argument("--trace-seqs", type=int, default=4)
    p.add_argument("--trace-tokens", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--popularity-windows", type=int, default=64)
    p.add_argument("--random-seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    train_tokens = np.load(args.run / "tokens_train.npy")
    heldout_tokens = np.load(args.run / "tokens_heldout.npy")
    windows = heldout_windows(heldout_tokens, args.seq_len)
    trained, arch = load_model(args.gguf)
    random_model = build_model(arch, seed=args.random_seed).eval()

    results = {
        "heldout_tokens": len(heldout_tokens),
        "seq_len": args.seq_len,
        "random_seed": args.random_seed,
    }
    for name, model in (("trained", trained), ("random", random_model)):
        counts = popularity(model, train_tokens, arch, args.seq_len, args.popularity_windows, seed=0)
        results[name] = recall_table(model, arch, windows, counts)
    if args.trace:
        tokenizer = bpe_tokenizer.hf_tokenizer(bpe_tokenizer.load_tokenizer(args.run))
        results["trace"] = write_trace(
            trained, arch, tokenizer, heldout_tokens, args.trace, args.trace_seqs, args.trace_tokens
        )
    table = format_table(results)
    results["table"] = table
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1))
    print(table)


if __name__ == "__main__":
    main()
