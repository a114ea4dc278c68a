"""Evaluate the exported GGUF (its dequantized weights, in transformers) on the held-out text.

Owns the JSON file given as --json and, with --heldout-npz, the test-data copy of the held-out token
stream; reads the GGUF and the run folder, writes nothing else. These are the numbers the model card
states: held-out cross-entropy and perplexity of the file users actually run (not of the float
checkpoint), the per-layer expert balance, and greedy samples.

    python tools/train_moe/evaluate_gguf.py --gguf python/sharpi/models/stdlib-moe-q8_0.gguf \
        --run runs/stdlib-moe --json runs/stdlib-moe/gguf_eval.json \
        --heldout-npz tests/data/stdlib_moe_heldout_tokens.npz
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see train.py

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

SAMPLE_PROMPTS = ["def ", "import os\n\n\ndef ", "class Queue:\n    def __init__(self", "    for i in range("]


def greedy(model, tokenizer, prompt: str, n_tokens: int) -> str:
    import torch

    ids = tokenizer.encode(prompt).ids  # the post-processor prepends <|endoftext|>
    with torch.no_grad():
        for _ in range(n_tokens):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            ids.append(int(torch.argmax(logits)))
    return tokenizer.decode(ids[1:], skip_special_tokens=False)


def main(argv=None) -> None:
    import bpe_tokenizer
    import torch
    from gguf_weights import load_model
    from train import balance_summary, evaluate, heldout_windows

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", type=Path, required=True)
    p.add_argument("--run", type=Path, required=True)
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--heldout-npz", type=Path, default=None)
    p.add_argument("--sample-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    run_result = json.loads((args.run / "result.json").read_text())
    seq_len = run_result["seq_len"]
    heldout = np.load(args.run / "tokens_heldout.npy")
    model, arch = load_model(args.gguf)
    result = evaluate(model, heldout_windows(heldout, seq_len), arch.num_experts_per_tok)
    tokenizer = bpe_tokenizer.load_tokenizer(args.run)
    samples = {prompt: greedy(model, tokenizer, prompt, args.sample_tokens) for prompt in SAMPLE_PROMPTS}
    heldout_bytes = sum(r["bytes"] for r in json.loads((args.run / "corpus.json").read_text())["heldout"])
    report = {
        "gguf": str(args.gguf),
        "gguf_bytes": args.gguf.stat().st_size,
        "heldout_ce": result["ce"],
        "heldout_ppl": result["ppl"],
        "heldout_predicted_tokens": result["tokens"],
        "heldout_stream_tokens": len(heldout),
        "heldout_bytes": heldout_bytes,
        "heldout_bits_per_byte": result["ce"] * result["tokens"] / math.log(2) / heldout_bytes,
        "float_checkpoint_heldout_ce": run_result["heldout_ce"],
        "seq_len": seq_len,
        "selection_shares": result["shares"],
        **balance_summary(result["shares"]),
        "sample_tokens": args.sample_tokens,
        "greedy_samples": samples,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    if args.heldout_npz:
        args.heldout_npz.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(args.heldout_npz, tokens=heldout.astype(np.uint16), seq_len=np.int64(seq_len))
    print(
        f"GGUF held-out ce {result['ce']:.4f} (ppl {result['ppl']:.2f}; float checkpoint "
        f"{run_result['heldout_ce']:.4f}); bits/byte {report['heldout_bits_per_byte']:.3f}"
    )
    print("max share / uniform per layer", report["max_over_uniform"])
    print("min share / uniform per layer", report["min_over_uniform"])
    for prompt, text in samples.items():
        print(f"--- greedy from {prompt!r}:\n{text}")


if __name__ == "__main__":
    main()
