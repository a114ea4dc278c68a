"""Split GGUF (issue 14): a model that llama.cpp's converter wrote as NAME-0000i-of-0000K.gguf shards
(--split-max-tensors) opens from any of its shards, keeps every tensor's bytes, and gives bit for
bit the logits of the single-file conversion of the same model, resident and streamed under a tight
budget with both readers. Broken sets of shards (missing, from another split or model, renamed,
truncated) are FormatErrors naming the file and what is wrong.

Oracles: the single-file conversion by the same converter (tensor bytes, logits), and the `gguf`
package reading each shard file on its own (which tensors each shard holds, the split.* keys).
The converter tests skip without torch/transformers (needed to build the Hugging Face model) or the
converter. The same equalities are also checked, without them, on a sharpi-written Q4_K_M model
(mixed quant types per layer) split by tests/gguf_split.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import sharpi
from reader_policy import uring_unavailable
from reference import hf_export
from reference.engine_checks import greedy_logits
from sharpi import _core
from sharpi.inspect_model import inspect_report, inspect_summary

N_SHARDS = 4
ARCH = "qwen3moe"


def _convert_split(hf_dir: Path, out: Path, converter: Path, max_tensors: int) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{ARCH}-f32"
    existing = sorted(out.glob(f"{stem}-*-of-*.gguf"))
    if not existing:
        hf_export.convert(
            hf_dir, out / f"{stem}.gguf", "f32", converter, ["--split-max-tensors", str(max_tensors)]
        )
        existing = sorted(out.glob(f"{stem}-*-of-*.gguf"))
    return existing


@pytest.fixture(scope="module")
def model(model_dir):
    pytest.importorskip("torch")
    pytest.importorskip("transformers", minversion="5.0")
    try:
        converter = hf_export.converter_dir()
    except hf_export.ConverterUnavailable as error:
        pytest.skip(f"llama.cpp converter unavailable: {error}")
    single = hf_export.prepare(ARCH, model_dir, converter, outtypes=("f32",))
    path = single.gguf["f32"]
    n_tensors = len(_core.GgufFile(path).tensors())
    max_tensors = -(-n_tensors // N_SHARDS)
    shards = _convert_split(single.exported.hf_dir, model_dir / "split-a", converter, max_tensors)
    # The same model split differently into as many shards: "a shard of another split".
    other = _convert_split(single.exported.hf_dir, model_dir / "split-b", converter, max_tensors + 1)
    return SimpleNamespace(single=str(path), shards=[str(p) for p in shards], other=[str(p) for p in other])


def test_converter_wrote_shards_as_expected(model):
    """The facts this module relies on, read with the gguf package: K files named -0000i-of-0000K,
    split.no 0-based, split.count K, split.tensors.count the total, metadata only in shard 1."""
    shards = model.shards
    assert len(shards) == N_SHARDS and len(model.other) == N_SHARDS
    total = 0
    for i, path in enumerate(shards):
        assert path.endswith(f"-{i + 1:05d}-of-{N_SHARDS:05d}.gguf")
        r = gguf.GGUFReader(path)
        assert r.fields["split.no"].contents() == i
        assert r.fields["split.count"].contents() == N_SHARDS
        total += len(r.tensors)
        assert ("general.architecture" in r.fields) == (i == 0)
    assert total == gguf.GGUFReader(shards[0]).fields["split.tensors.count"].contents()
    assert total == len(gguf.GGUFReader(model.single).tensors)


@pytest.mark.parametrize("map_data", [True, False])
def test_any_shard_opens_the_whole_model(model, map_data):
    single = _core.GgufFile(model.single)
    expected_md = single.metadata()
    for opened in model.shards:
        f = _core.GgufFile(opened, map_data=map_data)
        assert f.path == model.shards[0]
        assert [s["path"] for s in f.shards] == model.shards
        assert "4 shards" in repr(f)
        md = f.metadata()
        assert {k for k in md if not k.startswith("split.")} == set(expected_md)
        assert [t["name"] for t in f.tensors()] == [t["name"] for t in single.tensors()]
        for i, path in enumerate(model.shards):
            in_shard = {t.name: t for t in gguf.GGUFReader(path).tensors}
            mine = [t for t in f.tensors() if t["shard"] == i]
            assert [t["name"] for t in mine] == list(in_shard)
            assert f.shards[i]["n_tensors"] == len(mine)
            for t in mine:
                assert t["file_offset"] == int(in_shard[t["name"]].data_offset)
        for t in f.tensors():
            np.testing.assert_array_equal(f.tensor_bytes(t["name"]), single.tensor_bytes(t["name"]))
    experts = [t for t in single.tensors() if "_exps." in t["name"]]
    shard_of = {t["name"]: t["shard"] for t in _core.GgufFile(model.shards[0]).tensors()}
    assert len({shard_of[t["name"]] for t in experts}) >= 2, "experts must span several shards"


def _run(session, prompt, n_decode=12):
    return greedy_logits(session, prompt, n_decode)


def test_split_logits_equal_single_file_resident(model):
    prompt = hf_export.random_prompt(384, 12, seed=5)
    expected = _run(sharpi.Session(model.single, threads=2, n_ctx=64), prompt)
    for opened in (model.shards[0], model.shards[2]):
        got = _run(sharpi.Session(opened, threads=2, n_ctx=64), prompt)
        np.testing.assert_array_equal(got, expected, err_msg=f"resident, opened as {opened}")


@pytest.mark.parametrize("reader", ["pread", "uring"])
def test_split_logits_equal_single_file_streamed(model, reader):
    prompt = hf_export.random_prompt(384, 12, seed=6)
    expected = _run(sharpi.Session(model.single, threads=2, n_ctx=64), prompt)
    probe = sharpi.Session(model.shards[0], threads=1, n_ctx=64, ram_budget="4GiB", reader="pread")
    st = probe.expert_stats()
    fixed, slot, k = st["fixed_bytes"], st["slot_bytes"], probe.info["n_expert_used"]
    for n_slots in (k, k + 1):
        try:
            s = sharpi.Session(
                model.shards[1], threads=2, n_ctx=64, ram_budget=fixed + n_slots * slot, reader=reader
            )
        except (sharpi.UnsupportedError, sharpi.IoError) as error:
            if reader == "uring":
                uring_unavailable(str(error))
            raise
        st = s.expert_stats()
        assert st["n_slots"] == n_slots
        assert st["reader"] == ("io_uring" if reader == "uring" else "pread")
        if reader == "pread":
            assert f"{N_SHARDS} files" in st["reader_detail"]
        got = _run(s, prompt)
        np.testing.assert_array_equal(got, expected, err_msg=f"streamed, {reader}, {n_slots} slots")
        st = s.expert_stats()
        assert sum(layer["evictions"] for layer in st["layers"]) > 0, "the budget must force evictions"


def _copy(paths, where: Path) -> list[Path]:
    where.mkdir(parents=True, exist_ok=True)
    return [Path(shutil.copy(p, where / Path(p).name)) for p in paths]


def test_missing_shard(model, tmp_path):
    shards = _copy(model.shards, tmp_path)
    shards[2].unlink()
    for opened in (shards[0], shards[3]):
        with pytest.raises(sharpi.FormatError, match=rf"{shards[2]}: missing shard 3 of 4"):
            _core.GgufFile(opened)
    with pytest.raises(sharpi.FormatError, match="missing shard 3 of 4"):
        sharpi.Session(str(shards[0]), n_ctx=32)


def test_shard_of_another_split(model, tmp_path):
    shards = _copy(model.shards, tmp_path)
    shutil.copy(model.other[1], shards[1])  # same model and shard count, split elsewhere
    with pytest.raises(sharpi.FormatError, match=r"tensor .* is also in shard .*another model or split"):
        _core.GgufFile(shards[0])


def test_shard_of_another_model(model, tmp_path):
    shards = _copy(model.shards, tmp_path)
    # A shard 2 of 4 of some other model: right name and split.no/count, other tensor total.
    w = gguf.GGUFWriter(str(shards[1]), arch=None)
    w.add_uint16("split.no", 1)
    w.add_uint16("split.count", N_SHARDS)
    w.add_int32("split.tensors.count", 999)
    w.add_tensor("blk.0.foreign.weight", np.zeros(32, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(
        sharpi.FormatError, match=rf"{shards[1]}: shard 2 of 4 says split.tensors.count = 999"
    ):
        _core.GgufFile(shards[0])


def test_renamed_and_renumbered_shards(model, tmp_path):
    shards = _copy(model.shards, tmp_path / "a")
    wrong_count = shards[0].with_name(shards[0].name.replace("-of-00004", "-of-00005"))
    shards[0].rename(wrong_count)
    with pytest.raises(sharpi.FormatError, match="file name says 5 shards, split.count says 4"):
        _core.GgufFile(wrong_count)
    plain = tmp_path / "model.gguf"
    shutil.copy(model.shards[0], plain)
    with pytest.raises(sharpi.FormatError, match=r"does not follow NAME-0000i-of-0000K.gguf"):
        _core.GgufFile(plain)
    shards = _copy(model.shards, tmp_path / "b")
    swapped = shards[1].read_bytes()
    shards[1].write_bytes(shards[2].read_bytes())
    shards[2].write_bytes(swapped)
    with pytest.raises(sharpi.FormatError, match=r"shard 2 of 4 says split.no = 2 \(shard 3\)"):
        _core.GgufFile(shards[0])


def test_truncated_shard(model, tmp_path):
    shards = _copy(model.shards, tmp_path)
    data = shards[3].read_bytes()
    shards[3].write_bytes(data[: len(data) - 1000])
    with pytest.raises(sharpi.FormatError, match=rf"{shards[3]}: tensor .* beyond end of file"):
        _core.GgufFile(shards[1])
    with pytest.raises(sharpi.FormatError, match=rf"{shards[3]}"):
        sharpi.Session(str(shards[0]), n_ctx=32, ram_budget="1GiB", reader="pread")


def test_inspect_lists_the_shards(model):
    s = inspect_summary(model.shards[3])
    assert [x["path"] for x in s["shards"]] == model.shards
    assert s["n_tensors"] == len(_core.GgufFile(model.single).tensors())
    assert sum(x["tensor_bytes"] for x in s["shards"]) == s["tensor_bytes"]
    text = inspect_report(model.shards[3])
    assert f"split over {N_SHARDS} files" in text
    for i, path in enumerate(model.shards):
        assert f"  {i + 1:>3}  {path}" in text
    assert "  shard 4" in text


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    from gguf_split import split_gguf
    from sharpi.make_model import write_model

    d = tmp_path_factory.mktemp("split_written")
    single = d / "olmoe-q4_k_m.gguf"
    write_model(str(single), arch="olmoe", preset="tiny", quant="q4_k_m", seed=5)
    shards = split_gguf(single, d / "olmoe-q4_k_m", 3)
    return SimpleNamespace(single=str(single), shards=[str(p) for p in shards])


@pytest.mark.parametrize("reader", ["resident", "pread", "uring"])
def test_written_split_model_equals_single_file(written, reader):
    f = _core.GgufFile(written.shards[2])
    assert len(f.shards) == 3
    types = {t["type_name"] for t in f.tensors() if "_exps." in t["name"]}
    assert len(types) >= 2, "Q4_K_M mixes expert types: slots must fit the largest over all shards"
    prompt = list(range(3, 15))
    expected = _run(sharpi.Session(written.single, threads=2, n_ctx=64), prompt)
    if reader == "resident":
        got = _run(sharpi.Session(written.shards[0], threads=2, n_ctx=64), prompt)
        np.testing.assert_array_equal(got, expected)
        return
    probe = sharpi.Session(written.shards[0], threads=1, n_ctx=64, ram_budget="4GiB", reader="pread")
    st = probe.expert_stats()
    budget = st["fixed_bytes"] + probe.info["n_expert_used"] * st["slot_bytes"]
    try:
        s = sharpi.Session(written.shards[0], threads=2, n_ctx=64, ram_budget=budget, reader=reader)
    except (sharpi.UnsupportedError, sharpi.IoError) as error:
        if reader == "uring":
            uring_unavailable(str(error))
        raise
    np.testing.assert_array_equal(_run(s, prompt), expected, err_msg=reader)
    assert sum(layer["evictions"] for layer in s.expert_stats()["layers"]) > 0
