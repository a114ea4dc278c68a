"""`sharpi chat` (issues 20 and 37) driven through a pseudo-terminal with the shipped model: turns,
/reset, Ctrl-C in the middle of an answer, Ctrl-D to quit; readline's history (Up recalls a line,
also from the history file of an earlier session); the /commands, which never reach the model;
Ctrl-C twice at the prompt to quit; the notice for a model without a chat template; --completion
and /completion; run's sampling flags and -hf, with piped input.

Oracle: Session.generate in this process on the ChatML prompt of the whole conversation written out
here by hand (the shipped model has no template, so chat falls back to ChatML), or on the raw line
in completion mode, with the sampling keywords each flag stands for written out here.
"""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time

if sys.platform != "win32":
    import termios

import pytest
import sharpi
from sharpi.chat import HELP_LINE, QUIT_HINT
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


def greedy(session, messages: list, max_tokens: int = N_PREDICT, **sampling) -> str:
    """The answer to `messages` (ChatML), greedy unless `sampling` says otherwise."""
    session.reset()
    ids = session.tokenize(chatml(messages), special=True)
    return "".join(session.generate(ids, max_tokens=max_tokens, **{"temperature": 0.0, **sampling}))


def completed(session, text: str, max_tokens: int) -> str:
    """What `sharpi run -p TEXT --temp 0` prints before its final newline: no template."""
    session.reset()
    return "".join(session.generate(session.tokenize(text), max_tokens=max_tokens, temperature=0.0))


def chat_argv(*args: str) -> list:
    return [sys.executable, "-m", "sharpi.cli", "chat", "-t", "1", "-c", str(N_CTX), *args]


@pytest.fixture
def history(tmp_path):
    """The history file the chats of one test share ($SHARPI_CHAT_HISTORY)."""
    return tmp_path / "chat_history"


class Terminal:
    """The child on a pseudo-terminal; output with the terminal's CRLF turned back into LF. TERM is a
    real terminal's, the user's inputrc is left out and the history goes to `history`."""

    def __init__(self, argv: list, history):
        env = child_env()
        env.update(TERM="xterm", INPUTRC=os.devnull, SHARPI_CHAT_HISTORY=str(history))
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the pty is its controlling terminal, so ^C is its SIGINT
            os.execvpe(argv[0], argv, env)
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
        pytest.fail("sharpi chat did not quit")


def test_chat_turns_reset_and_ctrl_c(session, history):
    term = Terminal(chat_argv("-n", str(N_PREDICT), "--temp", "0"), history)
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


# ------------------------------------------------------------------ line editing, commands, keys

HELP_FIRST = "commands (a line starting with / is handled here and never sent to the model):\n"
HELP_LAST = "quit (at an empty prompt)\n"
UP = "\x1b[A"  # what a terminal sends for the Up arrow key


def ctrl_c_at_prompt(term: Terminal) -> None:
    """Ctrl-C at the prompt a moment after its last output, as a person presses it. Sent at once, it
    can arrive while readline still handles the previous key, before input() waits in select():
    CPython then holds the KeyboardInterrupt until the next key (python/cpython#112585)."""
    time.sleep(0.3)
    term.send("\x03")


def read_help(term: Terminal) -> str:
    """The /help text up to its last line, then the prompt after it."""
    term.read_until(HELP_FIRST)
    text = term.read_until(HELP_LAST)
    term.read_until("> ")
    return text


