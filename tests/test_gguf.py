"""The C++ GGUF reader (sharpi._core.GgufFile) against the gguf package.

Good files are written by gguf.GGUFWriter and every value, tensor entry and tensor byte is compared
with gguf.GGUFReader and with the values that were written. Bad files (built byte by byte with
tests/gguf_helpers.py) must raise the typed sharpi error that names the fault, never crash.
"""

from __future__ import annotations

import os
import struct

import gguf
import numpy as np
import pytest
from gguf_helpers import (
    ARRAY,
    BOOL,
    FLOAT32,
    FLOAT64,
    INT8,
    INT16,
    INT32,
    INT64,
    STRING,
    UINT8,
    UINT16,
    UINT32,
    UINT64,
    RawTensor,
    build_gguf,
    pack_kv,
    pack_string,
    pack_tensor_info,
    pack_value,
)
from sharpi import _core

VT = gguf.GGUFValueType
QT = gguf.GGMLQuantizationType

NUMPY_OF = {
    VT.UINT8: np.uint8,
    VT.INT8: np.int8,
    VT.UINT16: np.uint16,
    VT.INT16: np.int16,
    VT.UINT32: np.uint32,
    VT.INT32: np.int32,
    VT.UINT64: np.uint64,
    VT.INT64: np.int64,
    VT.FLOAT32: np.float32,
    VT.FLOAT64: np.float64,
    VT.BOOL: np.bool_,
}


# --------------------------------------------------------------------------------------------------
# Good files: every value type, arrays, nested arrays, tensors of several types, custom alignment
# --------------------------------------------------------------------------------------------------


def _random_metadata(rng: np.random.Generator) -> list[tuple[str, object, VT, VT | None]]:
    """(key, value, type, array sub-type) for every scalar type and array kind, fresh random values."""
    items: list[tuple[str, object, VT, VT | None]] = []
    for vt, np_t in NUMPY_OF.items():
        name = vt.name.lower()
        if vt == VT.BOOL:
            scalar = bool(rng.integers(0, 2))
            arr = [bool(b) for b in rng.integers(0, 2, size=int(rng.integers(1, 40)))]
        elif vt in (VT.FLOAT32, VT.FLOAT64):
            scalar = float(np_t(rng.normal() * 1e3))
            arr = [float(np_t(x)) for x in rng.normal(size=int(rng.integers(1, 40))) * 1e2]
        else:
            info = np.iinfo(np_t)
            scalar = int(rng.integers(info.min, info.max, endpoint=True, dtype=np_t))
            arr = [
                int(x)
                for x in rng.integers(
                    info.min, info.max, endpoint=True, size=int(rng.integers(1, 40)), dtype=np_t
                )
            ]
        items.append((f"test.scalar.{name}", scalar, vt, None))
        items.append((f"test.array.{name}", arr, VT.ARRAY, vt))
    # Extremes that a careless reader gets wrong: u64 above 2^63, most negative i64, NaN-free f64.
    items.append(("test.edge.u64_max", 2**64 - 1, VT.UINT64, None))
    items.append(("test.edge.i64_min", -(2**63), VT.INT64, None))
    items.append(("test.edge.empty_string", "", VT.STRING, None))
    items.append(("test.string.unicode", "Grüße, 世界 — ok \U0001f600", VT.STRING, None))
    words = ["", "a", "héllo", "tab\tand\nnewline", "Ġthe", "<|im_start|>"]
    items.append(
        ("test.array.string", [words[i] for i in rng.integers(0, len(words), size=50)], VT.ARRAY, VT.STRING)
    )
    # A large numeric array (token types of a real vocab are ~150k entries).
    items.append(
        (
            "test.array.large_int32",
            [int(x) for x in rng.integers(-1000, 1000, size=20000)],
            VT.ARRAY,
            VT.INT32,
        )
    )
    # Arrays of arrays: GGUFWriter infers the inner element type from the first inner element.
    items.append(("test.nested.int", [[1, 2, 3], [4], [int(rng.integers(0, 100))]], VT.ARRAY, None))
    items.append(("test.nested.string", [["x", "y"], ["z"]], VT.ARRAY, None))
    return items


