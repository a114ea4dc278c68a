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
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import compare


class SharpiCudaRunner(compare.SharpiRunner):
    key = "sharpi_cuda"
    label = "sharpi (cuda)"
    worker_script = Path(__file__).resolve()

    def options(self) -> dict:
        return {"exact": self.exact, "device": "cuda"}

    @classmethod
    def worker_main(cls, spec: dict) -> dict:
        import sharpi

        t0 = time.perf_counter()
        s = sharpi.Session(spec["file"], threads=spec["threads"], n_ctx=spec["n_ctx"],
                           exact=spec["options"]["exact"], device="cuda")
        load_s = time.perf_counter() - t0
        r = compare.timed_greedy(lambda ids: s.decode(ids), lambda t: s.decode([t]), s.reset,
                                 spec["prompt_ids"], spec["n_decode"])
        r.update(load_s=load_s, version=getattr(sharpi, "__version__", None), device=sharpi.cuda_describe(),
                 settings={"threads": spec["threads"], "n_ctx": spec["n_ctx"], **spec["options"]})
        return r


class LlamaCppCudaRunner(compare.LlamaCppRunner):
    key = "llama_cpp_cuda"
    label = "llama.cpp (cuda)"
    worker_script = Path(__file__).resolve()
    n_gpu_layers = -1  # every layer on the GPU


compare.WORKERS[SharpiCudaRunner.key] = SharpiCudaRunner
compare.WORKERS[LlamaCppCudaRunner.key] = LlamaCppCudaRunner


def make_runners(args, n_ctx: int, log_dir: Path) -> list:
    return [
        SharpiCudaRunner(args.threads, n_ctx, log_dir, timeout_s=args.timeout, exact=args.sharpi_exact),
        LlamaCppCudaRunner(args.threads, n_ctx, log_dir, timeout_s=args.timeout, no_repack=args.llama_no_repack),
    ]


def main(argv=None) -> int:
    args = compare.build_parser().parse_args(argv)
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