def test_help_history_and_ctrl_c_at_the_prompt(history):
    term = Terminal(chat_argv("-n", "4", "--temp", "0"), history)
    term.read_until(HELP_LINE + "\n> ")
    term.send("/help\r")
    text = read_help(term)
    for command in ("/help, /?", "/reset", "/completion", "/bye, /exit", "//text", "Up, Down", "Ctrl-C", "Ctrl-D"):
        assert command in text
    assert str(history) in text, "help names the history file"
    # Up recalls "/help" (a terminal without readline would send ESC [ A as text: an answer, no help).
    term.send(UP + "\r")
    assert "/help" in term.read_until(HELP_FIRST)
    term.read_until(HELP_LAST + "> ")
    term.send("/?\r")
    read_help(term)

    # Ctrl-C on a line with text discards the text, as a shell does, and counts for nothing.
    term.send("abc")
    term.read_until("abc")
    ctrl_c_at_prompt(term)
    assert QUIT_HINT not in term.read_until("\n> ")
    # Ctrl-C at an empty prompt says how to quit; a line in between starts the count again; two in a row
    # quit.
    ctrl_c_at_prompt(term)
    term.read_until(QUIT_HINT + "\n> ")
    term.send("/frobnicate\r")
    term.read_until("/frobnicate: unknown command, /help lists them\n> ")
    ctrl_c_at_prompt(term)
    term.read_until(QUIT_HINT + "\n> ")
    ctrl_c_at_prompt(term)
    assert term.wait() == 0
    assert history.read_text().splitlines() == ["/help", "/?", "/frobnicate"]

    # A new session reads the history file: Up recalls the last line of the one before.
    term = Terminal(chat_argv("-n", "4", "--temp", "0"), history)
    term.read_until(HELP_LINE + "\n> ")
    term.send(UP + "\r")
    term.read_until("/frobnicate: unknown command, /help lists them\n> ")
    term.send(UP + UP + "\r")  # two back: /?
    read_help(term)
    term.send("/bye\r")
    assert term.wait() == 0


def test_commands_never_reach_the_model_and_up_resends_a_question(session, history):
    term = Terminal(chat_argv("-n", "24", "--temp", "0"), history)
    notice = term.read_until(HELP_LINE + "\n> ")
    # The shipped model is a code completion model without a template.
    for words in ("no chat template", "ChatML fallback", "completion", "`sharpi chat --completion`",
                  "`sharpi run -p"):
        assert words in notice
    for command, reply in (("/help", HELP_LAST), ("/?", HELP_LAST), ("/nope", "unknown command, /help lists them\n"),
                           ("/reset", "(conversation reset)\n"), ("/bye?", "/bye?: unknown command")):
        term.send(command + "\r")
        term.read_until(reply)
        term.read_until("> ")

    # Only the question reached the model: its answer is that of a conversation of one message.
    question = [{"role": "user", "content": "def add(a, b):"}]
    a1 = term.answer("def add(a, b):")
    assert a1 == greedy(session, question, 24)
    # Up + Enter sends the same question again, as the second turn.
    term.send(UP + "\r")
    term.read_until("def add(a, b):\n")
    a2 = term.read_until("\n> ")
    again = [*question, {"role": "assistant", "content": a1}, *question]
    assert a2 == greedy(session, again, 24)
    # "//" sends the line with one "/" less: "/reset" reaches the model as a question, nothing is reset.
    a3 = term.answer("//reset")
    assert a3 == greedy(session, [*again, {"role": "assistant", "content": a2}, {"role": "user", "content": "/reset"}],
                        24)
    term.send("/exit\r")
    assert term.wait() == 0


def test_completion_mode_continues_lines_as_run_does(session, history):
    term = Terminal(chat_argv("--completion", "-n", "24", "--temp", "0"), history)
    assert "completion mode" in term.read_until(HELP_LINE + "\n> ")
    # Each line is a prompt of its own, without a template: what `sharpi run -p LINE` prints.
    for line in ("def add(a, b):", "import os", "def add(a, b):"):
        assert term.answer(line) == completed(session, line, 24)
    term.send("/completion\r")
    term.read_until("(chat mode: a new conversation with the chat template)\n> ")
    assert term.answer("import os") == greedy(session, [{"role": "user", "content": "import os"}], 24)
    term.send("/completion\r")
    term.read_until("(completion mode: each line is continued as raw text, no template)\n> ")
    assert term.answer("class Stack:") == completed(session, "class Stack:", 24)
    term.send("\x04")
    assert term.wait() == 0


