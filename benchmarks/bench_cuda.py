#!/usr/bin/env python3
"""sharpi on the GPU beside llama.cpp built with CUDA, on the same GGUF files (issue 21's benchmark).

    PYTHONPATH=python python benchmarks/bench_cuda.py --preset qwen3-30b-a3b --quant q4_k_m \\
        --model-dir /work/models --out bench-out/cuda
    PYTHONPATH=python python benchmarks/bench_cuda.py FILE.gguf --out bench-out/cuda

A thin front of benchmarks/compare.py (same method: fresh worker per measurement, warm pass,
alternating engines, medians; prefill tok/s and decode tok/s per prompt length), with two engines
that put everything on device 0:
  sharpi-cuda     Session(device="cuda") (dense weights, KV cache and experts in VRAM; its KV
                  cache is f32, llama.cpp's default f16: at long prompts sharpi reads twice the KV bytes);
  llama.cpp-cuda  llama-cpp-python built with CUDA (GGML_CUDA=on), n_gpu_layers = all.
A GPU is required (a lent machine has no registry: carry the llama-cpp-python source package there
and build it with CMAKE_ARGS="-DGGML_CUDA=on"). Without one the script exits saying so; an engine
that cannot run (a build without CUDA, or sharpi's device path refusing the model with its typed
error) is a column that says why.

Experts streamed through VRAM (issue 22's benchmark): --vram-budget 12GiB gives sharpi that budget
(one column per --miss-route: copy, cpu, auto), and llama.cpp keeps the experts of its first
--n-cpu-moe N layers on the CPU (llama.cpp's own --n-cpu-moe: tensor_buft_overrides to the CPU
buffer type); --n-cpu-moe auto picks the smallest N whose GPU weights, f16 KV cache and a 512 MiB
compute allowance fit the same budget. Every worker records the VRAM the device reports in use
after its run (nvidia-smi; the workers run one at a time), and sharpi's columns the tier's counters
over the timed part: hit rate, stall, copy-stream busy time and its overlap with compute.

    PYTHONPATH=python python benchmarks/bench_cuda.py --preset qwen3-30b-a3b --quant q4_k_m \\
        --vram-budget 12GiB --miss-route copy,auto --n-cpu-moe auto --out bench-out/cuda-tier
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import compare


def gpu_memory_used_mib() -> float | None:
    """Device memory in use now (nvidia-smi's memory.used of device 0, MiB); None without nvidia-smi."""
    import subprocess

    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                           check=True, capture_output=True, text=True, timeout=30)
        return float(r.stdout.strip().splitlines()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def tier_summary(stats: dict) -> dict:
    """The VRAM tier's counters over the timed part as the issue asks for them: hit rate, stall, the
    copy stream's busy time against the decode time, and how much of that busy time overlapped compute
    (1 - stall / busy: copy time the compute stream did not wait for)."""
    layers = stats["layers"]
    accesses = sum(x["accesses"] for x in layers)
    hits = sum(x["hits"] for x in layers)
    stall = sum(x["stall_ms"] for x in layers)
    busy, decode = stats["io_busy_ms"], stats["decode_ms"]
    return {"tier": stats["tier"], "reader": stats["reader"], "n_slots": stats["n_slots"],
            "n_staging": stats["n_staging"], "budget_bytes": stats["budget_bytes"], "accesses": accesses,
            "hit_rate": hits / accesses if accesses else None, "stall_ms": stall,
            "bytes_read": sum(x["bytes_read"] for x in layers), "cpu_experts": stats["cpu_experts"],
            "copy_busy_ms": busy, "decode_ms": decode,
            "copy_occupancy": busy / decode if decode else None,
            "copy_overlap": 1.0 - stall / busy if busy else None,
            "miss_copy_bytes_per_s": stats["miss_copy_bytes_per_s"],
            "miss_cpu_bytes_per_s": stats["miss_cpu_bytes_per_s"]}


class SharpiCudaRunner(compare.SharpiRunner):
    key = "sharpi_cuda"
    label = "sharpi (cuda)"
    worker_script = Path(__file__).resolve()

    def __init__(self, *a, vram_budget: str | None = None, miss_route: str = "copy", **kw):
        super().__init__(*a, **kw)
        self.vram_budget, self.miss_route = vram_budget, miss_route
        if vram_budget:
            self.key = f"sharpi_cuda_{miss_route}"
            self.label = f"sharpi (cuda, {vram_budget}, misses: {miss_route})"

    def options(self) -> dict:
        return {"exact": self.exact, "device": "cuda", "vram_budget": self.vram_budget, "miss_route": self.miss_route}

    @classmethod
    def worker_main(cls, spec: dict) -> dict:
        import sharpi

        o = spec["options"]
        streamed = {"vram_budget": o["vram_budget"], "miss_route": o["miss_route"]} if o.get("vram_budget") else {}
        t0 = time.perf_counter()
        s = sharpi.Session(spec["file"], threads=spec["threads"], n_ctx=spec["n_ctx"], exact=o["exact"],
                           device="cuda", **streamed)
        load_s = time.perf_counter() - t0

        def reset():  # after the warm-up: the counters cover the timed prompt and decode only
            s.reset()
            if streamed:
                s.reset_stats()

        r = compare.timed_greedy(lambda ids: s.decode(ids), lambda t: s.decode([t]), reset,
                                 spec["prompt_ids"], spec["n_decode"])
        r.update(load_s=load_s, version=getattr(sharpi, "__version__", None), device=sharpi.cuda_describe(),
                 vram_used_mib=gpu_memory_used_mib(),
                 settings={"threads": spec["threads"], "n_ctx": spec["n_ctx"], **o})
        if streamed:
            r["tier"] = tier_summary(s.expert_stats())
        return r


EXPERT_TENSOR = re.compile(r"^blk\.(\d+)\.ffn_(up|down|gate)_exps\.")


def n_cpu_moe_for_budget(path: str, budget_bytes: int, n_ctx: int) -> int:
    """The smallest N such that llama.cpp with the experts of layers 0..N-1 on the CPU keeps in VRAM no
    more than budget_bytes: every tensor but token_embd (llama.cpp keeps the input embedding on the
    CPU) and those experts, plus an f16 KV cache of n_ctx and 512 MiB for its compute buffers."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    per_layer, other = {}, 0
    for t in reader.tensors:
        m = EXPERT_TENSOR.match(t.name)
        if m:
            per_layer[int(m.group(1))] = per_layer.get(int(m.group(1)), 0) + int(t.n_bytes)
        elif not t.name.startswith("token_embd."):
            other += int(t.n_bytes)
    arch = reader.fields["general.architecture"].contents()

    def field(key):
        f = reader.fields.get(f"{arch}.{key}")
        return f.contents() if f is not None else None

    n_layer, n_head_kv = field("block_count"), field("attention.head_count_kv")
    head_dim = field("attention.key_length") or field("embedding_length") // field("attention.head_count")
    kv = 2 * n_layer * n_ctx * n_head_kv * head_dim * 2
    fixed = other + kv + (512 << 20)
    for n in range(n_layer + 1):
        if fixed + sum(b for il, b in per_layer.items() if il >= n) <= budget_bytes:
            return n
    raise SystemExit(f"bench_cuda: even with every expert on the CPU llama.cpp needs {fixed} B > {budget_bytes} B")


class LlamaCppCudaRunner(compare.LlamaCppRunner):
    key = "llama_cpp_cuda"
    label = "llama.cpp (cuda)"
    worker_script = Path(__file__).resolve()
    n_gpu_layers = -1  # every layer on the GPU

    def __init__(self, *a, n_cpu_moe: int = 0, **kw):
        super().__init__(*a, **kw)
        self.n_cpu_moe = n_cpu_moe
        if n_cpu_moe:
            self.key, self.label = "llama_cpp_cuda_cpu_moe", f"llama.cpp (cuda, --n-cpu-moe {n_cpu_moe})"

    def options(self) -> dict:
        return {**super().options(), "n_cpu_moe": self.n_cpu_moe}

    @classmethod
    def configure_model_params(cls, L, mp, spec: dict, settings: dict):
        import ctypes
        import importlib

        n = spec["options"].get("n_cpu_moe", 0)
        settings["n_cpu_moe"] = n
        if not n:
            return None
        # What llama.cpp's --n-cpu-moe N does (common/arg.cpp): one override per layer, the expert
        # tensors of blk.0 .. blk.N-1 into the CPU backend's buffer type.
        lib_dir = os.path.join(os.path.dirname(importlib.import_module(spec["options"]["module"]).__file__), "lib")
        ggml_cpu = ctypes.CDLL(os.path.join(lib_dir, "libggml-cpu.so"))
        ggml_cpu.ggml_backend_cpu_buffer_type.restype = ctypes.c_void_p
        cpu_buft = ggml_cpu.ggml_backend_cpu_buffer_type()

        class Override(ctypes.Structure):  # struct llama_model_tensor_buft_override
            _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]

        patterns = [rf"blk\.{il}\.ffn_(up|down|gate)_exps".encode() for il in range(n)]
        overrides = (Override * (n + 1))()
        for i, p in enumerate(patterns):
            overrides[i].pattern, overrides[i].buft = p, cpu_buft
        overrides[n].pattern, overrides[n].buft = None, None  # the list's end
        mp.tensor_buft_overrides = ctypes.cast(overrides, ctypes.c_void_p)
        return overrides, patterns

    @classmethod
    def worker_main(cls, spec: dict) -> dict:
        r = super().worker_main(spec)
        r["vram_used_mib"] = gpu_memory_used_mib()
        return r


compare.WORKERS[SharpiCudaRunner.key] = SharpiCudaRunner
compare.WORKERS[LlamaCppCudaRunner.key] = LlamaCppCudaRunner
for _route in ("copy", "cpu", "auto"):
    compare.WORKERS[f"sharpi_cuda_{_route}"] = SharpiCudaRunner
compare.WORKERS["llama_cpp_cuda_cpu_moe"] = LlamaCppCudaRunner

_compare_parser = compare.build_parser


def build_parser():
    ap = _compare_parser()
    ap.add_argument("--vram-budget", default=None,
                    help="sharpi: stream experts through VRAM under this budget (e.g. 12GiB); default: all resident")
    ap.add_argument("--miss-route", default="copy",
                    help="with --vram-budget: comma-separated sharpi columns, one per miss route (copy, cpu, auto)")
    ap.add_argument("--n-cpu-moe", default="0",
                    help="llama.cpp: experts of the first N layers on the CPU; 'auto': fit --vram-budget")
    return ap


def make_runners(args, n_ctx: int, log_dir: Path) -> list:
    common = {"timeout_s": args.timeout}
    if args.vram_budget:
        sharpi_runners = [SharpiCudaRunner(args.threads, n_ctx, log_dir, exact=args.sharpi_exact,
                                           vram_budget=args.vram_budget, miss_route=route.strip(), **common)
                          for route in args.miss_route.split(",") if route.strip()]
    else:
        sharpi_runners = [SharpiCudaRunner(args.threads, n_ctx, log_dir, exact=args.sharpi_exact, **common)]
    n_cpu_moe = args.n_cpu_moe
    if n_cpu_moe == "auto":
        if not args.vram_budget:
            raise SystemExit("bench_cuda: --n-cpu-moe auto needs --vram-budget")
        from sharpi import _core

        budget = _core.parse_byte_size(args.vram_budget)
        files = list(args.files) or [os.fspath(compare.ensure_model(Path(args.model_dir).expanduser(), args.preset,
                                                                    q.strip())) for q in args.quant.split(",")]
        n_cpu_moe = max(n_cpu_moe_for_budget(f, budget, n_ctx) for f in files)
        print(f"bench_cuda: --n-cpu-moe auto -> {n_cpu_moe} for {args.vram_budget}", file=sys.stderr)
    llama = LlamaCppCudaRunner(args.threads, n_ctx, log_dir, no_repack=args.llama_no_repack,
                               n_cpu_moe=int(n_cpu_moe), **common)
    return [*sharpi_runners, llama]


def main(argv=None) -> int:
    compare.build_parser = build_parser
    args = build_parser().parse_args(argv)
    if not args.worker:
        if compare.developer_build():
            sys.path.insert(0, str(compare.REPO / "python"))
        import sharpi

        if not sharpi.cuda_available():
            raise SystemExit(f"bench_cuda: needs a CUDA device ({sharpi.cuda_describe()})")
        print(f"bench_cuda: {sharpi.cuda_describe()}", file=sys.stderr)
    compare.make_runners = make_runners
    return compare.main(argv)


if __name__ == "__main__":
    sys.exit(main())