def _random_tensors(rng: np.random.Generator) -> list[tuple[str, np.ndarray, QT]]:
    """(name, payload as the writer takes it, type). Shapes are numpy order (outermost first)."""
    out = []
    out.append(("token_embd.weight", rng.normal(size=(7, 64)).astype(np.float32), QT.F32))
    out.append(("blk.0.attn_norm.weight", rng.normal(size=(64,)).astype(np.float32), QT.F32))
    out.append(("blk.0.attn_q.weight", rng.normal(size=(48, 64)).astype(np.float16), QT.F16))
    out.append(
        (
            "blk.0.ffn_up_exps.weight",
            gguf.quants.quantize(rng.normal(size=(3, 5, 64)).astype(np.float32), QT.Q8_0),
            QT.Q8_0,
        )
    )
    out.append(
        (
            "blk.0.ffn_gate_exps.weight",
            gguf.quants.quantize(rng.normal(size=(3, 5, 64)).astype(np.float32), QT.Q4_0),
            QT.Q4_0,
        )
    )
    out.append(
        (
            "blk.0.ffn_down_exps.weight",
            gguf.quants.quantize(rng.normal(size=(2, 3, 4, 32)).astype(np.float32), QT.BF16),
            QT.BF16,
        )
    )
    # K-quant blocks: any bytes are a valid block for the reader (it never interprets them).
    out.append(("blk.1.ffn_down.weight", rng.integers(0, 256, size=(6, 2 * 144), dtype=np.uint8), QT.Q4_K))
    out.append(("blk.1.ffn_up.weight", rng.integers(0, 256, size=(3, 210), dtype=np.uint8), QT.Q6_K))
    return out


def _write_with_gguf_writer(path, metadata, tensors, alignment=None):
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, value, vt, sub in metadata:
        if vt == VT.ARRAY and sub is None:
            w.add_array(key, value)  # nested: let the writer infer
        else:
            w.add_key_value(key, value, vt, sub_type=sub)
    for name, payload, qt in tensors:
        if qt in (QT.F32, QT.F16):
            w.add_tensor(name, payload)
        else:
            w.add_tensor(name, payload, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _expected_py(value, vt, sub):
    """The value as GgufFile.metadata() must return it (numeric arrays as numpy arrays)."""
    if vt != VT.ARRAY:
        return value
    if sub is None:  # nested
        return [
            list(inner) if isinstance(inner[0], str) else np.asarray(inner, dtype=np.int32) for inner in value
        ]
    if sub == VT.STRING:
        return list(value)
    return np.asarray(value, dtype=NUMPY_OF[sub])


def _assert_same_value(got, want, key):
    if isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray), key
        assert got.dtype == want.dtype, (key, got.dtype, want.dtype)
        np.testing.assert_array_equal(got, want, err_msg=key)
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), key
        for g, w in zip(got, want):
            _assert_same_value(g, w, key)
    else:
        assert type(got) is type(want) and got == want, (key, got, want)


def _compare_with_reader(path, metadata, tensors, want_version):
    f = _core.GgufFile(path)
    r = gguf.GGUFReader(path)
    assert f.version == want_version
    assert f.file_size == os.path.getsize(path)
    assert f.alignment == r.alignment
    assert f.data_offset == r.data_offset

    got = f.metadata()
    types = f.metadata_types()
    reader_keys = [k for k in r.fields if not k.startswith("GGUF.")]
    assert list(got) == reader_keys  # same keys, same (file) order
    for key, value, vt, sub in metadata:
        _assert_same_value(got[key], _expected_py(value, vt, sub), key)
        field = r.fields[key]
        assert VT(field.types[0]) == vt
        if vt != VT.ARRAY:
            assert types[key] == vt.name.lower()
            assert got[key] == field.contents(), key
        elif sub is not None:
            assert types[key] == f"array[{sub.name.lower()}]"
            want = field.contents()
            got_list = got[key] if isinstance(got[key], list) else got[key].tolist()
            assert got_list == want, key
        else:
            assert types[key] == "array[array]"

    by_name = {t["name"]: t for t in f.tensors()}
    assert [t.name for t in r.tensors] == [t["name"] for t in f.tensors()]
    for rt in r.tensors:
        t = by_name[rt.name]
        assert t["type"] == int(rt.tensor_type)
        assert t["type_name"] == _core_type_name(rt.tensor_type)
        assert t["shape"] == [int(x) for x in rt.shape]  # GGUFReader.shape is ggml order (ne[0] first)
        assert t["n_elements"] == int(rt.n_elements)
        assert t["nbytes"] == int(rt.n_bytes)
        assert t["file_offset"] == int(rt.data_offset)
        assert t["offset"] == int(rt.data_offset) - r.data_offset
        assert t["offset"] % f.alignment == 0
        want_bytes = np.asarray(rt.data).view(np.uint8).reshape(-1)
        np.testing.assert_array_equal(f.tensor_bytes(rt.name), want_bytes)
        np.testing.assert_array_equal(f.tensor_bytes(rt.name, copy=False), want_bytes)
    # And the bytes are what was written, not just what GGUFReader thinks.
    for name, payload, _ in tensors:
        np.testing.assert_array_equal(
            f.tensor_bytes(name), np.ascontiguousarray(payload).view(np.uint8).reshape(-1)
        )
    return f