# ------------------------------------------------------------------ flags, with piped input


def piped(lines: list, *args: str, env: dict | None = None) -> str:
    """What `sharpi chat ARGS` prints after its help line for `lines` on a pipe: "> " before what
    each line gets (an answer and a newline, the /help text, nothing for /bye), "> \\n" at the end
    of the input."""
    done = subprocess.run(chat_argv(*args), input="".join(line + "\n" for line in lines), capture_output=True,
                          text=True, env=env or child_env(), timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    head, _, rest = done.stdout.partition("\n")
    assert head == HELP_LINE
    return rest


def test_sampling_flags_reach_the_model(session):
    question = [{"role": "user", "content": "def add(a, b):"}]
    long = greedy(session, question, 24)
    first = session.last_tokens[0]
    three = greedy(session, question, 3)
    assert long.startswith(three) and len(three) < len(long)
    assert piped(["def add(a, b):"], "-n", "3", "--temp", "0") == f"> {three}\n> \n"

    # Top-k 1 leaves only the most likely token whatever the temperature.
    assert piped(["def add(a, b):"], "-n", "24", "--temp", "1.5", "--top-k", "1", "-s", "3") == f"> {long}\n> \n"
    # A ban on the greedy first token, and the penalties, change the answer as generate says they do.
    banned = greedy(session, question, 24, logit_bias={first: float("-inf")})
    assert banned != long
    assert piped(["def add(a, b):"], "-n", "24", "--temp", "0", "-l", f"{first}-inf") == f"> {banned}\n> \n"
    penalized = greedy(session, question, 24, repeat_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.5)
    assert penalized != long
    assert piped(["def add(a, b):"], "-n", "24", "--temp", "0", "--repeat-penalty", "1.5", "--presence-penalty",
                 "0.5", "--frequency-penalty", "0.5") == f"> {penalized}\n> \n"
    # Sampled with a seed: the same answer every time, that of run's default top-k/top-p/min-p.
    seeded = greedy(session, question, 24, temperature=1.0, seed=5, top_k=40, top_p=0.95, min_p=0.05)
    for _ in range(2):
        assert piped(["def add(a, b):"], "-n", "24", "--temp", "1", "-s", "5") == f"> {seeded}\n> \n"


def test_piped_commands_and_escape_sequences(session):
    # On a pipe there is no line editing: ESC [ A is text sent to the model, and /commands still work.
    out = piped(["/help", "import os", "/bye", "never read"], "-n", "12", "--temp", "0")
    help_text, _, rest = out.removeprefix("> ").partition(HELP_LAST)
    assert help_text.startswith(HELP_FIRST + "  /help, /?")
    assert rest == f"> {greedy(session, [{'role': 'user', 'content': 'import os'}], 12)}\n> "
    escaped = greedy(session, [{"role": "user", "content": UP}], 12)
    assert piped([UP], "-n", "12", "--temp", "0") == f"> {escaped}\n> \n"


def test_hf_repo(tmp_path, session):
    pytest.importorskip("huggingface_hub")
    from fake_hub import FakeHub

    repo = "sharpi-test/stdlib-moe-GGUF"
    with open(default_model_path(), "rb") as f:
        hub = FakeHub({repo: {"stdlib-moe-Q8_0.gguf": f.read()}})
    try:
        env = child_env(base={k: v for k, v in os.environ.items() if not k.startswith("HF_")})
        env.update(HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT=hub.url, HF_HUB_DISABLE_TELEMETRY="1",
                   HF_HUB_DISABLE_XET="1", NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
        out = piped(["import os"], "-hf", f"{repo}:Q8_0", "-n", "12", "--temp", "0", env=env)
    finally:
        hub.stop()
    assert out == f"> {greedy(session, [{'role': 'user', 'content': 'import os'}], 12)}\n> \n"
