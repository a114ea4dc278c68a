"""llama.cpp's own quantizer for the tests that hold sharpi to the files users make with it: builds
llama-quantize once (tools/build_llama_tools.sh, cached) and writes a quantized copy of a file beside
it (reused when present). A missing prerequisite is ci_policy.prerequisite_missing's call: a skip
outside CI, a failure in it."""

from __future__ import annotations

import subprocess
from pathlib import Path

from ci_policy import prerequisite_missing

REPO_ROOT = Path(__file__).resolve().parents[1]
BUILD_SCRIPT = REPO_ROOT / "tools" / "build_llama_tools.sh"


def llama_tools_dir() -> Path:
    """The folder holding llama-quantize (built by tools/build_llama_tools.sh on first use)."""
    done = subprocess.run(["bash", str(BUILD_SCRIPT)], capture_output=True, text=True, timeout=5400, check=False)
    lines = done.stdout.strip().splitlines()
    bin_dir = Path(lines[-1]) if lines else None
    if done.returncode != 0 or bin_dir is None or not (bin_dir / "llama-quantize").is_file():
        prerequisite_missing(f"tools/build_llama_tools.sh failed (rc {done.returncode}): {done.stderr[-3000:]}")
    return bin_dir


def llama_quantize(src: Path, out: Path, quant: str = "Q4_K_M", threads: int = 2, options=()) -> Path:
    """`src` quantized by llama-quantize to `quant` at `out` (kept when it exists). options: flags
    before the file names (deepseek4's converter files need --allow-requantize: their experts are
    MXFP4 already)."""
    out = Path(out)
    if not out.is_file():
        run = subprocess.run([str(llama_tools_dir() / "llama-quantize"), *options, str(src), str(out), quant,
                              str(threads)],
                             capture_output=True, text=True, timeout=900, check=False)  # fmt: skip
        assert run.returncode == 0, f"llama-quantize failed:\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}"
    return out
