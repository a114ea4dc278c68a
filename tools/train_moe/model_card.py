"""Write python/sharpi/models/MODEL_CARD.md from the JSON results of a run (nothing typed by hand).

Owns the card file only. Reads RUN/result.json (train.py), the GGUF evaluation (evaluate_gguf.py),
the routing evaluation (routing_eval.py) and corpus_manifest.json.

    python tools/train_moe/model_card.py --run runs/stdlib-moe --gguf-eval runs/stdlib-moe/gguf_eval.json \
        --routing runs/stdlib-moe/routing_eval.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
CARD = REPO_ROOT / "python" / "sharpi" / "models" / "MODEL_CARD.md"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", type=Path, required=True)
    p.add_argument("--gguf-eval", type=Path, required=True)
    p.add_argument("--routing", type=Path, required=True)
    p.add_argument("--out", type=Path, default=CARD)
    p.add_argument("--run-notes", type=Path, default=None, help="markdown paragraph on events of this run")
    p.add_argument(
        "--results-dir",
        default="tools/train_moe/results",
        help="where the run's JSON results are committed (named in the replay command)",
    )
    args = p.parse_args(argv)

    import numpy as np
    import torch

    run = json.loads((args.run / "result.json").read_text())
    train_tokens = len(np.load(args.run / "tokens_train.npy"))
    ev = json.loads(args.gguf_eval.read_text())
    routing = json.loads(args.routing.read_text())
    manifest = json.loads((HERE / "corpus_manifest.json").read_text())
    arch, targs = run["arch"], run["args"]
    n_train_bytes = sum(r["bytes"] for r in manifest["train"])
    n_heldout_bytes = sum(r["bytes"] for r in manifest["heldout"])
    tokens_seen = run["steps"] * targs["batch"] * targs["seq_len"]
    timed_command = f"python tools/train_moe/train.py --out runs/stdlib-moe --time-budget-min {targs['time_budget_min']:g}"
    replay_command = (
        f"python tools/train_moe/train.py --out runs/stdlib-moe --replay-lr {args.results_dir}/result.json"
    )
    notes = ("\n\n" + args.run_notes.read_text(encoding="utf-8").strip()) if args.run_notes else ""

    balance_rows = []
    for il, (mx, mn) in enumerate(zip(ev["max_over_uniform"], ev["min_over_uniform"])):
        ok = "yes" if mx <= 2.0 and mn >= 0.25 else "NO"
        balance_rows.append(f"| {il} | {mx:.2f} | {mn:.2f} | {ok} |")

    samples = "\n\n".join(
        f"Prompt `{prompt!r}`:\n\n```python\n{text}\n```" for prompt, text in ev["greedy_samples"].items()
    )

    card = f"""# stdlib-moe-q8_0.gguf

A small Mixture-of-Experts language model trained by the sharpi project on the Python standard
library's own source code. It is the default model of `sharpi run` (so a first run prints code-like
text, not noise from random weights) and the test bed for expert predictors: its routing is learned,
and learned routing is predictable in the opposite way from random routing (table below).

## Results (shipped Q8_0 file, dequantized, evaluated with transformers)

- **held-out cross-entropy** (nats/token, shipped Q8_0 weights): {ev["heldout_ce"]:.4f}
- perplexity: {ev["heldout_ppl"]:.2f}; bits per byte of held-out source: {ev["heldout_bits_per_byte"]:.3f}
- the float32 checkpoint before quantization: {ev["float_checkpoint_heldout_ce"]:.4f} nats/token
- measured on {ev["heldout_predicted_tokens"]:,} predicted tokens: the held-out token stream
  ({ev["heldout_stream_tokens"]:,} tokens, {n_heldout_bytes:,} bytes of source) cut into consecutive
  windows of {ev["seq_len"]} tokens; every token of a window after its first is predicted from the
  tokens before it in that window. Uniform guessing would give ln({arch["vocab_size"]}) = {__import__("math").log(arch["vocab_size"]):.2f}.

Expert load per layer on the held-out text: each expert's share of the layer's top-{arch["num_experts_per_tok"]}
selections, divided by the uniform share 1/{arch["num_experts"]}. Target: most-used <= 2, least-used >= 0.25.

| layer | most-used expert / uniform | least-used expert / uniform | within target |
|---|---|---|---|
{chr(10).join(balance_rows)}

Greedy continuations ({ev["sample_tokens"]} tokens, temperature 0, transformers on the dequantized weights):

{samples}

## Routing predictability on held-out text

recall@{routing["trained"]["k"]} = |predicted ∩ selected| / {routing["trained"]["k"]}, averaged over tokens. Predictors for
target layer T, run at layer L = T - d: *next-gate* applies layer T's ffn_norm and router to the
residual stream entering layer L's MoE block; *prev-token* reuses the previous token's experts at T;
*popularity* predicts T's most selected experts on training text. *random* is the same architecture
with transformers' random initialisation (seed {routing["random_seed"]}).

```
{routing["table"]}
```

## Model

