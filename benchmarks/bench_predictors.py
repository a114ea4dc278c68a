"""Cost of one predictor observe() call on the decode thread, for the sidecar predictors.

    PYTHONPATH=python python benchmarks/bench_predictors.py [--tokens 200] [--reps 5] [--out DIR]

observe() runs once per MoE layer of every decoded token, so its budget is ~2% of a token's time.
This writes an OLMoE-1B-7B-shaped model (16 layers, n_embd 2048, 64 experts, top-8; sparse file,
weights read as zero: only the shapes matter here) and random sidecars of the shapes below, then
times observe() in a C++ loop (PredictorHandle.time_observe: layers 0..15 in order per simulated
token, as in decoding, so no call reuses the previous call's work) and prints us per call next to
the target. Raw numbers go to DIR/bench_predictors.json.

    cooc        history m = 3                                        target < 20 us
    learned     n_embd 2048, H 256, PCA rank 0 and 128                target < 100 us
    trajectory  W 10, D 128, 2 blocks, 4 heads, F 256, 3 heads out   target < 150 us

Timing: best of --reps runs of --tokens tokens each, wall clock, one thread. The machines this runs
on are shared, so the load average is recorded next to the results.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile

import gguf
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from sharpi import _internal
from sharpi.make_model import write_model

N_LAYER, N_EMBD, N_EXPERT, TOP_K = 16, 2048, 64, 8
PREFIX = "sharpi.predictor."


def write_sidecar(path, kind, max_la, keys, tensors):
    w = gguf.GGUFWriter(path, arch="sharpi.predictor")
    w.add_string(PREFIX + "kind", kind)
    for key, value in [
        ("n_layer", N_LAYER),
        ("n_expert", N_EXPERT),
        ("top_k", TOP_K),
        ("max_lookahead", max_la),
    ]:
        w.add_uint32(PREFIX + key, value)
    w.add_string(PREFIX + "source", "random weights (bench_predictors.py)")
    for key, value in keys.items():
        w.add_uint32(PREFIX + key, value)
    for name, arr in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def normal(rng, shape, scale=1.0):
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)).astype(np.float32)


def cooc_sidecar(path, rng, m=3, max_la=3):
    E = N_EXPERT
    tensors = {
        "cooc.bias": normal(rng, (N_LAYER, E)),
        "cooc.layer": normal(rng, (N_LAYER, max_la + m - 1, E, E)),
        "cooc.prev": normal(rng, (N_LAYER, E, E)),
    }
    write_sidecar(path, "cooc", max_la, {"cooc.history": m}, tensors)


def learned_sidecar(path, rng, hidden=256, rank=0, max_la=3):
    width = rank or N_EMBD
    tensors = {}
    for il in range(N_LAYER - 1):
        p = f"learned.{il}."
        if rank:
            tensors[p + "pca_mean"] = normal(rng, N_EMBD, 0.1)
            tensors[p + "pca"] = normal(rng, (rank, N_EMBD), 1 / math.sqrt(N_EMBD))
        tensors[p + "w1"] = normal(rng, (hidden, width), 1 / math.sqrt(width))
        tensors[p + "b1"] = normal(rng, hidden, 0.1)
        tensors[p + "w2"] = normal(rng, (max_la * N_EXPERT, hidden), 1 / math.sqrt(hidden))
        tensors[p + "b2"] = normal(rng, max_la * N_EXPERT, 0.1)
    keys = {"n_embd": N_EMBD, "learned.hidden": hidden, "learned.rank": rank}
    write_sidecar(path, "learned", max_la, keys, tensors)


def trajectory_sidecar(path, rng, W=10, D=128, n_block=2, n_head=4, F=256, max_la=3):
    E = N_EXPERT
    t = {
        "traj.expert_emb": normal(rng, (N_LAYER, E, D)),
        "traj.layer_emb": normal(rng, (N_LAYER, D)),
        "traj.prev_emb": normal(rng, (N_LAYER, E, D)),
        "traj.prev_none": normal(rng, D),
    }
    for b in range(n_block):
        p = f"traj.blk.{b}."
        for name, shape, scale in [
            ("ln1.w", D, 1), ("ln1.b", D, 0.1), ("qkv.w", (3 * D, D), D**-0.5), ("qkv.b", 3 * D, 0.1),
            ("out.w", (D, D), D**-0.5), ("out.b", D, 0.1), ("ln2.w", D, 1), ("ln2.b", D, 0.1),
            ("up.w", (F, D), D**-0.5), ("up.b", F, 0.1), ("down.w", (D, F), F**-0.5), ("down.b", D, 0.1),
        ]:  # fmt: skip
            t[p + name] = normal(rng, shape, scale)
    t["traj.ln_f.w"] = normal(rng, D)
    t["traj.ln_f.b"] = normal(rng, D, 0.1)
    for d in range(1, max_la + 1):
        t[f"traj.head.{d}.w"] = normal(rng, (N_LAYER, E, D), D**-0.5)
        t[f"traj.head.{d}.b"] = normal(rng, (N_LAYER, E), 0.1)
    keys = {"trajectory.window": W, "trajectory.d_model": D, "trajectory.n_block": n_block,
            "trajectory.n_head": n_head, "trajectory.d_ff": F}  # fmt: skip
    write_sidecar(path, "trajectory", max_la, keys, t)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=200, help="simulated tokens per timed run")
    p.add_argument("--reps", type=int, default=5, help="timed runs; the best is reported")
    p.add_argument("--out", default="bench-out/predictors", help="folder for bench_predictors.json")
    args = p.parse_args()

    rng = np.random.default_rng(0)
    cases = [  # (label, kind, writer, target us)
        ("cooc m=3", "cooc", cooc_sidecar, 20),
        ("learned R=0 H=256", "learned", lambda path, r: learned_sidecar(path, r, rank=0), 100),
        ("learned R=128 H=256", "learned", lambda path, r: learned_sidecar(path, r, rank=128), 100),
        ("trajectory W=10 D=128", "trajectory", trajectory_sidecar, 150),
    ]
    hidden = normal(rng, (N_LAYER, N_EMBD))
    logits = normal(rng, (N_LAYER, N_EXPERT))
    history = np.stack([rng.choice(N_EXPERT, TOP_K, replace=False) for _ in range(N_LAYER)]).astype(np.int32)
    prev = np.stack([rng.choice(N_EXPERT, TOP_K, replace=False) for _ in range(N_LAYER)]).astype(np.int32)

    results = []
    with tempfile.TemporaryDirectory(prefix="bench_predictors") as tmp:
        model = os.path.join(tmp, "olmoe-shape.gguf")
        write_model(model, preset="olmoe-1b-7b", quant="q4_k", weights="sparse", vocab_size=4096,
                    n_layer=N_LAYER, n_expert=N_EXPERT)  # fmt: skip
        for label, kind, writer, target_us in cases:
            path = os.path.join(tmp, kind + ".gguf")
            writer(path, rng)
            for lookahead in (1, 3):
                handle = _internal.load_predictor(kind, path, model, lookahead)
                handle.time_observe(hidden, logits, history, prev, 5)  # warm-up
                best = min(
                    handle.time_observe(hidden, logits, history, prev, args.tokens) for _ in range(args.reps)
                )
                results.append({"predictor": label, "kind": kind, "lookahead": lookahead, "us_per_call": best * 1e6,
                                "target_us": target_us})  # fmt: skip
            os.remove(path)

    print(f"observe() cost, best of {args.reps} x {args.tokens} tokens x {N_LAYER} layers, 1 thread")
    print(f"{'predictor':<24}{'lookahead':>10}{'us/call':>10}{'target':>9}")
    for r in results:
        ok = "ok" if r["us_per_call"] < r["target_us"] else "OVER"
        print(f"{r['predictor']:<24}{r['lookahead']:>10}{r['us_per_call']:>10.2f}{r['target_us']:>7} {ok}")
    os.makedirs(args.out, exist_ok=True)
    out_path = os.path.join(args.out, "bench_predictors.json")
    with open(out_path, "w") as f:
        json.dump({"machine": platform.processor() or platform.machine(), "loadavg": os.getloadavg(),
                   "isa": os.environ.get("SHARPI_ISA", "auto"), "results": results}, f, indent=1)  # fmt: skip
    print(f"raw numbers: {out_path}")


if __name__ == "__main__":
    main()
