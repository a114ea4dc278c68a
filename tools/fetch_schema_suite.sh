#!/usr/bin/env bash
# Fetch the official JSON-Schema-Test-Suite (draft 2020-12) for the constrained-decoding tests.
#
# Owns one cache directory (default ~/.cache/sharpi/schema-suite, or $SHARPI_SCHEMA_SUITE_DIR). The
# suite (github.com/json-schema-org/JSON-Schema-Test-Suite) ships inside the `jsonschema` source
# distribution on PyPI under json/tests/; this downloads that sdist with pip (a pinned version, so
# the suite's files, and the schemas tests/test_constrained.py pins from them, do not drift), unpacks
# only json/tests/draft2020-12 plus the suite's LICENSE and prints the directory that holds
# draft2020-12's keyword files (type.json, properties.json, ...). It never installs anything: the
# installed jsonschema package (the tests' validator) stays untouched.
#
# Usage: tools/fetch_schema_suite.sh          # prints e.g. /root/.cache/sharpi/schema-suite/draft2020-12
#        SHARPI_SCHEMA_SUITE_DIR=/tmp/suite tools/fetch_schema_suite.sh
#        PYTHON=/path/to/python tools/fetch_schema_suite.sh   # the pip to download with (default: python)
set -euo pipefail

version="4.23.0"
python="${PYTHON:-python}"
cache_dir="${SHARPI_SCHEMA_SUITE_DIR:-$HOME/.cache/sharpi/schema-suite}"
suite_dir="$cache_dir/draft2020-12"
stamp="$suite_dir/.sharpi-jsonschema-$version"

if [[ -f "$stamp" && -f "$suite_dir/type.json" ]]; then
    echo "$suite_dir"
    exit 0
fi

mkdir -p "$cache_dir"
download_dir="$cache_dir/sdist"
mkdir -p "$download_dir"
sdist="$download_dir/jsonschema-$version.tar.gz"
if [[ ! -f "$sdist" ]]; then
    # --no-binary jsonschema forces its source distribution (the wheel does not ship the suite)
    # while its build backend, which pip needs to read the metadata, may still come as a wheel;
    # --no-deps keeps pip from resolving or fetching anything else.
    "$python" -m pip download --quiet --no-binary jsonschema --no-deps --dest "$download_dir" \
        "jsonschema==$version" >&2
fi
if [[ ! -f "$sdist" ]]; then
    echo "fetch_schema_suite: pip did not produce $sdist" >&2
    exit 1
fi

# Unpack into a scratch directory first so an interrupted run never leaves a half-written suite that
# a later run would mistake for a complete one.
scratch="$(mktemp -d "$cache_dir/unpack.XXXXXX")"
trap 'rm -rf "$scratch"' EXIT
prefix="jsonschema-$version/json"
tar -xzf "$sdist" -C "$scratch" "$prefix/tests/draft2020-12" "$prefix/LICENSE"
mv "$scratch/$prefix/LICENSE" "$scratch/$prefix/tests/draft2020-12/LICENSE"

rm -rf "$suite_dir"
mv "$scratch/$prefix/tests/draft2020-12" "$suite_dir"
touch "$stamp"
echo "$suite_dir"