| | |
|---|---|
| architecture | qwen3moe (transformers `Qwen3MoeForCausalLM`) |
| layers / hidden | {arch["num_hidden_layers"]} / {arch["hidden_size"]} |
| attention | {arch["num_attention_heads"]} heads, {arch["num_key_value_heads"]} KV heads, head_dim {arch["head_dim"]}, per-head q/k RMSNorm, NeoX RoPE (theta {arch["rope_theta"]:g}) |
| MoE | every layer; {arch["num_experts"]} experts, top-{arch["num_experts_per_tok"]}, expert FFN {arch["moe_intermediate_size"]}, softmax router, top-k weights renormalised, no shared expert |
| embeddings | tied input/output, vocabulary {arch["vocab_size"]} |
| parameters | {run["parameters"] / 1e6:.2f} M in total |
| context | trained on {targs["seq_len"]}-token windows |
| file | GGUF written by llama.cpp's `convert_hf_to_gguf.py` (llama-cpp-python 0.3.36 sdist) with `--outtype q8_0`: matrices Q8_0, norms and routers F32; {ev["gguf_bytes"] / 1e6:.2f} MB |

Tokenizer: byte-level BPE ({arch["vocab_size"]} tokens) trained with Hugging Face `tokenizers` on the
training files only; GPT-2 pre-tokenizer regex (`tokenizer.ggml.pre = "gpt-2"`), one special token
`<|endoftext|>` (id 0) which separates files during training and is both BOS and EOS;
`add_bos_token = true`, so a prompt reads like the start of a file.

## Corpus and license

The `*.py` files of the CPython {manifest["python_version"]} standard library, distributed under the
**PSF License Agreement (version 2)** (the `LICENSE.txt` at the root of the stdlib folder; the few
incorporated components listed there carry their own permissive notices). Left out: `site-packages`
(third-party code), test folders (not installed by every distribution), `encodings/` and `pydoc_data/`
(generated tables and docs), per-build `_sysconfigdata*` / `config-*`. {len(manifest["train"])} training files
({n_train_bytes / 1e6:.2f} MB); {len(manifest["heldout"])} held-out files ({n_heldout_bytes / 1e3:.0f} kB), chosen by
`{manifest["heldout_rule"]}` — no file was picked by hand:

{", ".join(r["path"] for r in manifest["heldout"])}.

`tools/train_moe/corpus_manifest.json` lists every file with its size and sha256. The model weights
are distributed with sharpi under its license.

## Training

Run on a shared 2-core x86-64 machine (AVX-512 BF16), torch {torch.__version__}, 2 threads:

    {timed_command}

took {run["train_wall_s"] / 60:.1f} minutes of wall time for {run["steps"]} steps of {targs["batch"]} x {targs["seq_len"]} tokens
({tokens_seen / 1e6:.2f} M tokens, {tokens_seen / train_tokens:.1f} passes over the {train_tokens / 1e6:.2f} M training tokens).
The wall-time budget decides when the LR decay starts and, if the machine slows down, shortens the
decay; every step's LR is recorded in `{args.results_dir}/result.json`, and this replays the run step
for step (same batches, same LRs) without a clock:

    {replay_command}{notes}

Recipe: seed {targs["seed"]}; Muon (lr {targs["muon_lr"]:g}, momentum 0.95, Nesterov) for attention and expert
matrices, each expert's matrix orthogonalised on its own; AdamW (lr {targs["lr"]:g}, betas 0.9/0.95, weight decay
{targs["weight_decay"]:g} on matrices) for embeddings, norms and routers; {targs["warmup"]} warm-up steps, constant LR, linear
decay over the last {targs["decay_frac"]:.0%} of steps to {targs["min_lr_frac"]:g} x; gradient clip {targs["grad_clip"]:g}; forward in
bfloat16 autocast with float32 master weights. Loss: next-token cross-entropy + {targs["balance_coef"]:g} x
(one Switch balance term per layer, n_expert * sum_e f_e P_e, summed over layers; not transformers'
pooled auxiliary loss, which lets layers cancel each other) + {targs["z_coef"]:g} x router z-loss.

Full pipeline (tokenizer, training, export, evaluation, traces, this card):

    python tools/train_moe/train.py --out runs/stdlib-moe --time-budget-min {targs["time_budget_min"]:g}
    python tools/train_moe/export.py --run runs/stdlib-moe --out python/sharpi/models/stdlib-moe-q8_0.gguf
    python tools/train_moe/evaluate_gguf.py --gguf python/sharpi/models/stdlib-moe-q8_0.gguf --run runs/stdlib-moe \\
        --json runs/stdlib-moe/gguf_eval.json --heldout-npz tests/data/stdlib_moe_heldout_tokens.npz
    python tools/train_moe/routing_eval.py --gguf python/sharpi/models/stdlib-moe-q8_0.gguf --run runs/stdlib-moe \\
        --json runs/stdlib-moe/routing_eval.json --trace tests/data/stdlib_moe_trace.npz
    python tools/train_moe/model_card.py --run runs/stdlib-moe --gguf-eval runs/stdlib-moe/gguf_eval.json \\
        --routing runs/stdlib-moe/routing_eval.json

## Limitations

A 16 M-parameter model that has seen a few million tokens of one code base: it writes plausible
Python-looking text, not correct programs, and knows nothing outside the standard library's style.
It is for testing the engine and judging expert predictors, not for use as an assistant.
"""
    args.out.write_text(card, encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