def _core_type_name(qt: QT) -> str:
    # ggml spells the K-quants with a capital K ("q4_K"); everything else is lower case.
    name = qt.name.lower()
    return name[:-1] + "K" if name.endswith("_k") else name


@pytest.mark.parametrize("alignment", [None, 64, 1024])
def test_reader_matches_gguf_reader_v3(tmp_path, alignment):
    rng = np.random.default_rng(1000 + (alignment or 0))
    metadata, tensors = _random_metadata(rng), _random_tensors(rng)
    path = tmp_path / "m.gguf"
    _write_with_gguf_writer(path, metadata, tensors, alignment)
    f = _compare_with_reader(str(path), metadata, tensors, want_version=3)
    assert f.alignment == (alignment or 32)
    assert (
        f.metadata().get("general.alignment") == alignment
        if alignment
        else "general.alignment" not in f.metadata()
    )


def test_reader_matches_gguf_reader_v2(tmp_path):
    """GGUF v2 and v3 little-endian files share one layout (v3 only introduced big-endian files, which
    are detected by the version bytes), so a v2 file is a v3 file with version = 2."""
    rng = np.random.default_rng(2002)
    metadata, tensors = _random_metadata(rng), _random_tensors(rng)
    path = tmp_path / "v2.gguf"
    _write_with_gguf_writer(path, metadata, tensors, 128)
    blob = bytearray(path.read_bytes())
    assert struct.unpack_from("<I", blob, 4)[0] == 3
    struct.pack_into("<I", blob, 4, 2)
    path.write_bytes(bytes(blob))
    _compare_with_reader(str(path), metadata, tensors, want_version=2)


def test_unmapped_open_reads_the_same_bytes(tmp_path):
    rng = np.random.default_rng(7)
    metadata, tensors = _random_metadata(rng)[:4], _random_tensors(rng)
    path = tmp_path / "m.gguf"
    _write_with_gguf_writer(path, metadata, tensors)
    mapped, unmapped = _core.GgufFile(path), _core.GgufFile(str(path), map_data=False)
    assert mapped.is_mapped and not unmapped.is_mapped
    for t in mapped.tensors():
        np.testing.assert_array_equal(unmapped.tensor_bytes(t["name"]), mapped.tensor_bytes(t["name"]))
    with pytest.raises(_core.MissingTensorError, match="no tensor named 'nope'"):
        mapped.tensor_bytes("nope")


def test_view_keeps_file_alive_and_is_read_only(tmp_path):
    rng = np.random.default_rng(8)
    path = tmp_path / "m.gguf"
    tensors = _random_tensors(rng)
    _write_with_gguf_writer(path, [], tensors)
    f = _core.GgufFile(path)
    view = f.tensor_bytes("token_embd.weight", copy=False)
    del f
    np.testing.assert_array_equal(view.view(np.float32).reshape(7, 64), tensors[0][1])
    with pytest.raises(ValueError):
        view[0] = 1


