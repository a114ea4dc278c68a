"""A small GGUF splitter for tests: writes one GGUF file as K shards the way llama.cpp's gguf-split
and convert_hf_to_gguf.py --split-max-tensors do (NAME-0000i-of-0000K.gguf; split.no 0-based
uint16, split.count uint16, split.tensors.count int32 in every shard; the other metadata only in
the first shard; tensors in file order, consecutive runs per shard).

It copies metadata entries and tensor bytes as raw bytes (the gguf package's reader gives the raw
pieces of every entry), so the shards hold exactly the source's values; only the split.* entries,
the tensor counts and the data offsets are written here.
"""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np


def _raw(parts) -> bytes:
    return b"".join(np.asarray(p).tobytes() for p in parts)


def _kv(key: str, value_type: int, fmt: str, value) -> bytes:
    k = key.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<I", value_type) + struct.pack(fmt, value)


def split_gguf(src, out_stem, n_shards: int) -> list[Path]:
    """Writes out_stem-0000i-of-0000K.gguf for i = 1..n_shards; returns their paths in order."""
    src = Path(src)
    r = gguf.GGUFReader(src)
    data = src.read_bytes()
    alignment = int(r.fields["general.alignment"].contents()) if "general.alignment" in r.fields else 32
    model_kv = [_raw(f.parts) for name, f in r.fields.items() if not name.startswith("GGUF.")]
    tensors = list(r.tensors)
    groups = [list(g) for g in np.array_split(np.arange(len(tensors)), n_shards)]
    paths = []
    for i, group in enumerate(groups):
        kv = (model_kv if i == 0 else []) + [
            _kv("split.no", gguf.GGUFValueType.UINT16, "<H", i),
            _kv("split.count", gguf.GGUFValueType.UINT16, "<H", n_shards),
            _kv("split.tensors.count", gguf.GGUFValueType.INT32, "<i", len(tensors)),
        ]
        if i > 0 and alignment != 32:
            kv.append(_kv("general.alignment", gguf.GGUFValueType.UINT32, "<I", alignment))
        infos, blobs, offset = [], [], 0
        for ti in group:
            t = tensors[int(ti)]
            parts = t.field.parts  # name length, name, n_dims, dims, type, offset
            infos.append(_raw(parts[:-1]) + struct.pack("<Q", offset))
            blob = data[t.data_offset : t.data_offset + t.n_bytes]
            pad = (-len(blob)) % alignment
            blobs.append(blob + b"\0" * pad)
            offset += len(blob) + pad
        header = b"GGUF" + struct.pack("<IQQ", 3, len(group), len(kv)) + b"".join(kv) + b"".join(infos)
        header += b"\0" * ((-len(header)) % alignment)
        path = Path(f"{out_stem}-{i + 1:05d}-of-{n_shards:05d}.gguf")
        path.write_bytes(header + b"".join(blobs))
        paths.append(path)
    return paths
