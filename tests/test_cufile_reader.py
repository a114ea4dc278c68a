"""The cuFile reader's probe and fallback (cpp/src/io/cufile_probe.h, io/reader_factory.cpp) on the host.

cuFile needs a CUDA device and libcufile (dlopen'ed only when present). Without them `--reader auto`
falls back (io_uring, else pread) and says why in `sharpi inspect` and the stats; `--reader cufile` is
an UnsupportedError with the same reason. Without a device the reason is only that (no libcufile hint:
there is nothing to use it with). The probe's library lookup is checked with a stand-in library built
here that exports the two symbols the probe asks for, and with a path that does not exist.
"""

import shutil
import subprocess

import pytest
import sharpi
from sharpi import UnsupportedError, _internal
from test_session import models  # noqa: F401  (fixture: tiny files of every plain MoE arch)


@pytest.fixture
def no_library(monkeypatch, tmp_path):
    missing = str(tmp_path / "libcufile-missing.so")
    monkeypatch.setenv("SHARPI_CUFILE_LIB", missing)
    return missing


@pytest.fixture
def stand_in_library(monkeypatch, tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in libcufile")
    src = tmp_path / "cufile_stand_in.c"
    src.write_text("int cuFileDriverOpen(void) { return 0; }\nlong cuFileRead(void) { return -1; }\n")
    lib = tmp_path / "libcufile_stand_in.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    monkeypatch.setenv("SHARPI_CUFILE_LIB", str(lib))
    return str(lib)


def test_probe_says_what_is_missing(no_library):
    probe = _internal.cufile_probe()
    assert not probe["usable"] and probe["library"] == ""
    if sharpi.cuda_available():
        assert f"libcufile not found ({no_library}" in probe["why"]
    else:  # the device is all that is said to be missing
        assert probe["why"] == sharpi.cuda_describe()
        assert "libcufile" not in probe["why"] and "pip install" not in probe["why"]


def test_stand_in_library_is_found_and_only_the_device_is_missing(stand_in_library):
    probe = _internal.cufile_probe()
    assert probe["library"] == stand_in_library
    assert "libcufile not found" not in probe["why"]
    if not sharpi.cuda_available():
        assert not probe["usable"] and probe["why"] == sharpi.cuda_describe()


def test_reader_cufile_is_a_typed_error_saying_why(models, no_library):  # noqa: F811
    path = models["qwen3moe", "f32"]
    why = "libcufile not found" if sharpi.cuda_available() else "no CUDA device"
    with pytest.raises(UnsupportedError, match=rf"cuFile reader unavailable: .*{why}"):
        sharpi.Session(path, ram_budget="64MiB", reader="cufile")


def test_reader_auto_falls_back_and_the_stats_say_why(models, no_library):  # noqa: F811
    path = models["qwen3moe", "f32"]
    s = sharpi.Session(path, ram_budget="64MiB", reader="auto")
    s.generate([1, 2, 3], max_tokens=2)
    st = s.expert_stats()
    assert st["reader"] in ("io_uring", "pread")
    if sharpi.cuda_available():
        assert st["reader_note"].startswith("cuFile unavailable: ") and "libcufile not found" in st["reader_note"]
    else:
        assert st["reader_note"] == "cuFile unavailable: " + sharpi.cuda_describe()


def test_inspect_names_the_reader_and_why(models, no_library, capsys):  # noqa: F811
    from sharpi import cli

    assert cli.main(["inspect", models["qwen3moe", "f32"]]) == 0
    out = capsys.readouterr().out.splitlines()
    line = next(ln for ln in out if ln.startswith("cuFile reader (--reader cufile)"))
    if sharpi.cuda_available():
        assert "unavailable: " in line and "libcufile not found" in line
    else:
        assert line == "cuFile reader (--reader cufile): unavailable: needs a CUDA device"