def test_raw_builder_agrees_with_gguf_reader(tmp_path):
    """The byte-level builder used for the bad-input tests writes files GGUFReader reads back exactly,
    including an empty array (which GGUFWriter refuses to write)."""
    rng = np.random.default_rng(3)
    payload = rng.normal(size=(4, 32)).astype(np.float32)
    kvs = [
        pack_kv("general.architecture", STRING, "llama"),
        pack_kv("a.u8", UINT8, 200),
        pack_kv("a.i8", INT8, -100),
        pack_kv("a.u16", UINT16, 60000),
        pack_kv("a.i16", INT16, -30000),
        pack_kv("a.u32", UINT32, 4_000_000_000),
        pack_kv("a.i32", INT32, -2_000_000_000),
        pack_kv("a.u64", UINT64, 2**63 + 5),
        pack_kv("a.i64", INT64, -(2**62)),
        pack_kv("a.f32", FLOAT32, 0.25),
        pack_kv("a.f64", FLOAT64, -1e300),
        pack_kv("a.bool", BOOL, True),
        pack_kv("a.empty", ARRAY, [], UINT32),
        pack_kv("a.nested", ARRAY, [(STRING, ["p", "q"]), (FLOAT32, [1.5])], ARRAY),
    ]
    raw = build_gguf(kvs, [RawTensor("w", [32, 4], int(QT.F32), payload.tobytes())], alignment=32)
    path = tmp_path / "raw.gguf"
    path.write_bytes(raw.data)
    r = gguf.GGUFReader(str(path))
    f = _core.GgufFile(path)
    md = f.metadata()
    for key in [
        "a.u8",
        "a.i8",
        "a.u16",
        "a.i16",
        "a.u32",
        "a.i32",
        "a.u64",
        "a.i64",
        "a.f32",
        "a.f64",
        "a.bool",
    ]:
        assert md[key] == r.fields[key].contents(), key
    assert md["a.empty"].dtype == np.uint32 and md["a.empty"].size == 0
    assert r.fields["a.empty"].contents() == []
    assert md["a.nested"][0] == ["p", "q"]
    np.testing.assert_array_equal(md["a.nested"][1], np.array([1.5], dtype=np.float32))
    assert f.data_offset == r.data_offset == raw.data_start
    np.testing.assert_array_equal(f.tensor_bytes("w").view(np.float32), payload.reshape(-1))
    assert r.tensors[0].data_offset == raw.data_start


# --------------------------------------------------------------------------------------------------
# Bad files: each must raise the typed error that names the fault
# --------------------------------------------------------------------------------------------------


def _base_file(**kw):
    """A small valid file: 3 metadata entries and 2 tensors."""
    kvs = kw.pop("kvs", None) or [
        pack_kv("general.architecture", STRING, "qwen3moe"),
        pack_kv("qwen3moe.block_count", UINT32, 1),
        pack_kv("tokenizer.ggml.tokens", ARRAY, ["a", "b", "c"], STRING),
    ]
    tensors = kw.pop("tensors", None) or [
        RawTensor("blk.0.attn_q.weight", [32, 2], int(QT.F32), bytes(range(256))),
        RawTensor("blk.3.ffn_up_exps.weight", [32, 2, 2], int(QT.Q8_0), bytes(4 * 34)),
    ]
    return build_gguf(kvs, tensors, **kw)


def _open_bytes(tmp_path, blob: bytes, name="bad.gguf"):
    path = tmp_path / name
    path.write_bytes(blob)
    return _core.GgufFile(path)


def test_base_file_is_valid(tmp_path):
    f = _open_bytes(tmp_path, _base_file().data)
    assert [t["name"] for t in f.tensors()] == ["blk.0.attn_q.weight", "blk.3.ffn_up_exps.weight"]


def test_bad_magic(tmp_path):
    with pytest.raises(_core.FormatError, match="bad magic.*not a GGUF file"):
        _open_bytes(tmp_path, _base_file(magic=b"GGML").data)


def test_version_1_is_unsupported(tmp_path):
    with pytest.raises(_core.UnsupportedError, match="version 1 is not supported"):
        _open_bytes(tmp_path, _base_file(version=1).data)


@pytest.mark.parametrize(
    "version, message",
    [(0, "unknown GGUF version 0"), (4, "unknown GGUF version 4"), (0x03000000, "big-endian")],
)
def test_other_versions_are_unsupported(tmp_path, version, message):
    with pytest.raises(_core.UnsupportedError, match=message):
        _open_bytes(tmp_path, _base_file(version=version).data)


@pytest.mark.parametrize("size", [0, 3, 10, 23])
def test_truncated_header(tmp_path, size):
    with pytest.raises(_core.FormatError, match="truncated header"):
        _open_bytes(tmp_path, _base_file().data[:size])


def test_truncated_metadata(tmp_path):
    raw = _base_file()
    cut = raw.kv_start + (raw.ti_start - raw.kv_start) // 2
    with pytest.raises(_core.FormatError, match=r"truncated metadata at offset 0x[0-9a-f]+ \(key \d of 3"):
        _open_bytes(tmp_path, raw.data[:cut])


