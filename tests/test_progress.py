"""Progress bars (sharpi.progress, issue 20): on stderr only, on a terminal or when forced, and never
a change to what a command prints on stdout.

Oracles: the same command run with bars forced on and off must print the same bytes on stdout (and
write the same file), and the forced run's stderr must hold tqdm's bar for the step, counted to the
end: the file's tensor bytes for make-model, both prompts for trace. Bars are forced through the
documented SHARPI_PROGRESS=1; the one-second delay before a bar shows is set to 0 in the child so a
tiny model's steps show theirs.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from sharpi import progress
from subprocess_env import child_env

# `python -m sharpi.cli ARGS` with every bar shown from its first moment.
NO_DELAY_CLI = "import sys, sharpi.progress as p; p.SHOW_AFTER_S = 0; from sharpi.cli import main; sys.exit(main())"


class Stream:
    def __init__(self, tty: bool):
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize(("env", "tty", "want"), [
    (None, True, True), (None, False, False), ("1", False, True), ("0", True, False), ("", True, True),
])
def test_enabled_on_a_terminal_unless_forced(monkeypatch, env, tty, want):
    if env is None:
        monkeypatch.delenv("SHARPI_PROGRESS", raising=False)
    else:
        monkeypatch.setenv("SHARPI_PROGRESS", env)
    monkeypatch.setattr(sys, "stderr", Stream(tty))
    assert progress.enabled() is want


def test_disabled_bar_iterates_and_writes_nothing(monkeypatch, capsys):
    monkeypatch.setenv("SHARPI_PROGRESS", "0")
    with progress.bar(desc="x", total=3) as b:
        b.update(3)
    assert list(progress.bar(range(4), desc="y")) == [0, 1, 2, 3]
    with progress.loading("model.gguf"):
        pass
    assert capsys.readouterr() == ("", "")


def cli(bars: bool, *args: str) -> subprocess.CompletedProcess:
    env = child_env()
    env["SHARPI_PROGRESS"] = "1" if bars else "0"
    return subprocess.run([sys.executable, "-c", NO_DELAY_CLI, *args], check=False, capture_output=True,
                          text=True, encoding="utf-8", env=env, timeout=300)


def test_cli_bars_go_to_stderr_and_leave_stdout_alone(tmp_path):
    model = tmp_path / "tiny.gguf"
    runs = {}
    for bars in (True, False):
        made = cli(bars, "make-model", "--preset", "tiny", "--quant", "q8_0", "--seed", "3", str(model))
        assert made.returncode == 0, made.stderr
        runs[bars] = (made, model.read_bytes())
    (on, file_on), (off, file_off) = runs[True], runs[False]
    assert on.stdout == off.stdout and file_on == file_off
    assert off.stderr == ""
    from sharpi.make_model import plan_tensors
    from sharpi.presets import resolve

    tensor_bytes = sum(s.nbytes for s in plan_tensors(resolve(None, "tiny"), "q8_0", False))
    # tqdm's closing state of the byte bar: 100%, all of the tensor bytes counted (binary units).
    from tqdm import tqdm

    size = tqdm.format_sizeof(tensor_bytes, divisor=1024)
    assert "writing tiny.gguf: 100%" in on.stderr and f"{size}/{size}" in on.stderr, on.stderr

    generate = ("run", "-m", str(model), "-p", "def add(a, b):", "-n", "6", "--temp", "0", "-t", "1")
    on, off = cli(True, *generate), cli(False, *generate)
    assert on.returncode == off.returncode == 0, on.stderr + off.stderr
    assert on.stdout == off.stdout and on.stdout.strip()
    assert "loading tiny.gguf" in on.stderr and "loading tiny.gguf" not in off.stderr

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\nimport os\n")
    for bars in (True, False):
        traced = cli(bars, "trace", "-m", str(model), "--prompts", str(prompts), "-o", str(tmp_path / f"{bars}.npz"))
        assert traced.returncode == 0, traced.stderr
        assert traced.stdout == ""
        assert ("prompts: 100%" in traced.stderr and "2/2" in traced.stderr) is bars, traced.stderr
