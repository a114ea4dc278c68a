"""Export a trained run to GGUF with llama.cpp's own converter (convert_hf_to_gguf.py, --outtype q8_0).

Owns two things: a converter cache folder (default ~/.cache/sharpi/train_moe-converter, or
--converter-cache) holding the llama-cpp-python source distribution fetched with pip and the parts
of it the converter needs, and the output GGUF path it is given. It never installs anything into the
Python environment and never modifies the converter: convert_wrapper.py runs it in a subprocess with
its own gguf-py on PYTHONPATH.

Input: RUN/hf, written by train.py with save_pretrained (config, safetensors, tokenizer files).
After converting it checks the file as written: architecture qwen3moe, pre-tokenizer "gpt-2", Q8_0
matrices, and the size limit.

    python tools/train_moe/export.py --run runs/stdlib-moe --out python/sharpi/models/stdlib-moe-q8_0.gguf
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
SIZE_LIMIT_BYTES = 20 * 1000 * 1000
HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
DEFAULT_OUT = REPO_ROOT / "python" / "sharpi" / "models" / "stdlib-moe-q8_0.gguf"


def fetch_converter(cache: Path) -> Path:
    """Folder holding convert_hf_to_gguf.py, conversion/ and gguf-py/ of llama-cpp-python's vendored
    llama.cpp, downloaded once (pip download of the source distribution, no dependencies)."""
    converter = cache / f"llama.cpp-{LLAMA_CPP_PYTHON_VERSION}"
    if (converter / "convert_hf_to_gguf.py").exists() and (converter / ".complete").exists():
        return converter
    cache.mkdir(parents=True, exist_ok=True)
    sdist = cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
    if not sdist.exists():
        # --no-binary llama-cpp-python gives its source distribution (wheels do not carry the
        # converter) while pip's build tools stay wheels; --no-deps keeps pip from resolving
        # anything else.
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-binary",
                "llama-cpp-python",
                "--no-deps",
                "--dest",
                str(cache),
                f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}",
            ],
            check=True,
        )
    if not sdist.exists():
        raise FileNotFoundError(f"pip download did not produce {sdist}")
    prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/"
    wanted = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "LICENSE")
    # Unpack into a scratch folder and move it into place, so an interrupted run never leaves a
    # half-written converter that a later run would take for complete.
    scratch = Path(tempfile.mkdtemp(dir=cache))
    try:
        with tarfile.open(sdist) as tar:
            members = [
                m
                for m in tar.getmembers()
                if m.name.startswith(prefix) and m.name[len(prefix) :].startswith(wanted)
            ]
            tar.extractall(scratch, members=members, filter="data")
        shutil.rmtree(converter, ignore_errors=True)
        os.replace(scratch / prefix, converter)
        (converter / ".complete").touch()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return converter


def convert(
    hf_dir: Path, out: Path, converter: Path, outtype: str = "q8_0", model_name: str = "sharpi-stdlib-moe"
):
    out.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(converter / "gguf-py"), NO_LOCAL_GGUF="")
    cmd = [
        sys.executable,
        str(HERE / "convert_wrapper.py"),
        str(converter),
        str(hf_dir),
        "--outfile",
        str(out),
        "--outtype",
        outtype,
        "--model-name",
        model_name,
    ]
    subprocess.run(cmd, check=True, env=env)


def check_file(path: Path, outtype: str = "q8_0") -> dict:
    """Read the written file back with the installed gguf package and check what sharpi relies on."""
    import gguf

    reader = gguf.GGUFReader(str(path))

    def field(key):
        f = reader.fields[key]
        value = f.parts[f.data[0]]
        return bytes(value).decode() if f.types[0] == gguf.GGUFValueType.STRING else value.tolist()[0]

    facts = {
        "arch": field("general.architecture"),
        "pre": field("tokenizer.ggml.pre"),
        "bytes": path.stat().st_size,
        "types": {},
    }
    for tensor in reader.tensors:
        facts["types"][tensor.tensor_type.name] = facts["types"].get(tensor.tensor_type.name, 0) + 1
    problems = []
    if facts["arch"] != "qwen3moe":
        problems.append(f"architecture {facts['arch']!r}, expected 'qwen3moe'")
    if facts["pre"] != "gpt-2":
        problems.append(f"tokenizer.ggml.pre {facts['pre']!r}, expected 'gpt-2'")
    if outtype.upper() not in facts["types"]:
        problems.append(f"no {outtype.upper()} tensors: {facts['types']}")
    if facts["bytes"] > SIZE_LIMIT_BYTES:
        problems.append(f"{facts['bytes']} bytes, over the {SIZE_LIMIT_BYTES} byte limit")
    if problems:
        raise RuntimeError(f"{path}: " + "; ".join(problems))
    return facts


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", type=Path, required=True, help="run folder of train.py (uses RUN/hf)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--outtype", default="q8_0")
    p.add_argument(
        "--converter-cache", type=Path, default=Path.home() / ".cache" / "sharpi" / "train_moe-converter"
    )
    p.add_argument(
        "--converter",
        type=Path,
        default=None,
        help="an existing folder with convert_hf_to_gguf.py, conversion/ and gguf-py/ (skips the download)",
    )
    args = p.parse_args(argv)
    converter = args.converter or fetch_converter(args.converter_cache)
    convert(args.run / "hf", args.out, converter, args.outtype)
    facts = check_file(args.out, args.outtype)
    print(
        f"wrote {args.out}: {facts['bytes'] / 1e6:.2f} MB, arch {facts['arch']}, pre {facts['pre']}, "
        f"tensor types {facts['types']}"
    )


if __name__ == "__main__":
    main()
