"""`-hf REPO[:QUANT]` (issue 14) against a fake Hugging Face Hub on 127.0.0.1 (tests/fake_hub.py),
with HF_ENDPOINT pointed at it and HF_HOME in a temporary directory: no test touches the network.

Covers: a single-file model picked by its quant tag (case-insensitive), a split model (all shards
downloaded; `sharpi inspect -hf` lists them), a repository with one GGUF and no tag, a transfer cut
off mid-file that resumes (the second request carries a Range header and the file ends up intact),
an unknown quant (exit 1 and the quants the repository has), and a second run with the server
stopped that uses the cache (with HF_HUB_OFFLINE=1 and without it). Oracle for "the right model
ran": the same command with -m on the local file prints the same text; for "the right bytes": the
cached files equal the served ones.

Each command runs in a subprocess: huggingface_hub reads HF_ENDPOINT / HF_HOME / HF_HUB_OFFLINE
when it is imported.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("huggingface_hub")

from fake_hub import FakeHub
from gguf_split import split_gguf
from sharpi.make_model import write_model
from subprocess_env import child_env

REPO = "sharpi-test/Tiny-MoE-GGUF"
ONE = "sharpi-test/one-file"
RUN_ARGS = ["-p", "Once upon a time", "-n", "6", "--temp", "0", "-t", "1", "-c", "64"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("hub_models")
    q8 = d / "Tiny-MoE-Q8_0.gguf"
    write_model(str(q8), arch="qwen3moe", preset="tiny", quant="q8_0", seed=21)
    q4 = d / "Tiny-MoE-Q4_K_M.gguf"
    write_model(str(q4), arch="qwen3moe", preset="tiny", quant="q4_k_m", seed=21)
    (d / "split").mkdir()
    shards = split_gguf(q4, d / "split" / "Tiny-MoE-Q4_K_M", 3)
    # The Q8_0 model followed by 24 MiB of zeros (still a valid GGUF: bytes after the last tensor are
    # never read), named as another quant: huggingface_hub writes downloads in 10 MiB chunks, so only a
    # file cut off beyond 10 MiB has a partial download to resume from.
    big = d / "Tiny-MoE-Q6_K.gguf"
    big.write_bytes(q8.read_bytes() + bytes(24 << 20))
    repo_files = {
        "README.md": b"# tiny\n",
        q8.name: q8.read_bytes(),
        big.name: big.read_bytes(),
        **{f"Q4_K_M/{p.name}": p.read_bytes() for p in shards},
        "mmproj-Tiny-F16.gguf": b"not a model",
    }
    return {
        "q8": q8,
        "q4": q4,
        "big": big,
        "shards": shards,
        "repos": {REPO: repo_files, ONE: {"model.gguf": q8.read_bytes()}},
    }


@pytest.fixture
def hub(files):
    server = FakeHub(files["repos"])
    yield server
    server.stop()


def sharpi_cli(args, hf_home, endpoint, offline=False, timeout=300):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_") and k != "HUGGING_FACE_HUB_TOKEN"}
    env = child_env(base=env)
    env.update(
        HF_HOME=str(hf_home),
        HF_ENDPOINT=endpoint,
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_DISABLE_XET="1",
        HF_HUB_DOWNLOAD_TIMEOUT="20",
        HF_HUB_ETAG_TIMEOUT="5",
        NO_PROXY="127.0.0.1,localhost",
        no_proxy="127.0.0.1,localhost",
    )
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "sharpi.cli", *args],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def local_run(path) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "sharpi.cli", "run", "-m", str(path), *RUN_ARGS],
        check=False,
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def snapshot_dir(hf_home: Path, repo: str, hub: FakeHub) -> Path:
    return hf_home / "hub" / ("models--" + repo.replace("/", "--")) / "snapshots" / hub.commits[repo]


def test_single_file_by_quant_tag_then_offline(files, hub, tmp_path):
    hf_home = tmp_path / "hf"
    done = sharpi_cli(["run", "-hf", f"{REPO}:q8_0", *RUN_ARGS], hf_home, hub.url)
    assert done.returncode == 0, done.stderr
    assert done.stdout == local_run(files["q8"])
    cached = snapshot_dir(hf_home, REPO, hub) / files["q8"].name
    assert cached.read_bytes() == files["q8"].read_bytes()
    assert not hub.requests_for("Q4_K_M/Tiny-MoE-Q4_K_M-00001-of-00003.gguf"), "only the chosen model"
    hub.stop()
    # Server gone: with HF_HUB_OFFLINE=1, and without it (the Hub unreachable), the cache serves.
    for offline in (True, False):
        again = sharpi_cli(["run", "-hf", f"{REPO}:Q8_0", *RUN_ARGS], hf_home, hub.url, offline=offline)
        assert again.returncode == 0, again.stderr
        assert again.stdout == done.stdout
    missing = sharpi_cli(["run", "-hf", f"{REPO}:Q4_K_M", *RUN_ARGS], hf_home, hub.url, offline=True)
    assert missing.returncode == 1 and "no GGUF file for quant 'Q4_K_M'" in missing.stderr


def test_split_model_downloads_every_shard(files, hub, tmp_path):
    hf_home = tmp_path / "hf"
    done = sharpi_cli(["inspect", "-hf", f"{REPO}:Q4_K_M"], hf_home, hub.url)
    assert done.returncode == 0, done.stderr
    snap = snapshot_dir(hf_home, REPO, hub)
    for shard in files["shards"]:
        cached = snap / "Q4_K_M" / shard.name
        assert cached.read_bytes() == shard.read_bytes()
        assert str(cached) in done.stdout
    assert "split over 3 files" in done.stdout
    run = sharpi_cli(["run", "-hf", f"{REPO}:Q4_K_M", *RUN_ARGS], hf_home, hub.url)
    assert run.returncode == 0, run.stderr
    assert run.stdout == local_run(files["q4"])
    hub.stop()
    offline = sharpi_cli(["run", "-hf", f"{REPO}:q4_k_m", *RUN_ARGS], hf_home, hub.url)
    assert offline.returncode == 0, offline.stderr
    assert offline.stdout == run.stdout


def test_interrupted_transfer_resumes(files, hub, tmp_path):
    hf_home = tmp_path / "hf"
    name = files["big"].name
    hub.drop_once.add(name)
    done = sharpi_cli(["run", "-hf", f"{REPO}:Q6_K", *RUN_ARGS], hf_home, hub.url)
    assert done.returncode == 0, done.stderr
    gets = hub.requests_for(name)
    assert len(gets) == 2, gets
    assert gets[0][2] is None
    size = len(files["big"].read_bytes())
    assert gets[1][2] is not None and gets[1][2].startswith("bytes="), gets
    resumed_at = int(gets[1][2].split("=")[1].rstrip("-"))
    assert 0 < resumed_at <= size // 2, "resumed from what the first transfer delivered"
    assert (snapshot_dir(hf_home, REPO, hub) / name).read_bytes() == files["big"].read_bytes()
    assert done.stdout == local_run(files["q8"])


def test_unknown_quant_lists_the_quants(hub, tmp_path):
    done = sharpi_cli(["run", "-hf", f"{REPO}:Q5_K_S", *RUN_ARGS], tmp_path / "hf", hub.url)
    assert done.returncode == 1
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("sharpi: error: ") and "no GGUF file for quant 'Q5_K_S'" in line
    assert "Q4_K_M (Tiny-MoE-Q4_K_M-00001-of-00003.gguf, 3 shards)" in line
    assert "Q8_0 (Tiny-MoE-Q8_0.gguf)" in line and "Q6_K (Tiny-MoE-Q6_K.gguf)" in line
    assert "mmproj" not in line
    assert not any(e[1].endswith(".gguf") and e[0] == "GET" for e in hub.log), "nothing downloaded"


def test_one_gguf_needs_no_tag_and_bad_repo(files, hub, tmp_path):
    hf_home = tmp_path / "hf"
    done = sharpi_cli(["run", "-hf", ONE, *RUN_ARGS], hf_home, hub.url)
    assert done.returncode == 0, done.stderr
    assert done.stdout == local_run(files["q8"])
    several = sharpi_cli(["run", "-hf", REPO, *RUN_ARGS], hf_home, hub.url)
    assert several.returncode == 0, several.stderr  # no tag, several models: Q4_K_M, as llama.cpp
    assert several.stdout == local_run(files["q4"])
    absent = sharpi_cli(["run", "-hf", "sharpi-test/nope", *RUN_ARGS], hf_home, hub.url)
    assert absent.returncode == 1 and "sharpi: error: sharpi-test/nope" in absent.stderr
    bad = sharpi_cli(["run", "-hf", "no-slash", *RUN_ARGS], hf_home, hub.url)
    assert bad.returncode == 1 and "expected USER/REPO[:QUANT]" in bad.stderr


def test_quant_tag_matching():
    """The selection rules on their own: whole-word, case-insensitive tags; shards grouped and
    complete; mmproj files ignored; Q4_K_M when no tag is given and there are several models."""
    from sharpi.hub import HubError, parse_spec, select_files

    files = [
        "README.md",
        "M-Q4_K_M.gguf",
        "M-Q4_K_S.gguf",
        "UD-Q2_K_XL/M-UD-Q2_K_XL-00002-of-00002.gguf",
        "UD-Q2_K_XL/M-UD-Q2_K_XL-00001-of-00002.gguf",
        "mmproj-M-f16.gguf",
    ]
    assert parse_spec("u/r:q4_k_m") == ("u/r", "q4_k_m") and parse_spec("u/r") == ("u/r", None)
    assert select_files("u/r", files, "q4_k_s") == ["M-Q4_K_S.gguf"]
    assert select_files("u/r", files, None) == ["M-Q4_K_M.gguf"]
    assert select_files("u/r", files, "ud-q2_k_xl") == [
        "UD-Q2_K_XL/M-UD-Q2_K_XL-00001-of-00002.gguf",
        "UD-Q2_K_XL/M-UD-Q2_K_XL-00002-of-00002.gguf",
    ]
    with pytest.raises(HubError, match="no GGUF file for quant 'Q4_K'"):
        select_files("u/r", files, "Q4_K")  # a prefix of Q4_K_M / Q4_K_S is not a match
    with pytest.raises(HubError, match="no GGUF file for quant 'F16'"):
        select_files("u/r", files, "F16")  # only the mmproj file has it
    with pytest.raises(HubError, match=r"shard\(s\) \[2\] missing"):
        select_files("u/r", ["M-Q8_0-00001-of-00002.gguf"], "Q8_0")
    assert select_files("u/r", ["only.gguf", "x.txt"], None) == ["only.gguf"]


@pytest.mark.parametrize("endpoint", ["closed-port", "http://no-such-host.invalid"])
def test_no_network_fails_fast_with_one_message(endpoint, tmp_path):
    import socket
    import time

    if endpoint == "closed-port":  # a port bound and closed again: nothing listens there
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            endpoint = f"http://127.0.0.1:{s.getsockname()[1]}"
    start = time.monotonic()
    r = sharpi_cli(["inspect", "-hf", "org/absent-GGUF:Q4_K_M"], tmp_path / "hf", endpoint)
    elapsed = time.monotonic() - start
    assert r.returncode == 1, r.stderr
    # The old path slept through ~24 s of retry backoff; the probe answers at once (or gives up after
    # 2 s). The bound leaves room for interpreter start-up on a loaded shared machine (3.1 s seen
    # beside a CI run), not for one backoff round: sleeps do not shrink with load.
    assert elapsed < 12.0, (elapsed, r.stderr)
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("sharpi: error:")]
    expected = (
        "sharpi: error: org/absent-GGUF: offline and not in the Hugging Face cache; run once with network "
        "access (or download the .gguf elsewhere and pass it with -m FILE)"
    )
    assert errors == [expected], r.stderr
    assert "Traceback" not in r.stderr and "retry" not in r.stderr.lower()
