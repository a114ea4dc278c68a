"""`sharpi chat`: multi-turn chat in the terminal with the model's chat template.

What it owns: the conversation (a list of messages) and the loop that reads a line, renders the
whole conversation with the template (sharpi.server.prompt.encode_chat), decodes only what the KV cache
does not hold yet (sharpi.server.prompt.reuse_prefix) and streams the answer. `/reset` forgets the
conversation; Ctrl-C during an answer stops it and the conversation goes on with the partial
answer, exactly the text on the screen; Ctrl-C or Ctrl-D at the prompt quits. It runs on the main
thread only.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import threading
from typing import TextIO

try:
    import termios
except ImportError:  # not POSIX
    termios = None

from .cli_args import Refused, add_llama_compat_arguments, add_sampling_arguments
from .server.cli import add_model_arguments

HELP_LINE = "sharpi chat: /reset forgets the conversation, Ctrl-C stops an answer, Ctrl-D quits"


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
        description="Interactive multi-turn chat with the model's chat template, streaming each answer.",
    )
    p.add_argument("--system", "-sys", "--system-prompt", dest="system", default=None, metavar="TEXT",
                   help="system message opening the conversation")
    add_sampling_arguments(p, n_predict_default=512)
    llama = add_llama_compat_arguments(p)
    llama.add_argument("-cnv", "--conversation", "-i", "--interactive", dest="conversation", action="store_true",
                       help="accepted: `sharpi chat` is llama-cli's conversation mode")
    llama.add_argument("--chat-template-file", dest="chat_template", default=None, metavar="FILE",
                       help="llama.cpp's name for --chat-template FILE")
    llama.add_argument("-no-cnv", "--no-conversation", action=Refused,
                       why="`sharpi chat` is a conversation; to complete one prompt run `sharpi run`",
                       help="refused: use `sharpi run`")
    llama.add_argument("-r", "--reverse-prompt", "--stop", action=Refused, nargs=None,
                       why="`sharpi chat` hands the turn back at the template's end-of-turn token; stop "
                       "text is for `sharpi run -r/--stop`",
                       help="refused: an answer ends at the template's end of turn")
    add_model_arguments(p)
    return p


def cmd_chat(args, inp: TextIO, out: TextIO) -> int:
    from . import CancelledError
    from .server.cli import load_model
    from .server.prompt import encode_chat, reuse_prefix

    session, template = load_model(args)
    tok = session.tokenizer
    opening = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(opening)
    held: list = []  # the ids the KV cache holds, in order
    options = {"max_tokens": args.n_predict, "temperature": args.temp,
               "seed": None if args.seed < 0 else args.seed}
    out.write(HELP_LINE + "\n")
    while True:
        out.write("> ")
        out.flush()
        try:
            line = inp.readline()
        except KeyboardInterrupt:
            line = ""
        if not line:
            out.write("\n")
            break
        text = line.rstrip("\n")
        if text.strip() == "/reset":
            messages, held = list(opening), []
            session.reset()
            out.write("(conversation reset)\n")
            continue
        if not text.strip():
            continue
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
        messages.append({"role": "assistant", "content": "".join(pieces)})
        out.write("\n")
    session.close()
    return 0
