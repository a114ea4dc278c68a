#!/usr/bin/env bash
# Build llama.cpp's llama-quantize and llama-imatrix for the tests that need files written by
# llama.cpp's own quantizer (tests/test_llama_quantized.py: the IQ types need an importance matrix).
#
# Owns one directory, llama-tools-VERSION, inside fetch_converter.sh's cache directory (default
# ~/.cache/sharpi/converter, or $SHARPI_CONVERTER_DIR). The source is the llama.cpp vendored in the
# same llama-cpp-python source distribution that fetch_converter.sh downloads (it is called first, so
# the sdist is fetched once for both and the converter and the quantizer are the same llama.cpp).
# It builds only those two targets: portable (GGML_NATIVE=OFF, so the binaries run on any x86-64 CI
# machine and a cached build can move between machines), CPU only, no OpenSSL/HTTP client, no
# OpenMP (ggml's own thread pool: OpenMP's spinning workers collapse on shared 2-core machines),
# static, Release. Prints the directory holding the two binaries. A stamp file written after a
# successful build makes later runs print the directory at once; an interrupted build is resumed by
# the next run (cmake --build is incremental).
#
# Usage: tools/build_llama_tools.sh            # prints e.g. /root/.cache/sharpi/converter/llama-tools-0.3.36/bin
#        SHARPI_CONVERTER_DIR=/tmp/conv tools/build_llama_tools.sh
# The compiler launcher is the caller's choice: CMAKE_C_COMPILER_LAUNCHER=ccache (and _CXX_) in the
# environment is honoured by cmake.
set -euo pipefail

version="0.3.36"  # the llama-cpp-python release fetch_converter.sh downloads
here="$(cd "$(dirname "$0")" && pwd)"
cache_dir="${SHARPI_CONVERTER_DIR:-$HOME/.cache/sharpi/converter}"
tools_dir="$cache_dir/llama-tools-$version"
bin_dir="$tools_dir/bin"
stamp="$tools_dir/.sharpi-built"
targets=(llama-quantize llama-imatrix)

if [[ -f "$stamp" && -x "$bin_dir/llama-quantize" && -x "$bin_dir/llama-imatrix" ]]; then
    echo "$bin_dir"
    exit 0
fi

# Downloads the sdist into $cache_dir/sdist if it is not there yet (its stdout is the converter's path).
bash "$here/fetch_converter.sh" > /dev/null
sdist="$cache_dir/sdist/llama_cpp_python-$version.tar.gz"
if [[ ! -f "$sdist" ]]; then
    echo "build_llama_tools: $sdist missing after fetch_converter.sh" >&2
    exit 1
fi

mkdir -p "$tools_dir"
source_dir="$tools_dir/llama.cpp"
if [[ ! -f "$source_dir/.sharpi-unpacked" ]]; then
    # Unpack into a scratch directory first, so a half-unpacked tree is never taken for a whole one.
    # Left out: what no target here compiles (docs, test models and vocabularies, the web UI assets).
    scratch="$(mktemp -d "$tools_dir/unpack.XXXXXX")"
    trap 'rm -rf "$scratch"' EXIT
    prefix="llama_cpp_python-$version/vendor/llama.cpp"
    tar -xzf "$sdist" -C "$scratch" \
        --exclude="$prefix/docs" --exclude="$prefix/models" --exclude="$prefix/media" \
        --exclude="$prefix/tools/ui" --exclude="$prefix/tools/server" --exclude="$prefix/examples" \
        "$prefix"
    touch "$scratch/$prefix/.sharpi-unpacked"
    rm -rf "$source_dir"
    mv "$scratch/$prefix" "$source_dir"
fi

build_dir="$tools_dir/build"
cmake -S "$source_dir" -B "$build_dir" -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF -DGGML_OPENMP=OFF -DGGML_BACKEND_DL=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_COMMON=ON \
    $(command -v ninja > /dev/null && echo "-G Ninja") > "$build_dir.configure.log" 2>&1 \
    || { tail -40 "$build_dir.configure.log" >&2; exit 1; }
cmake --build "$build_dir" --target "${targets[@]}" -j "$(nproc)" > "$build_dir.build.log" 2>&1 \
    || { tail -60 "$build_dir.build.log" >&2; exit 1; }

mkdir -p "$bin_dir"
for target in "${targets[@]}"; do
    cp "$build_dir/bin/$target" "$bin_dir/$target"
done
touch "$stamp"
echo "$bin_dir"
