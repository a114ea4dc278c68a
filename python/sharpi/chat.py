"""`sharpi chat`: multi-turn chat in the terminal with the model's chat template.

What it owns: the conversation (a list of messages) and the loop that reads a line, renders the
whole conversation with the template (sharpi.serve.encode_chat), decodes only what the KV cache
does not hold yet (sharpi.serve.reuse_prefix) and streams the answer. `/reset` forgets the
conversation; Ctrl-C during an answer stops it (Session turns Ctrl-C into a cancel within one
layer, nothing of that decode appended) and the conversation goes on with the partial answer;
Ctrl-C or Ctrl-D at the prompt quits. It runs on the main thread only.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
from typing import TextIO

from .cli_args import non_negative_int
from .serve import add_model_arguments

HELP_LINE = "sharpi chat: /reset forgets the conversation, Ctrl-C stops an answer, Ctrl-D quits"


@contextlib.contextmanager
def _sigint_held():
    """SIGINT blocked for the calling thread inside the block (delivered, if it came, on exit)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def add_chat_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "chat",
        help="chat with a model in the terminal",
        description="Interactive multi-turn chat with the model's chat template, streaming each answer.",
    )
    p.add_argument("--system", default=None, metavar="TEXT", help="system message opening the conversation")
    p.add_argument("-n", "--n-predict", type=non_negative_int("-n"), default=512, metavar="N",
                   help="most tokens per answer (default: 512)")
    p.add_argument("--temp", type=float, default=0.8, metavar="T", help="temperature, 0 = greedy (default: 0.8)")
    p.add_argument("-s", "--seed", type=int, default=-1, metavar="S",
                   help="sampling seed, -1 = random (default: -1)")
    add_model_arguments(p)
    return p


def cmd_chat(args, inp: TextIO, out: TextIO) -> int:
    from .serve import encode_chat, load_model, reuse_prefix

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
        try:
            for piece in session.generate(ids[n_reused:], **options):
                # Ctrl-C is held off while a piece is shown and kept, so that the answer the
                # conversation keeps is exactly the text on the screen: a KeyboardInterrupt between
                # keeping a piece and writing it would keep text the user never saw (and the next
                # turn would continue from it). A Ctrl-C meanwhile stays pending and is raised when
                # unblocked, on the unblocking line.
                with _sigint_held():
                    out.write(piece)
                    out.flush()
                    pieces.append(piece)
        except KeyboardInterrupt:
            out.write(" (stopped)")
        # A cancelled decode appended nothing: the cache holds a prefix of prompt + sampled ids.
        held = (ids + session.last_tokens)[: session.n_past]
        messages.append({"role": "assistant", "content": "".join(pieces)})
        out.write("\n")
    session.close()
    return 0
