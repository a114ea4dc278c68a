#!/usr/bin/env bash
# Build llama.cpp's llama-quantize and llama-imatrix for the tests that need files written by
# llama.cpp's own quantizer (tests/test_llama_quantized.py: the IQ types need an importance matrix),
# and, with --server, llama-server too, for benchmarks/server_parity.py (sharpi serve against
# llama-server, request by request).
#
# Owns one directory, llama-tools-VERSION, inside fetch_converter.sh's cache directory (default
# ~/.cache/sharpi/converter, or $SHARPI_CONVERTER_DIR). The source is the llama.cpp vendored in the
# same llama-cpp-python source distribution that fetch_converter.sh downloads (it is called first, so
# the sdist is fetched once for both and the converter and the quantizer are the same llama.cpp).
# It builds only those targets: portable (GGML_NATIVE=OFF, so the binaries run on any x86-64 CI
# machine and a cached build can move between machines), CPU only, no OpenSSL/HTTP client, no
# OpenMP (ggml's own thread pool: OpenMP's spinning workers collapse on shared 2-core machines),
# static, Release. llama-server is built without its web UI (no npm, no download of prebuilt assets:
# its API is what is compared) and shares the libraries already built for the other two, so --server
# after a plain run compiles only the server's own sources. Prints the directory holding the
# binaries. A stamp file per target set, written after a successful build, makes later runs print
# the directory at once; an interrupted build is resumed by the next run (cmake --build is
# incremental).
#
# Usage: tools/build_llama_tools.sh            # prints e.g. /root/.cache/sharpi/converter/llama-tools-0.3.36/bin
#        tools/build_llama_tools.sh --server   # the same directory, with llama-server in it too
#        SHARPI_CONVERTER_DIR=/tmp/conv tools/build_llama_tools.sh
#        SHARPI_BUILD_JOBS=1 nice tools/build_llama_tools.sh --server   # on a shared machine
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
case "${1:-}" in
    "") ;;
    --server)
        stamp="$tools_dir/.sharpi-built-server"
        targets+=(llama-server)
        ;;
    *)
        echo "build_llama_tools: unknown argument '$1' (the only option is --server)" >&2
        exit 2
        ;;
esac

built=1
for target in "${targets[@]}"; do
    [[ -x "$bin_dir/$target" ]] || built=0
done
if [[ -f "$stamp" && $built == 1 ]]; then
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
# The marker names what the tree holds: trees unpacked before llama-server was built here lack its
# sources, and are unpacked again (tar keeps the files' times, so nothing already built recompiles).
unpacked_marker=".sharpi-unpacked-with-server"
if [[ ! -f "$source_dir/$unpacked_marker" ]]; then
    # Unpack into a scratch directory first, so a half-unpacked tree is never taken for a whole one.
    # Left out: what no target here compiles (docs, test models and vocabularies, examples, the web
    # UI's sources and tests); of the web UI only the CMake files that make its (here empty) asset
    # table, without which llama-server's CMake target does not configure.
    scratch="$(mktemp -d "$tools_dir/unpack.XXXXXX")"
    trap 'rm -rf "$scratch"' EXIT
    prefix="llama_cpp_python-$version/vendor/llama.cpp"
    tar -xzf "$sdist" -C "$scratch" \
        --exclude="$prefix/docs" --exclude="$prefix/models" --exclude="$prefix/media" \
        --exclude="$prefix/tools/ui" --exclude="$prefix/tools/server/tests" \
        --exclude="$prefix/tools/server/bench" --exclude="$prefix/examples" \
        "$prefix"
    tar -xzf "$sdist" -C "$scratch" "$prefix/tools/ui/CMakeLists.txt" "$prefix/tools/ui/ui.cpp.in" \
        "$prefix/tools/ui/ui.h.in" "$prefix/tools/ui/sources.cmake"
    touch "$scratch/$prefix/$unpacked_marker"
    rm -rf "$source_dir"
    mv "$scratch/$prefix" "$source_dir"
fi

build_dir="$tools_dir/build"
cmake -S "$source_dir" -B "$build_dir" -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF -DGGML_OPENMP=OFF -DGGML_BACKEND_DL=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_COMMON=ON \
    $(command -v ninja > /dev/null && echo "-G Ninja") > "$build_dir.configure.log" 2>&1 \
    || { tail -40 "$build_dir.configure.log" >&2; exit 1; }
cmake --build "$build_dir" --target "${targets[@]}" -j "${SHARPI_BUILD_JOBS:-$(nproc)}" > "$build_dir.build.log" 2>&1 \
    || { tail -60 "$build_dir.build.log" >&2; exit 1; }

mkdir -p "$bin_dir"
for target in "${targets[@]}"; do
    cp "$build_dir/bin/$target" "$bin_dir/$target"
done
touch "$stamp"
echo "$bin_dir"
