"""A generated corpus of hostile GGUF files (issue 15): files whose counts and lengths are
consistent with their size, so the old "fits in the bytes left" checks pass, but whose parse or load
would allocate many times the file's size (or an absurd amount from a few bytes of metadata).

Every case must fail with sharpi.FormatError under a 1 GiB address-space limit
(test_hostile_files.py). Big cases are sparse files: a header and a hole, so they cost no disk and
little time, yet the parser sees hundreds of MiB of well-formed zeros (an all-zero array element is
an empty u8 array, an all-zero string is an empty string).

`parser_cases` are loaded with GgufFile and Session; `model_cases` are a valid tiny model with one
hyper-parameter made absurd, loaded with Session (resident and streamed).
"""

from __future__ import annotations

import os
import struct

from gguf_helpers import ARRAY, STRING, UINT8, UINT32, build_gguf, pack_kv, pack_string, pack_tensor_info
from model_files import rewrite_gguf

MiB = 1 << 20
HEADER = 4 + 4 + 8 + 8  # magic, version, n_tensors, n_kv


def _sparse(path: str, head: bytes, size: int) -> None:
    """`head`, then zeros up to `size` bytes, as a hole (no disk blocks)."""
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)


def _header(n_tensors: int, n_kv: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv)


def _one_array(elem_type: int, count: int, key: str = "hostile.array") -> bytes:
    return _header(0, 1) + pack_string(key) + struct.pack("<IIQ", ARRAY, elem_type, count)


def parser_cases(d: str) -> dict[str, str]:
    """{case name: path}. Each header is consistent with the file size; the body is zeros."""
    cases: dict[str, str] = {}

    def sparse(name: str, head: bytes, size: int) -> None:
        cases[name] = os.path.join(d, name + ".gguf")
        _sparse(cases[name], head, size)

    def small(name: str, blob: bytes) -> None:
        cases[name] = os.path.join(d, name + ".gguf")
        with open(cases[name], "wb") as f:
            f.write(blob)

    size = 96 * MiB
    # n_kv = what the file could hold at 13 bytes an entry: the table reserve alone was ~1.5 GB.
    sparse("kv_reserve", _header(0, (size - HEADER) // 13), size)
    # n_tensors = what the file could hold at 24 bytes an entry: the directory reserve was ~1 GB.
    sparse("tensor_reserve", _header((192 * MiB - HEADER) // 24, 0), 192 * MiB)
    # 8M empty arrays (12 zero bytes each) in an array of arrays: ~1.2 GB of nested values.
    sparse("nested_arrays", _one_array(ARRAY, (size - 64) // 12), size)
    # 90M u8 elements, widened to int64: 720 MB plus the raw copy.
    sparse("u8_array", _one_array(UINT8, 90 * MiB), size)
    # 12M empty strings (8 zero bytes each) per array, two arrays: ~770 MB of std::string.
    head = _header(0, 2) + pack_string("a") + struct.pack("<IIQ", ARRAY, STRING, 12 * MiB)
    second = pack_string("b") + struct.pack("<IIQ", ARRAY, STRING, 12 * MiB)
    blob = head + b"\0" * (8 * 12 * MiB) + second
    cases["string_arrays"] = os.path.join(d, "string_arrays.gguf")
    with open(cases["string_arrays"], "wb") as f:
        f.write(head)
        f.seek(len(head) + 8 * 12 * MiB)
        f.write(second)
        f.truncate(len(blob) + 8 * 12 * MiB)
    # One 90 MB string value: within the file, over the per-string cap.
    sparse("long_string", _header(0, 1) + pack_string("k") + struct.pack("<IQ", STRING, 90 * MiB), size)
    # Absurd counts that do not fit the file at all (the original checks).
    small("kv_count_2e60", _header(0, 2**60))
    small("tensor_count_2e60", _header(2**60, 0))
    small("array_count_2e60", _one_array(UINT32, 2**60))
    # Nesting deeper than any real file.
    deep = _header(0, 1) + pack_string("deep") + struct.pack("<I", ARRAY)
    deep += struct.pack("<IQ", ARRAY, 1) * 64 + struct.pack("<IQ", UINT8, 0)
    small("deep_nesting", deep)
    # Tensor directory entries that lie.
    base = [pack_kv("general.architecture", STRING, "qwen3moe")]
    for name, ne in (("five_dims", [32, 1, 1, 1, 1]), ("zero_dim", [32, 0]), ("dims_overflow", [32, 2**62, 8])):
        blob = build_gguf(base, []).data
        blob = blob[:8] + struct.pack("<Q", 1) + blob[16:] + pack_tensor_info("t", ne, 0, 0) + b"\0" * 64
        small(name, blob)
    blob = build_gguf(base, []).data
    small("data_beyond_eof", blob[:8] + struct.pack("<Q", 1) + blob[16:] + pack_tensor_info("t", [32, 2**40], 0, 0))
    return cases


# Hyper-parameters that size the model's tables (layers, heads, experts, KV cache): each case sets
# one to a value no real model has. u32 values are written as u32, larger ones as u64.
MODEL_KEYS = {
    "block_count_u32max": ("block_count", 2**32 - 1),
    "block_count_2e63": ("block_count", 2**63),
    "expert_count_2e40": ("expert_count", 2**40),
    "key_length_2e62": ("attention.key_length", 2**62),
    "embedding_length_2e40": ("embedding_length", 2**40),
    "head_count_2e31": ("attention.head_count", 2**31),
    "head_count_kv_2e40": ("attention.head_count_kv", 2**40),
    "context_length_2e60": ("context_length", 2**60),
    "expert_ff_length_2e40": ("expert_feed_forward_length", 2**40),
}


def model_cases(d: str, tiny: str, arch: str) -> dict[str, str]:
    """{case name: path}: the tiny model `tiny` (architecture `arch`) with one key made absurd, and
    the same model truncated in its tensor data."""
    cases: dict[str, str] = {}
    for name, (key, value) in MODEL_KEYS.items():
        cases[name] = os.path.join(d, name + ".gguf")
        rewrite_gguf(tiny, cases[name], set_kv={f"{arch}.{key}": value})
    cases["truncated_data"] = os.path.join(d, "truncated_data.gguf")
    with open(tiny, "rb") as f:
        blob = f.read()
    with open(cases["truncated_data"], "wb") as f:
        f.write(blob[: len(blob) * 2 // 3])
    return cases
