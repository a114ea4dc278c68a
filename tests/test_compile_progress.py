"""cmake/compile_progress.sh, the compiler launcher that `pip install .` runs every compile through:
it must never change a compile's outcome, output or arguments, with a terminal or without one.

A compile that failed only because the launcher could not open /dev/tty (dash exits on a failed
redirection of ':') once broke every CI build; these tests run it as CI and as a user's terminal do.
"""

import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

LAUNCHER = Path(__file__).resolve().parent.parent / "cmake" / "compile_progress.sh"
COMPILER = ["sh", "-c", 'printf "%s|" "$@"; echo out; echo err >&2; exit 7', "cc", "-O2", "-c", "dir/x y.cpp", "-o", "x.o"]


def launch(counter: Path, total: int, *, terminal: bool) -> subprocess.CompletedProcess:
    command = ["sh", str(LAUNCHER), str(counter), str(total), *COMPILER]
    if terminal:
        # script(1) gives the launcher a controlling terminal, as pip's user has; what the terminal
        # shows comes back on script's stdout.
        command = ["script", "-qec", shlex.join(command), "/dev/null"]
    else:
        # setsid: a new session has no controlling terminal, as CI and a redirected pip have none.
        command = ["setsid", "-w", *command]
    return subprocess.run(command, check=False, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)


def test_without_a_terminal_the_compile_is_untouched(tmp_path):
    counter = tmp_path / "count"
    counter.write_text("")
    done = launch(counter, 5, terminal=False)
    assert done.returncode == 7
    assert done.stdout == "-O2|-c|dir/x y.cpp|-o|x.o|out\n"
    assert done.stderr == "err\n"
    assert counter.read_text() == "", "nothing is counted where nothing is shown"


@pytest.mark.skipif(shutil.which("script") is None, reason="util-linux script(1) is not installed")
def test_on_a_terminal_each_compile_is_announced_below_the_spinner(tmp_path):
    counter = tmp_path / "count"
    counter.write_text("")
    first = launch(counter, 3, terminal=True)
    assert first.returncode == 7
    assert "-O2|-c|dir/x y.cpp|-o|x.o|out" in first.stdout and "err" in first.stdout
    assert "sharpi: compiling 1/3 x y.cpp" in first.stdout
    second = launch(counter, 3, terminal=True)
    assert "sharpi: compiling 2/3 x y.cpp" in second.stdout
    last = launch(counter, 3, terminal=True)
    assert "sharpi: compiling" not in last.stdout, "the last compile clears the line for pip"
    assert counter.read_text() == "..."
