"""Test helpers for GGUF files: a byte-level GGUF builder that can also write *broken* files.

gguf.GGUFWriter (the oracle writer) refuses to produce malformed files, so the bad-input tests build
headers here with struct, following the GGUF spec directly (little-endian; v2 and v3 share one
layout, v1 used 32-bit counts). `test_gguf.py::test_raw_builder_agrees_with_gguf_reader` checks that
what this module builds for valid input parses identically in gguf.GGUFReader, so the broken
variants differ from a known-good file only in the field each test corrupts.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

# GGUF metadata value types (gguf.GGUFValueType numbering).
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)

_SCALAR_FMT = {
    UINT8: "<B",
    INT8: "<b",
    UINT16: "<H",
    INT16: "<h",
    UINT32: "<I",
    INT32: "<i",
    FLOAT32: "<f",
    BOOL: "<?",
    UINT64: "<Q",
    INT64: "<q",
    FLOAT64: "<d",
}


def pack_string(s: str | bytes, length: int | None = None) -> bytes:
    """u64 length + bytes; `length` overrides the stored length (to write a lying one)."""
    b = s.encode("utf-8") if isinstance(s, str) else s
    return struct.pack("<Q", len(b) if length is None else length) + b


def pack_value(vtype: int, value, sub_type: int | None = None, count: int | None = None) -> bytes:
    """Encodes one value (without its type tag). ARRAY: value is a list of elements of `sub_type`;
    nested arrays are given as (sub_sub_type, list) tuples. `count` overrides the stored count."""
    if vtype in _SCALAR_FMT:
        return struct.pack(_SCALAR_FMT[vtype], value)
    if vtype == STRING:
        return pack_string(value)
    if vtype == ARRAY:
        assert sub_type is not None
        out = struct.pack("<IQ", sub_type, len(value) if count is None else count)
        for v in value:
            if sub_type == ARRAY:
                inner_type, inner_vals = v
                out += pack_value(ARRAY, inner_vals, inner_type)
            else:
                out += pack_value(sub_type, v)
        return out
    raise ValueError(f"unknown value type {vtype}")


def pack_kv(key: str, vtype: int, value, sub_type: int | None = None) -> bytes:
    return pack_string(key) + struct.pack("<I", vtype) + pack_value(vtype, value, sub_type)


def pack_tensor_info(name: str, ne: list[int], ggml_type: int, offset: int) -> bytes:
    return (
        pack_string(name)
        + struct.pack("<I", len(ne))
        + struct.pack(f"<{len(ne)}Q", *ne)
        + struct.pack("<IQ", ggml_type, offset)
    )


@dataclass
class RawTensor:
    name: str
    ne: list[int]  # ggml order, ne[0] innermost
    ggml_type: int
    data: bytes
    offset: int | None = None  # relative to the data section; None = packed in order, aligned


@dataclass
class RawGguf:
    """A built file and where its sections start (absolute byte offsets)."""

    data: bytes
    kv_start: int
    ti_start: int
    data_start: int
    tensor_offsets: list[int] = field(default_factory=list)  # relative offsets, in directory order


def build_gguf(
    kv_blobs: list[bytes],
    tensors: list[RawTensor],
    *,
    version: int = 3,
    alignment: int = 32,
    magic: bytes = b"GGUF",
    n_kv: int | None = None,
    n_tensors: int | None = None,
) -> RawGguf:
    """Assembles a GGUF file from pre-packed metadata entries (pack_kv) and tensors. The data section
    starts at the next multiple of `alignment` (pass the same value as any general.alignment entry)."""
    header = magic + struct.pack("<I", version)
    header += struct.pack(
        "<QQ", len(tensors) if n_tensors is None else n_tensors, len(kv_blobs) if n_kv is None else n_kv
    )
    kv_start = len(header)
    body = header + b"".join(kv_blobs)
    ti_start = len(body)
    offsets, cursor = [], 0
    for t in tensors:
        off = cursor if t.offset is None else t.offset
        offsets.append(off)
        cursor = max(cursor, off + len(t.data))
        cursor = (cursor + alignment - 1) // alignment * alignment
        body += pack_tensor_info(t.name, t.ne, t.ggml_type, off)
    data_start = (len(body) + alignment - 1) // alignment * alignment
    data = bytearray(body + b"\0" * (data_start - len(body)))
    for t, off in zip(tensors, offsets):
        end = data_start + off + len(t.data)
        if len(data) < end:
            data += b"\0" * (end - len(data))
        data[data_start + off : end] = t.data
    return RawGguf(bytes(data), kv_start, ti_start, data_start, offsets)
