#!/usr/bin/env bash
# Fetch llama.cpp's real HF -> GGUF converter for the transformers oracle tests.
#
# Owns one cache directory (default ~/.cache/sharpi/converter, or $SHARPI_CONVERTER_DIR). It downloads
# the llama-cpp-python source distribution (which vendors llama.cpp) with pip, unpacks only what the
# converter needs (convert_hf_to_gguf.py, conversion/, gguf-py/) plus llama.cpp's tokenizer fixtures
# (models/ggml-vocab-*.gguf with their .inp/.out cases) and chat templates (models/templates/*.jinja) and prints the directory that holds
# convert_hf_to_gguf.py. It never installs anything into the Python environment: the downloaded
# gguf-py is used through PYTHONPATH by whoever runs the converter, so the installed gguf package
# (which sharpi's tests use as an oracle) stays untouched.
#
# Usage: tools/fetch_converter.sh            # prints e.g. /root/.cache/sharpi/converter/llama.cpp
#        SHARPI_CONVERTER_DIR=/tmp/conv tools/fetch_converter.sh
set -euo pipefail

version="0.3.36"
cache_dir="${SHARPI_CONVERTER_DIR:-$HOME/.cache/sharpi/converter}"
converter_dir="$cache_dir/llama.cpp"
stamp="$converter_dir/.sharpi-llama-cpp-python-$version"

if [[ -f "$stamp" && -f "$converter_dir/convert_hf_to_gguf.py" && -d "$converter_dir/models/templates" ]]; then
    echo "$converter_dir"
    exit 0
fi

mkdir -p "$cache_dir"
download_dir="$cache_dir/sdist"
mkdir -p "$download_dir"
sdist="$download_dir/llama_cpp_python-$version.tar.gz"
if [[ ! -f "$sdist" ]]; then
    # --no-binary llama-cpp-python forces its source distribution (the wheels do not ship the
    # converter) while the build tools pip needs to read its metadata still come as wheels (with
    # :all: pip compiles cmake from source first: many minutes on a fresh machine); --no-deps keeps
    # pip from resolving or fetching anything else.
    python -m pip download --quiet --no-binary llama-cpp-python --no-deps --dest "$download_dir" \
        "llama-cpp-python==$version" >&2
fi
if [[ ! -f "$sdist" ]]; then
    echo "fetch_converter: pip did not produce $sdist" >&2
    exit 1
fi

# Unpack into a scratch directory first so an interrupted run never leaves a half-written converter
# that a later run would mistake for a complete one.
scratch="$(mktemp -d "$cache_dir/unpack.XXXXXX")"
trap 'rm -rf "$scratch"' EXIT
prefix="llama_cpp_python-$version/vendor/llama.cpp"
# models/ggml-vocab-*: llama.cpp's tokenizer fixtures (vocab-only GGUFs with .inp/.out test cases);
# models/templates/*.jinja: the real chat templates llama.cpp tests (tests/test_chat_templates.py).
tar -xzf "$sdist" -C "$scratch" --wildcards \
    "$prefix/models/ggml-vocab-*" \
    "$prefix/models/templates/*.jinja" \
    "$prefix/convert_hf_to_gguf.py" \
    "$prefix/conversion" \
    "$prefix/gguf-py" \
    "$prefix/LICENSE"

rm -rf "$converter_dir"
mv "$scratch/$prefix" "$converter_dir"
touch "$stamp"
echo "$converter_dir"
