"""`sharpi chat`: multi-turn chat in the terminal with the model's chat template, or, with
--completion, each line continued as raw text.

What it owns: the conversation (a list of messages), the line reader (GNU readline's editing and
history on a terminal, plain lines from a pipe) and the loop that reads a line, handles it if it is
a /command (never sent to the model), else renders the whole conversation with the template
(sharpi.server.prompt.encode_chat), decodes only what the KV cache does not hold yet
(sharpi.server.prompt.reuse_prefix) and streams the answer with run's sampling options
(cli_args.sampling_options). Ctrl-C during an answer stops it and the conversation goes on with the
partial answer, exactly the text on the screen; Ctrl-C at the prompt prints how to quit, and a
second one in a row quits; Ctrl-D, /bye and /exit quit. It runs on the main thread only.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from typing import TextIO

try:
    import termios
except ImportError:  # not POSIX
    termios = None

from .cli_args import (
    Refused,
    add_llama_compat_arguments,
    add_sampling_arguments,
    model_from_hub,
    sampling_options,
    speculation_from_args,
)
from .server.cli import add_model_arguments

HELP_LINE = "sharpi chat: /help lists commands and keys, Ctrl-C stops an answer, /bye or Ctrl-D quits"
QUIT_HINT = "(Ctrl-C again or /bye or Ctrl-D to quit)"
HISTORY_LENGTH = 1000  # lines kept in the history file


def history_path() -> str | None:
    """Where the line history persists: $SHARPI_CHAT_HISTORY if set (empty: nowhere), else
    ~/.sharpi_chat_history."""
    path = os.environ.get("SHARPI_CHAT_HISTORY")
    if path is None:
        return os.path.join(os.path.expanduser("~"), ".sharpi_chat_history")
    return path or None


def commands_help(history: str | None) -> str:
    saved = f"saved in {history}" if history else "not saved ($SHARPI_CHAT_HISTORY is empty)"
    return f"""commands (a line starting with / is handled here and never sent to the model):
  /help, /?      this list
  /reset         forget the conversation
  /completion    switch between chat and completion mode (each line continued as raw text, no
                 template); switching forgets the conversation
  /bye, /exit    quit
  //text         send "/text" to the model: a leading // loses one /
keys (on a terminal):
  Up, Down       previous, next line of the history ({saved})
  Left, Right, Home, End, Ctrl-A, Ctrl-E, Ctrl-K, Ctrl-U, Ctrl-W   edit the line (GNU readline)
  Ctrl-C         stop the answer; at the prompt: clear the line, on an empty one twice in a row quits
  Ctrl-D         quit (at an empty prompt)
