"""Helpers that derive broken or altered GGUF files from a valid one, for error-path tests.

rewrite_gguf copies a file through the gguf package's reader and writer (an implementation
independent of sharpi's reader), applying edits on the way.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter


def rewrite_gguf(
    src: str,
    dst: str,
    set_kv: dict[str, object] | None = None,
    drop_kv: tuple = (),
    drop_tensors: tuple = (),
    tensor_edit: Callable[[str, np.ndarray, GGMLQuantizationType, list], tuple] | None = None,
    add_tensors: dict[str, np.ndarray] | None = None,
) -> None:
    """Copy src to dst. set_kv: {key: value} (str, int (u32, or u64 when it needs 64 bits), float,
    bool or a list; replaces or adds).
    tensor_edit(name, raw_bytes, type, ggml_shape) -> (raw_bytes, type, ggml_shape) or None to keep.
    add_tensors: {name: float32 array in numpy shape} appended after the file's own tensors."""
    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(dst, arch=str(set_kv.get("general.architecture", arch)) if set_kv else arch)
    set_kv = dict(set_kv or {})
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in drop_kv:
            continue
        if name in set_kv:
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == GGUFValueType.ARRAY and len(field.types) > 1 else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
    for key, value in set_kv.items():
        if key == "general.architecture":
            continue
        if isinstance(value, bool):
            writer.add_key_value(key, value, GGUFValueType.BOOL)
        elif isinstance(value, int):
            writer.add_key_value(key, value, GGUFValueType.UINT32 if value < 2**32 else GGUFValueType.UINT64)
        elif isinstance(value, float):
            writer.add_key_value(key, value, GGUFValueType.FLOAT32)
        elif isinstance(value, list):
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, str(value), GGUFValueType.STRING)
    for t in reader.tensors:
        if t.name in drop_tensors:
            continue
        raw = np.asarray(t.data).view(np.uint8).reshape(-1)
        ttype = GGMLQuantizationType(t.tensor_type)
        shape = [int(x) for x in t.shape]  # ggml order, ne[0] first
        if tensor_edit is not None:
            edited = tensor_edit(t.name, raw, ttype, shape)
            if edited is not None:
                raw, ttype, shape = edited
        # Raw bytes in numpy byte shape (reversed ggml order, innermost dimension in bytes).
        writer.add_tensor(t.name, raw.reshape(_byte_shape(shape, ttype)), raw_dtype=ttype)
    for name, array in (add_tensors or {}).items():
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _byte_shape(shape_ggml: list, ttype: GGMLQuantizationType) -> list:
    """numpy byte shape (reversed ggml order, innermost dim in bytes) that GGUFWriter expects."""
    from gguf import GGML_QUANT_SIZES

    block, type_size = GGML_QUANT_SIZES[ttype]
    inner = shape_ggml[0] // block * type_size
    return list(reversed(shape_ggml[1:])) + [inner]
