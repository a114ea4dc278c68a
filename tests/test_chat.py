"""`sharpi chat` (issue 20) driven through a pseudo-terminal with the shipped model: two turns, /reset,
Ctrl-C in the middle of an answer, Ctrl-D to quit.

Oracle: Session.generate in this process, greedy, on the ChatML prompt of the whole conversation
written out here by hand (the shipped model has no template, so chat falls back to ChatML).
"""

from __future__ import annotations

import os
import pty
import select
import sys
import time

if sys.platform != "win32":
    import termios

import pytest
import sharpi
from sharpi.models import default_model_path
from subprocess_env import child_env

N_CTX = 2048
N_PREDICT = 1000

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="pseudo-terminals are POSIX")


def chatml(messages: list) -> str:
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return turns + "<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def session():
    s = sharpi.Session(default_model_path(), threads=1, n_ctx=N_CTX)
    yield s
    s.close()


def greedy(session, messages: list) -> str:
    session.reset()
    ids = session.tokenize(chatml(messages), special=True)
    return "".join(session.generate(ids, max_tokens=N_PREDICT, temperature=0.0))


class Terminal:
    """The child on a pseudo-terminal; output with the terminal's CRLF turned back into LF."""

    def __init__(self, argv: list):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the pty is its controlling terminal, so ^C is its SIGINT
            os.execvpe(argv[0], argv, child_env())
        self.buf = ""

    def read_until(self, marker: str, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while marker not in self.buf:
            left = deadline - time.monotonic()
            assert left > 0, f"no {marker!r} within {timeout} s; output so far: {self.buf[-2000:]!r}"
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready:
                try:
                    data = os.read(self.fd, 65536)
                except OSError:  # EIO: the child closed the terminal
                    data = b""
                assert data, f"the child ended; output: {self.buf[-2000:]!r}"
                self.buf += data.decode("utf-8", errors="replace").replace("\r\n", "\n")
        out, self.buf = self.buf.split(marker, 1)
        return out

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def answer(self, line: str) -> str:
        """Sends a line; returns the answer printed after its echo, up to the next prompt."""
        self.send(line + "\n")
        self.read_until(line + "\n")
        return self.read_until("\n> ")

    def wait(self, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            try:
                os.read(self.fd, 65536)
            except OSError:
                pass
            time.sleep(0.05)
        os.kill(self.pid, 9)
        pytest.fail("sharpi chat did not quit on Ctrl-D")


def test_chat_turns_reset_and_ctrl_c(session):
    term = Terminal([sys.executable, "-m", "sharpi.cli", "chat", "-n", str(N_PREDICT), "--temp", "0",
                     "-t", "1", "-c", str(N_CTX)])
    term.read_until("> ")

    first = [{"role": "user", "content": "def add(a, b):"}]
    assert term.answer(first[0]["content"]) == greedy(session, first)
    term.send("/reset\n")
    term.read_until("(conversation reset)\n> ")

    # Two turns after the reset: the second sees the first question and answer.
    one = [{"role": "user", "content": "class Stack:"}]
    a1 = term.answer(one[0]["content"])
    assert a1 == greedy(session, one)
    two = [*one, {"role": "assistant", "content": a1}, {"role": "user", "content": "x"}]
    assert term.answer("x") == greedy(session, two)

    # Ctrl-C in the middle of an answer stops it; the session keeps the partial answer, exactly the
    # text shown, and goes on. Stopped at three depths into the answer, since what can go wrong
    # (Ctrl-C landing between showing a piece and keeping it) depends on the moment.
    question = [{"role": "user", "content": "import os"}]
    full = greedy(session, question)
    for shown_before_stop in (8, 100, 400):
        term.send("/reset\n")
        term.read_until("(conversation reset)\n> ")
        assert not termios.tcgetattr(term.fd)[3] & termios.NOFLSH, "the terminal's modes were not restored"
        term.send("import os\n")
        term.read_until("import os\n")
        while len(term.buf) < shown_before_stop:  # that much of the answer is out
            ready, _, _ = select.select([term.fd], [], [], 60)
            assert ready, "the answer stalled"
            term.buf += os.read(term.fd, 65536).decode("utf-8", errors="replace").replace("\r\n", "\n")
        # Otherwise the terminal would discard output not yet read when it delivers the Ctrl-C, and
        # the screen would lack text the conversation keeps (a real terminal does the same).
        assert termios.tcgetattr(term.fd)[3] & termios.NOFLSH, "the terminal flushes output on Ctrl-C"
        term.send("\x03")
        partial = term.read_until(" (stopped)\n> ").replace("^C", "")  # the terminal echoes the ^C
        assert partial and full.startswith(partial) and len(partial) < len(full), "the answer was not cut short"
        after = [*question, {"role": "assistant", "content": partial}, {"role": "user", "content": "y"}]
        assert term.answer("y") == greedy(session, after)

    term.send("\x04")
    assert term.wait() == 0