def test_truncated_tensor_directory(tmp_path):
    raw = _base_file()
    with pytest.raises(_core.FormatError, match=r"truncated tensor directory .*tensor 1 of 2"):
        _open_bytes(tmp_path, raw.data[: raw.data_start - 10])


def test_truncated_tensor_data(tmp_path):
    raw = _base_file()
    with pytest.raises(
        _core.FormatError,
        match=r"tensor blk\.3\.ffn_up_exps\.weight: data \[0x[0-9a-f]+, 0x[0-9a-f]+\) "
        r"beyond end of file \(size \d+\)",
    ):
        _open_bytes(tmp_path, raw.data[:-5])


def _with_directory_entry(ne, ggml_type, offset, name="t", tail=64):
    """A file whose only tensor has the given directory entry (the data section is `tail` zero bytes)."""
    raw = _base_file(tensors=[RawTensor(name, [32], int(QT.F32), bytes(128))])
    return raw.data[: raw.ti_start] + pack_tensor_info(name, ne, ggml_type, offset) + b"\0" * tail


def test_tensor_out_of_bounds(tmp_path):
    blob = _with_directory_entry([32, 2], int(QT.F32), 1 << 40, name="blk.0.attn_q.weight")
    with pytest.raises(
        _core.FormatError, match=r"blk.0.attn_q.weight: data \[0x[0-9a-f]+, 0x[0-9a-f]+\) beyond end of file"
    ):
        _open_bytes(tmp_path, blob)


def test_tensor_offset_overflow(tmp_path):
    blob = _with_directory_entry([32], int(QT.F32), 2**64 - 32)
    with pytest.raises(_core.FormatError, match="tensor t: data .* beyond end of file"):
        _open_bytes(tmp_path, blob)


def test_unknown_tensor_type_id(tmp_path):
    tensors = [RawTensor("blk.0.attn_q.weight", [32, 2], 99, bytes(256))]
    with pytest.raises(_core.UnsupportedError, match="tensor blk.0.attn_q.weight has unknown type id 99"):
        _open_bytes(tmp_path, _base_file(tensors=tensors).data)


@pytest.mark.parametrize("field", ["n_kv", "n_tensors"])
def test_absurd_counts(tmp_path, field):
    with pytest.raises(_core.FormatError, match="count 1152921504606846976 cannot fit"):
        _open_bytes(tmp_path, _base_file(**{field: 2**60}).data)


def test_absurd_array_count(tmp_path):
    blob = pack_string("tokenizer.ggml.tokens") + struct.pack("<IIQ", ARRAY, STRING, 2**60)
    with pytest.raises(_core.FormatError, match="array of 1152921504606846976 string elements cannot fit"):
        _open_bytes(tmp_path, _base_file(kvs=[blob]).data)


def test_absurd_string_length(tmp_path):
    blob = pack_string("general.name") + struct.pack("<I", STRING) + struct.pack("<Q", 2**62) + b"abc"
    with pytest.raises(_core.FormatError, match="string value length 4611686018427387904 exceeds"):
        _open_bytes(tmp_path, _base_file(kvs=[blob]).data)


def test_absurd_key_length(tmp_path):
    blob = pack_string("general.name", length=2**63) + struct.pack("<I", UINT8) + b"\0"
    with pytest.raises(_core.FormatError, match="key length 9223372036854775808 exceeds"):
        _open_bytes(tmp_path, _base_file(kvs=[blob]).data)


@pytest.mark.parametrize("alignment", [0, 48, 3])
def test_bad_alignment(tmp_path, alignment):
    kvs = [pack_kv("general.alignment", UINT32, alignment)]
    with pytest.raises(_core.FormatError, match=f"general.alignment = {alignment} is not a power of two"):
        _open_bytes(tmp_path, _base_file(kvs=kvs).data)


def test_alignment_of_wrong_type(tmp_path):
    kvs = [pack_kv("general.alignment", STRING, "32")]
    with pytest.raises(_core.FormatError, match="general.alignment has type string"):
        _open_bytes(tmp_path, _base_file(kvs=kvs).data)


def test_misaligned_tensor_offset(tmp_path):
    tensors = [RawTensor("t", [32], int(QT.F32), bytes(128), offset=16)]
    with pytest.raises(
        _core.FormatError, match="tensor t: data offset 0x10 is not a multiple of the alignment 32"
    ):
        _open_bytes(tmp_path, _base_file(tensors=tensors).data)


