"""The workloads `sharpi bench` runs: the synthetic models, their expert layout and read bandwidth,
and the recorded routing trace with its train / evaluation split.

What it owns: the model files under --model-dir (written once through sharpi.make_model, reused
while their shape and seed match), reading a GGUF header for the expert byte ranges, measuring the
reader's sequential bandwidth on a model file (page cache dropped before each pass), and cutting the
recorded trace (shared/traces/deepseek_v2_lite_train.npz): the first TRAIN_SPLIT of its sequences
train predictors, the rest are replayed. It never decodes: sessions run in workers (bench.worker).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from .isolation import MiB, drop_page_cache

TRACE_FILE = "deepseek_v2_lite_train.npz"
TRACE_PRESET = "deepseek-v2-lite"  # the trace's own architecture: deepseek2, MLA, 1 dense + 26 MoE layers

# --quick: the trace model keeps DeepSeek-V2-Lite's architecture, 64 experts, top-6, 2 shared
# experts, but with the dense layer + 4 small MoE layers (the trace's first 4 layers are replayed)
# so the smoke run writes a few MiB, not gigabytes. Widths stay multiples of 256 (K-quants).
QUICK_TRACE_OVERRIDES = {
    "n_layer": 5,
    "n_embd": 256,
    "n_head": 2,
    "head_dim": 96,
    "n_rot": 32,
    "n_lora_kv": 256,
    "head_dim_v": 128,
    "n_ff": 512,
    "n_ff_exp": 256,
    "n_ff_shexp": 512,
    "n_vocab": 1024,
}
TRAIN_SPLIT = 0.7  # first 70% of a trace's sequences train predictors, the rest are replayed


def ensure_model(model_dir: Path, preset: str, quant: str, seed: int, overrides: dict, log) -> dict:
    """The synthetic model for (preset, quant, seed, overrides): reused when a file of that name with
    the same shape and seed exists, else written. Returns {path, reused, seconds}."""
    from .. import presets
    from ..make_model import write_model

    suffix = "".join(f"-{k}{v}" for k, v in sorted(overrides.items()))
    path = Path(model_dir) / f"{preset}-{quant}{suffix}-seed{seed}.gguf"
    expected = presets.resolve(None, preset, **overrides)
    if path.is_file() and _model_matches(path, expected, preset, seed):
        return {"path": str(path), "reused": True, "seconds": 0.0}
    os.makedirs(model_dir, exist_ok=True)
    log(f"writing {path} ({preset} {quant}) ...")
    t0 = time.perf_counter()
    write_model(path, preset=preset, quant=quant, seed=seed, progress=lambda m: log("  " + m), progress_bar=True,
                **overrides)
    return {"path": str(path), "reused": False, "seconds": time.perf_counter() - t0}


def _model_matches(path: Path, hp, preset: str, seed: int) -> bool:
    from .. import _core

    try:
        md = _core.GgufFile(str(path)).metadata()
    except _core.SharpiError:
        return False  # truncated or foreign: rewrite it
    a = md.get("general.architecture")
    want = {
        "general.architecture": hp.arch,
        "sharpi.preset": preset,
        "sharpi.seed": seed,
        f"{a}.block_count": hp.n_layer,
        f"{a}.embedding_length": hp.n_embd,
        f"{a}.expert_count": hp.n_expert,
        f"{a}.expert_used_count": hp.n_expert_used,
        f"{a}.expert_feed_forward_length": hp.n_ff_exp,
    }
    return all(md.get(k) == v for k, v in want.items())


def expert_layout(path: str) -> dict:
    """Per MoE layer: bytes of one expert (its gate + up + down slices) and the expert byte ranges of the
    file in file order, from the GGUF header."""
    from .. import _core

    f = _core.GgufFile(path)
    md = f.metadata()
    arch = md["general.architecture"]
    n_layer = int(md[f"{arch}.block_count"])
    n_expert = int(md[f"{arch}.expert_count"])
    by_name = {t["name"]: t for t in f.tensors()}
    expert_bytes, tensors = [], []
    for il in range(n_layer):
        if f"blk.{il}.ffn_gate_exps.weight" not in by_name:
            continue  # a dense layer (deepseek2's first): nothing to stream
        total = 0
        for part in ("gate", "up", "down"):
            t = by_name[f"blk.{il}.ffn_{part}_exps.weight"]
            total += t["nbytes"] // n_expert
            tensors.append((t["file_offset"], t["nbytes"] // n_expert))
        expert_bytes.append(total)
    return {"expert_bytes": expert_bytes, "tensors": sorted(tensors), "n_expert": n_expert}


def measure_sequential_bandwidth(
    path: str, reader_kind: str, layout: dict, max_bytes: int, drop: str = "all", repeats: int = 2
) -> dict:
    """Bandwidth of this session's reader kind on this file: expert-sized reads back to back through
    the expert tensors (in file order), page cache dropped before each pass; the best pass counts."""
    from .. import _internal

    ranges, total = [], 0
    for offset, per_expert in layout["tensors"]:
        for e in range(layout["n_expert"]):
            if total >= max_bytes:
                break
            ranges.append((offset + e * per_expert, per_expert, "demand"))
            total += per_expert
    reader = _internal.ExpertReaderTest(reader_kind, path, arena_bytes=64 * MiB)
    best = None
    how = ""
    for _ in range(repeats):
        how = drop_page_cache([path], drop)
        t0 = time.perf_counter()
        nbytes = reader.read(ranges, keep_bytes=False)
        seconds = time.perf_counter() - t0
        if best is None or seconds < best[1]:
            best = (nbytes, seconds)
    nbytes, seconds = best
    return {
        "reader": reader.describe,
        "bytes": int(nbytes),
        "requests": len(ranges),
        "seconds": seconds,
        "gbps": nbytes / seconds / 1e9,
        "cache_drop": how,
    }


def default_trace_path() -> Path | None:
    """../shared/traces/<TRACE_FILE> beside the repository this package runs from, else beside the cwd."""
    here = Path(__file__).resolve()
    candidates = [here.parents[3].parent / "shared" / "traces" / TRACE_FILE]  # <repo>/python/sharpi/bench/workloads.py
    cwd = Path.cwd()
    candidates += [cwd.parent / "shared" / "traces" / TRACE_FILE, cwd / "shared" / "traces" / TRACE_FILE]
    return next((c for c in candidates if c.is_file()), None)


def eval_split(seq_start, n_tokens: int, train_fraction: float = TRAIN_SPLIT) -> tuple:
    """(n_train_seq, first eval row): the first floor(train_fraction x sequences) sequences train,
    the rest evaluate; each side keeps at least one sequence (the split of shared/traces/README.md's
    baselines and of sharpi.predict)."""
    n_seq = len(seq_start)
    if n_seq < 2:
        raise ValueError(f"a split by sequences needs at least 2 sequences, the trace has {n_seq}")
    n_train = min(max(int(np.floor(train_fraction * n_seq)), 1), n_seq - 1)
    return n_train, int(seq_start[n_train])


def write_train_trace(trace_path: Path, out_path: Path, n_layer: int, max_tokens: int | None) -> dict:
    """The training part of a recorded trace as a trace file of its own: the train split's
    sequences (at most max_tokens tokens of whole sequences, at least 2 where the split has them), the model's
    first n_layer layers. Predictors trained on it never see the replayed evaluation rows."""
    with np.load(trace_path) as z:
        arrays = {k: z[k] for k in z.files}
    seq_start = arrays["seq_start"]
    n_train_seq, _ = eval_split(seq_start, arrays["experts"].shape[0])
    ends = np.append(seq_start[1:], arrays["experts"].shape[0])
    n_seq = n_train_seq
    if max_tokens is not None:
        # Whole sequences within the cap, at least 2 (trainers carve a validation slice), never
        # beyond the train split.
        n_seq = min(n_train_seq, max(2, int(np.searchsorted(ends[:n_train_seq], max_tokens, side="right"))))
    end = int(ends[n_seq - 1])
    out = {
        "experts": arrays["experts"][:end, :n_layer],
        "seq_start": seq_start[:n_seq].astype(np.int64),
        "num_experts": arrays["num_experts"],
        "top_k": arrays["top_k"],
        "moe_layer_ids": arrays["moe_layer_ids"][:n_layer],
    }
    if "prompt_id" in arrays:
        out["prompt_id"] = arrays["prompt_id"][:n_seq]
    out_path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(out_path, **out)
    return {
        "path": str(out_path),
        "source": f"{trace_path}: sequences 0..{n_seq - 1} of the train split (sequences 0..{n_train_seq - 1}), "
        f"first {n_layer} layers",
        "sequences": n_seq,
        "tokens": end,
    }


def trace_rows(path: Path, start: int, n_rows: int, n_layer: int) -> tuple:
    """Rows [start, start + n_rows) of the trace's experts array, its first n_layer layers; and a note."""
    with np.load(path) as z:
        experts = z["experts"]
    if experts.ndim != 3:
        raise ValueError(f"{path}: 'experts' should be [tokens, layers, top_k], got shape {experts.shape}")
    if start < 0 or start + n_rows > experts.shape[0]:
        raise ValueError(f"{path}: rows {start}..{start + n_rows} are outside its {experts.shape[0]} tokens")
    if experts.shape[1] < n_layer:
        raise ValueError(f"{path}: {experts.shape[1]} layers, the model has {n_layer}")
    rows = np.ascontiguousarray(experts[start : start + n_rows, :n_layer, :], dtype=np.int32)
    note = f"rows {start}..{start + n_rows - 1}"
    if experts.shape[1] > n_layer:
        note += f", first {n_layer} of {experts.shape[1]} layers"
    return rows, note