"""


class LineReader:
    """The user's lines, without their newline; None at end of input; Ctrl-C raises KeyboardInterrupt.

    On a terminal (`inp` and `out` are sys.stdin and sys.stdout and both are ttys) it reads with
    GNU readline through input(): line editing, and Up/Down through a history loaded from
    history_path() and written back by close(); Ctrl-C on a line with text discards the text and
    prompts again, as a shell does, so only Ctrl-C on an empty line raises. Otherwise (piped input, a test's StringIO) it reads
    plain lines from `inp`, so escape sequences reach the model verbatim and no history is kept.
    readline is imported only here: importing it sets up the terminal, which no other command wants.
    """

    def __init__(self, inp: TextIO, out: TextIO, err: TextIO):
        self.inp, self.out, self.err = inp, out, err
        self.readline = None
        self.history = None
        if inp is sys.stdin and out is sys.stdout and _isatty(inp) and _isatty(out):
            try:
                import readline
            except ImportError:  # a Python built without it: plain lines still work
                return
            self.readline = readline
            self.history = history_path()
            if self.history is not None:
                with contextlib.suppress(FileNotFoundError):
                    readline.read_history_file(self.history)

    def read(self, prompt: str) -> str | None:
        if self.readline is None:
            self.out.write(prompt)
            self.out.flush()
            line = self.inp.readline()
            return line.removesuffix("\n") if line else None
        while True:
            self.out.flush()
            try:
                return input(prompt)
            except EOFError:
                return None
            except KeyboardInterrupt:
                if not self.readline.get_line_buffer():  # what was on the line; input() leaves it
                    raise
                self.out.write("\n")

    def close(self) -> None:
        """Writes the history file (the newest HISTORY_LENGTH lines); a failure is a warning only."""
        if self.readline is None or self.history is None:
            return
        self.readline.set_history_length(HISTORY_LENGTH)
        try:
            self.readline.write_history_file(self.history)
        except OSError as e:
            self.err.write(f"sharpi chat: history not saved: {self.history}: {e.strerror or e}\n")


def _isatty(stream) -> bool:
    try:
        return os.isatty(stream.fileno())
    except (AttributeError, OSError, ValueError):  # no file behind it, or closed
        return False


@contextlib.contextmanager
def _ctrl_c_stops(session, terminal: TextIO):
    """Inside the block Ctrl-C raises nothing: it sets the returned event and cancels the session,
    so the decode running then, or the next one, raises CancelledError with nothing appended
    (during a decode Session's SIGINT bridge calls cancel() and stops it within one layer).

    Both halves keep the answer the conversation goes on with exactly the text on the screen:
    - no KeyboardInterrupt: CPython raises it at whatever bytecode comes next once the signal was
      recorded, even inside a block that blocks SIGINT by then, so it could land between writing a
      piece and keeping it. With an event the answer stops only between pieces.
    - NOFLSH on the terminal: by default the terminal discards output not yet displayed when it
      sends SIGINT (POSIX termios), so text written and kept just before Ctrl-C would never show.
      Restored on exit, so Ctrl-C at the prompt behaves as the user's terminal always does.
    """
    stop = threading.Event()

    def on_sigint(signum, frame):
        stop.set()
        session.cancel()

    saved_modes = _set_noflsh(terminal)
    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)
        if saved_modes is not None:
            with contextlib.suppress(OSError, termios.error):  # the terminal went away meanwhile
                termios.tcsetattr(terminal.fileno(), termios.TCSANOW, saved_modes)
        if stop.is_set():
            session.clear_cancel()  # a cancel no decode saw must not stop the next answer


def _set_noflsh(terminal: TextIO):
    """Sets NOFLSH on `terminal` if it is one; returns its previous modes, or None."""
    if termios is None:
        return None
    try:
        fd = terminal.fileno()
        if not os.isatty(fd):
            return None
        saved = termios.tcgetattr(fd)
        modes = list(saved)
        modes[3] |= termios.NOFLSH  # [3]: the local modes
        termios.tcsetattr(fd, termios.TCSANOW, modes)
        return saved
    except (AttributeError, OSError, ValueError, termios.error):  # not a real file, or closed
        return None


def add_chat_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "chat",
        help="chat with a model in the terminal",
        description="Interactive multi-turn chat with the model's chat template, streaming each answer; "
        "--completion continues each line as raw text instead. On a terminal: line editing, Up/Down "
        "history (saved in $SHARPI_CHAT_HISTORY, default ~/.sharpi_chat_history), /help lists the "
        "commands (/reset, /completion, /bye, ...), Ctrl-C stops an answer, Ctrl-C twice or Ctrl-D quits.",
    )
    p.add_argument("--system", "-sys", "--system-prompt", dest="system", default=None, metavar="TEXT",
                   help="system message opening the conversation")
    p.add_argument("--completion", action="store_true",
                   help="no chat template: each line is a prompt of its own, continued as `sharpi run -p LINE` "
                   "would (for base/completion models; /completion switches at the prompt)")
    add_sampling_arguments(p, n_predict_default=512)
    llama = add_llama_compat_arguments(p)
    llama.add_argument("-cnv", "--conversation", "-i", "--interactive", dest="conversation", action="store_true",
                       help="accepted: `sharpi chat` is llama-cli's conversation mode")
    llama.add_argument("--chat-template-file", dest="chat_template", default=None, metavar="FILE",
                       help="llama.cpp's name for --chat-template FILE")
    llama.add_argument("-no-cnv", "--no-conversation", action=Refused,
                       why="`sharpi chat` is a conversation; `sharpi chat --completion` continues each line as "
                       "raw text, `sharpi run` completes one prompt",
                       help="refused: use --completion or `sharpi run`")
    llama.add_argument("-r", "--reverse-prompt", "--stop", action=Refused, nargs=None,
                       why="`sharpi chat` hands the turn back at the template's end-of-turn token; stop "
                       "text is for `sharpi run -r/--stop`",
                       help="refused: an answer ends at the template's end of turn")
    add_model_arguments(p, hf_repo=True)
    return p


def no_template_notice(completion: bool) -> str:
    """What chat says at start when the model has no chat template and none was given."""
    if completion:
        return ("sharpi chat: completion mode: each line is continued as raw text (the model has no chat "
                "template; /completion switches to chat with a generic ChatML fallback)")
    return ("sharpi chat: the model has no chat template (no tokenizer.chat_template in the GGUF), so a generic "
            "ChatML fallback is used; it looks like a completion (base) model: `sharpi chat --completion` "
            "(or /completion) continues each line as raw text, `sharpi run -p TEXT` completes one prompt")


def cmd_chat(args, inp: TextIO, out: TextIO, err: TextIO) -> int:
    from .server.cli import load_model

    model_from_hub(args, err)
    session, template = load_model(args)
    try:
        if not session.tokenizer.chat_template and args.chat_template is None:
            err.write(no_template_notice(args.completion) + "\n")
        elif args.completion:
            err.write("sharpi chat: completion mode: each line is continued as raw text, no template "
                      "(/completion switches to chat)\n")
        if args.completion and args.system:
            err.write("sharpi chat: --system applies in chat mode only (after /completion)\n")
        err.flush()
        out.write(HELP_LINE + "\n")
        reader = LineReader(inp, out, err)
        try:
            _converse(args, session, template, reader, inp, out)
        finally:
            reader.close()
    finally:
        session.close()
    return 0


def _converse(args, session, template, reader: LineReader, inp: TextIO, out: TextIO) -> None:
    """The loop: a line in, a command handled or an answer streamed; returns when the user quits."""
    from . import CancelledError
    from .server.prompt import encode_chat, reuse_prefix

    tok = session.tokenizer
    completion = args.completion
    opening = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(opening)
    held: list = []  # the ids the KV cache holds, in order
    options = sampling_options(args)
    speculation = speculation_from_args(session, args)
    if speculation is not None:
        options["speculative"] = speculation
    interrupted = False  # the last prompt ended in Ctrl-C
    while True:
        try:
            line = reader.read("> ")
        except KeyboardInterrupt:
            out.write("\n")
            if interrupted:
                break
            interrupted = True
            out.write(QUIT_HINT + "\n")
            continue
        interrupted = False
        if line is None:  # Ctrl-D or the end of piped input
            out.write("\n")
            break
        text = line
        stripped = text.strip()
        if stripped.startswith("//"):
            text = text.replace("/", "", 1)
        elif stripped.startswith("/"):
            command = stripped.split()[0]
            if command in ("/bye", "/exit"):
                break
            if command in ("/help", "/?"):
                out.write(commands_help(reader.history if reader.readline else history_path()))
            elif command == "/reset":
                messages, held = list(opening), []
                session.reset()
                out.write("(conversation reset)\n")
            elif command == "/completion":
                completion = not completion
                messages, held = list(opening), []
                session.reset()
                out.write("(completion mode: each line is continued as raw text, no template)\n" if completion
                          else "(chat mode: a new conversation with the chat template)\n")
            else:
                out.write(f"{command}: unknown command, /help lists them\n")
            continue
        if not stripped:
            continue
        if completion:
            ids = session.tokenize(text)  # what `sharpi run -p TEXT` decodes
        else:
            messages.append({"role": "user", "content": text})
            ids = encode_chat(tok, messages, template=template, **args.chat_template_kwargs)
        n_reused = reuse_prefix(session, held, ids)
        session.last_tokens = []
        pieces: list = []
        stopped = False
        with _ctrl_c_stops(session, inp) as stop:
            answer = session.generate(ids[n_reused:], **options)
            try:
                for piece in answer:
                    out.write(piece)
                    out.flush()
                    pieces.append(piece)
                    if stop.is_set():
                        stopped = True
                        break
            except CancelledError:
                stopped = True
            finally:
                answer.close()
        if stopped:
            out.write(" (stopped)")
        # A cancelled decode appended nothing: the cache holds a prefix of prompt + sampled ids.
        held = (ids + session.last_tokens)[: session.n_past]
        if not completion:
            messages.append({"role": "assistant", "content": "".join(pieces)})
        out.write("\n")