def test_duplicate_key(tmp_path):
    kvs = [pack_kv("general.architecture", STRING, "llama"), pack_kv("general.architecture", STRING, "qwen2")]
    with pytest.raises(_core.FormatError, match="duplicate metadata key 'general.architecture'"):
        _open_bytes(tmp_path, _base_file(kvs=kvs).data)


def test_duplicate_tensor_name(tmp_path):
    tensors = [RawTensor("w", [32], int(QT.F32), bytes(128)), RawTensor("w", [32], int(QT.F32), bytes(128))]
    with pytest.raises(_core.FormatError, match="duplicate tensor name 'w'"):
        _open_bytes(tmp_path, _base_file(tensors=tensors).data)


def test_overlapping_tensors(tmp_path):
    tensors = [
        RawTensor("a", [64], int(QT.F32), bytes(256), offset=0),
        RawTensor("b", [32], int(QT.F32), bytes(128), offset=128),
    ]
    with pytest.raises(_core.FormatError, match="tensor b: data at 0x[0-9a-f]+ overlaps tensor a"):
        _open_bytes(tmp_path, _base_file(tensors=tensors).data)


@pytest.mark.parametrize(
    "ne, message",
    [
        ([32, 1, 1, 1, 1], "n_dims = 5"),
        ([32, 0], "dimension 1 = 0 is not positive"),
        ([2**62, 2**62], "element count overflows"),
        ([2**63, 1], "dimension 0 = 9223372036854775808 is not positive"),
        ([33], "row length 33 is not a multiple of the q8_0 block size 32"),
    ],
)
def test_bad_dimensions(tmp_path, ne, message):
    ggml_type = int(QT.Q8_0) if ne == [33] else int(QT.F32)
    with pytest.raises(_core.FormatError, match=message):
        _open_bytes(tmp_path, _with_directory_entry(ne, ggml_type, 0, tail=4096))


def test_byte_size_overflow(tmp_path):
    blob = _with_directory_entry([2**40, 2**22], int(QT.F32), 0)  # 2^62 elements of 4 bytes
    with pytest.raises(_core.FormatError, match="tensor t: byte size overflows"):
        _open_bytes(tmp_path, blob)


def test_unknown_value_type(tmp_path):
    blob = pack_string("x.y") + struct.pack("<I", 42) + b"\0" * 16
    with pytest.raises(
        _core.FormatError,
        match=r"metadata at offset 0x[0-9a-f]+ \(key 0 of 1, 'x.y'\): unknown value type 42",
    ):
        _open_bytes(tmp_path, _base_file(kvs=[blob]).data)


def test_arrays_nested_too_deep(tmp_path):
    value = (UINT8, [1])
    for _ in range(12):
        value = (ARRAY, [value])
    blob = pack_string("deep") + struct.pack("<I", ARRAY) + pack_value(ARRAY, value[1], value[0])
    with pytest.raises(_core.FormatError, match="nested deeper than"):
        _open_bytes(tmp_path, _base_file(kvs=[blob]).data)


def test_io_errors(tmp_path):
    with pytest.raises(_core.IoError, match="cannot open: No such file or directory"):
        _core.GgufFile(tmp_path / "missing.gguf")
    with pytest.raises(_core.IoError, match="not a regular file"):
        _core.GgufFile(tmp_path)


def test_typed_errors_share_the_sharpi_base():
    assert issubclass(_core.FormatError, _core.SharpiError)
    assert issubclass(_core.UnsupportedError, _core.SharpiError)
    assert issubclass(_core.IoError, _core.SharpiError)


def test_fuzzed_files_never_crash(tmp_path):
    """Random truncations, byte flips and overwritten length fields of a valid file: every outcome is
    either a clean open or a typed sharpi error (a crash would take the test process down)."""
    rng = np.random.default_rng(4242)
    kvs = [
        pack_kv("general.architecture", STRING, "llama"),
        pack_kv("general.alignment", UINT32, 64),
        pack_kv("tokenizer.ggml.tokens", ARRAY, [f"tok{i}" for i in range(20)], STRING),
        pack_kv("tokenizer.ggml.scores", ARRAY, [0.5] * 20, FLOAT32),
        pack_kv("x.nested", ARRAY, [(INT32, [1, 2]), (STRING, ["s"])], ARRAY),
    ]
    tensors = [RawTensor(f"blk.{i}.w", [64, 2], int(QT.F32), bytes(512)) for i in range(3)]
    good = build_gguf(kvs, tensors, alignment=64).data
    path = tmp_path / "fuzz.gguf"
    outcomes = {"ok": 0, "error": 0}
    for trial in range(600):
        blob = bytearray(good)
        kind = trial % 3
        if kind == 0:
            blob = blob[: int(rng.integers(0, len(good)))]
        elif kind == 1:
            for _ in range(int(rng.integers(1, 6))):
                blob[int(rng.integers(0, len(blob)))] = int(rng.integers(0, 256))
        else:  # plant a huge or random 64-bit value somewhere in the header
            pos = int(rng.integers(4, good.find(b"blk.0.w") + 40))
            struct.pack_into(
                "<Q",
                blob,
                min(pos, len(blob) - 8),
                int(rng.choice([2**63 - 1, 2**32, 2**60, int(rng.integers(0, 2**62))])),
            )
        path.write_bytes(bytes(blob))
        try:
            f = _core.GgufFile(path)
            f.metadata()
            for t in f.tensors():
                f.tensor_bytes(t["name"], copy=False)
            outcomes["ok"] += 1
        except _core.SharpiError:
            outcomes["error"] += 1
    assert outcomes["error"] > 200 and outcomes["ok"] > 5, outcomes


# --------------------------------------------------------------------------------------------------
# Helpers other components use: expert byte ranges, per-layer keys
# --------------------------------------------------------------------------------------------------


def test_expert_range_matches_numpy_slices(tmp_path):
    """Expert e of ffn_*_exps (numpy shape [n_expert, out, in]) is exactly the bytes of payload[e]."""
    rng = np.random.default_rng(55)
    n_expert = 5
    gate = gguf.quants.quantize(rng.normal(size=(n_expert, 3, 64)).astype(np.float32), QT.Q8_0)
    down = rng.normal(size=(n_expert, 64, 3)).astype(np.float32)
    path = tmp_path / "e.gguf"
    _write_with_gguf_writer(
        path,
        [],
        [
            ("blk.0.ffn_gate_exps.weight", gate, QT.Q8_0),
            ("blk.0.ffn_down_exps.weight", down, QT.F32),
            ("blk.0.attn_q.weight", down[0], QT.F32),
        ],
    )
    f = _core.GgufFile(path)
    blob = path.read_bytes()
    for name, payload in [("blk.0.ffn_gate_exps.weight", gate), ("blk.0.ffn_down_exps.weight", down)]:
        for e in range(n_expert):
            off, n = f.expert_range(name, e)
            assert blob[off : off + n] == np.ascontiguousarray(payload[e]).tobytes(), (name, e)
    with pytest.raises(_core.InvalidArgument, match=r"expert 5 out of range \[0, 5\)"):
        f.expert_range("blk.0.ffn_gate_exps.weight", 5)
    with pytest.raises(_core.InvalidArgument, match="has 2 dimensions"):
        f.expert_range("blk.0.attn_q.weight", 0)
    with pytest.raises(_core.MissingTensorError):
        f.expert_range("blk.9.ffn_gate_exps.weight", 0)


def test_get_uint_per_layer(tmp_path):
    kvs = [
        pack_kv("a.scalar", UINT32, 768),
        pack_kv("a.array", ARRAY, [1, 2, 3], INT32),
        pack_kv("a.floats", ARRAY, [1.0, 2.0, 3.0], FLOAT32),
        pack_kv("a.negative", ARRAY, [1, -2, 3], INT32),
    ]
    f = _open_bytes(tmp_path, build_gguf(kvs, []).data)
    assert f.get_uint_per_layer("a.scalar", 3) == [768, 768, 768]
    assert f.get_uint_per_layer("a.array", 3) == [1, 2, 3]
    assert f.get_uint_per_layer("a.absent", 2, 7) == [7, 7]
    with pytest.raises(_core.FormatError, match="'a.array' has 3 values, expected one per layer \\(4\\)"):
        f.get_uint_per_layer("a.array", 4)
    with pytest.raises(_core.FormatError, match="array of float32, expected integers"):
        f.get_uint_per_layer("a.floats", 3)
    with pytest.raises(_core.FormatError, match="negative"):
        f.get_uint_per_layer("a.negative", 3)
