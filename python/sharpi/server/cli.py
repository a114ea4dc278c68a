"""`sharpi serve`: the parser and the command, and the model options (add_model_arguments,
load_model) that `sharpi chat` shares. Imports the server's Starlette and uvicorn parts only when
the command runs, so `sharpi --help` works without the serve extra."""

from __future__ import annotations

import argparse
import json
import os
import socket
from typing import TextIO

from ..cli_args import (
    add_compute_arguments,
    add_hf_argument,
    add_llama_compat_arguments,
    add_sampling_arguments,
    add_speculative_arguments,
    add_streaming_arguments,
    positive_int,
    sampling_options,
    session_options,
    speculation_from_args,
    speculative_session_options,
)
from .prompt import CHATML_TEMPLATE, RESERVED_TEMPLATE_KWARGS

# --parallel's bound: the slots are sequences of one Session, each with its own KV cache.
MAX_SLOTS = 256
# scheduler.DEFAULT_BATCH_SIZE, repeated: the scheduler imports the core, not at --help time.
DEFAULT_BATCH_SIZE = 512

# --max-body's default, 8 MiB (body.DEFAULT_MAX_BODY, which imports Starlette: not at --help time).
DEFAULT_MAX_BODY = 8 * 1024 * 1024
_SIZE_UNITS = {"": 1, "k": 1024, "kib": 1024, "m": 1024**2, "mib": 1024**2, "g": 1024**3, "gib": 1024**3}


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _template_kwargs(text: str) -> dict:
    value = _json_object(text)
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(value))
    if reserved:
        raise argparse.ArgumentTypeError(f"may not set {', '.join(reserved)} (the renderer's own arguments)")
    return value


def byte_size(text: str) -> int:
    """An argparse type for a size in bytes: N, or N with K/KiB, M/MiB or G/GiB (powers of 1024)."""
    number = text.rstrip("KkMmGgIiBb")
    unit = text[len(number):].lower()
    if not number.isdigit() or unit not in _SIZE_UNITS or int(number) == 0:
        raise argparse.ArgumentTypeError(f"a size in bytes, e.g. 8MiB or 1048576, got {text!r}")
    return int(number) * _SIZE_UNITS[unit]


def _slot_count(text: str) -> int:
    """An argparse type for --parallel: 1 to MAX_SLOTS slots."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"-np/--parallel must be an integer, got {text!r}") from None
    if not 1 <= value <= MAX_SLOTS:
        raise argparse.ArgumentTypeError(f"-np/--parallel must be 1 to {MAX_SLOTS} (the requests decoded at "
                                         f"once, each with its own KV cache), got {value}")
    return value


def api_keys(text: str) -> list:
    """An argparse type for --api-key: keys separated by commas, as llama-server takes them."""
    keys = [k.strip() for k in text.split(",")]
    if not all(keys):
        raise argparse.ArgumentTypeError(f"an empty key in {text!r}")
    return keys


def bind_listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, for uvicorn to listen on: bound here, before the model loads
    and before "serving ..." is printed, so a taken port is the first and only thing said
    (OSError, which `sharpi` prints as one error line)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def add_model_arguments(p: argparse.ArgumentParser, hf_repo: bool = False) -> None:
    """-m (or, with `hf_repo`, -m or -hf: resolve it with cli_args.model_from_hub before load_model)
    and --chat-template, then the compute and streaming options (`serve` and `chat`)."""
    source = p.add_mutually_exclusive_group()
    source.add_argument("-m", "--model", default=None, metavar="FILE",
                        help="GGUF model file (default: the shipped stdlib-moe model)")
    if hf_repo:
        add_hf_argument(source)
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="Jinja chat template file (default: the model's tokenizer.chat_template, else ChatML)")
    p.add_argument("--chat-template-kwargs", type=_template_kwargs, default={}, metavar="JSON",
                   help="keyword arguments for the template, e.g. '{\"enable_thinking\": false}' "
                        "(serve: a request's chat_template_kwargs go on top)")
    add_compute_arguments(p)
    add_streaming_arguments(p)
    add_speculative_arguments(p)


def load_model(args, **session_extra):
    """(Session, chat template) from add_model_arguments' options (and `session_extra`, more
    Session keywords): the template is the file's text, None for the model's own, or ChatML when
    the model has none."""
    from ..progress import open_session

    if args.model is None:
        from ..models import default_model_path

        args.model = default_model_path()
    if not os.path.isfile(args.model):
        raise FileNotFoundError(f"{args.model}: no such file")
    session = open_session(args.model, **session_options(args), **speculative_session_options(args),
                           **session_extra)
    template = None if session.tokenizer.chat_template else CHATML_TEMPLATE
    if args.chat_template is not None:
        with open(args.chat_template, encoding="utf-8") as f:
            template = f.read()
    return session, template


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="OpenAI-compatible server: /v1/chat/completions, /v1/completions, /v1/models, /health.",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=positive_int("--port"), default=8080, help="port (default: 8080)")
    p.add_argument("--alias", default=None, metavar="NAME",
                   help="model name the API reports and accepts (default: the file name)")
    p.add_argument("--reasoning-format", choices=("deepseek", "none"), default="deepseek",
                   help="deepseek: <think> blocks and gpt-oss's analysis channel come back as reasoning_content; "
                   "none: left in the content (llama-server's flag; default: deepseek)")
    p.add_argument("--max-body", type=byte_size, default=DEFAULT_MAX_BODY, metavar="SIZE",
                   help="largest request body taken, e.g. 8MiB; a longer one gets 413 (default: 8MiB)")
    p.add_argument("--api-key", type=api_keys, default=None, metavar="KEY[,KEY...]",
                   help="require one of these keys (Authorization: Bearer KEY, or x-api-key: KEY) on every "
                   "endpoint but /health, / and /openapi.json (default: none required)")
    p.add_argument("--cors-origin", action="append", default=None, metavar="ORIGIN",
                   help="a browser origin allowed to call the API, e.g. http://localhost:3000, or * for any; "
                   "repeatable (default: none, only the page at / itself)")
    p.add_argument("-np", "--parallel", type=_slot_count, default=1, metavar="N",
                   help="requests decoded at once, each on its own slot with its own KV cache of -c tokens "
                   f"(continuous batching; llama-server's -np; 1 to {MAX_SLOTS}, default: 1)")
    p.add_argument("--queue-size", type=positive_int("--queue-size"), default=None, metavar="N",
                   help="requests that may wait for a free slot; more get 503 (default: 4 per slot, at least 16)")
    add_model_arguments(p)
    # llama-server's sampling flags: the defaults of a request, whose own fields override them.
    # Left out, a request gets OpenAI's defaults (the values below), not llama.cpp's.
    add_sampling_arguments(p, n_predict_default=-1)
    p.set_defaults(temp=1.0, top_k=0, top_p=1.0, min_p=0.0)
    add_llama_compat_arguments(p, batch_size_help="the most tokens one step decodes over all slots: prompt "
                               f"chunks and one token per decoding slot (default: {DEFAULT_BATCH_SIZE})")
    return p


def cmd_serve(args, out: TextIO, err: TextIO) -> int:
    try:
        import uvicorn

        from .app import create_app
    except ImportError as e:
        raise ImportError(f"{e}; install the serve extra: pip install 'sharpi[serve]'") from None
    from .prompt import max_token_bytes
    from .scheduler import Engine
    from .served import ServedModel

    if args.parallel > 1 and args.device == "cuda":
        # The engine's decode_batch takes one sequence a step on the device path (Engine::check_step
        # refuses more): say so now rather than fail every request. Drop this when it batches there.
        from .. import _core

        raise _core.UnsupportedError(f"--parallel {args.parallel} with --device cuda: batched sequences are not on "
                                     "the device path yet; use --parallel 1 or --device cpu")
    sock = bind_listening_socket(args.host, args.port)
    try:
        session, template = load_model(args, **({"n_seq": args.parallel} if args.parallel > 1 else {}))
        model_id = args.alias or os.path.basename(args.model)
        engine = Engine(session, batch_size=args.batch_size or DEFAULT_BATCH_SIZE, queue_size=args.queue_size,
                        speculation=speculation_from_args(session, args))
        served = ServedModel(engine, model_id, args.model, template, args.chat_template_kwargs,
                             sampling_defaults=sampling_options(args), max_body=args.max_body,
                             reasoning_format=args.reasoning_format,
                             max_token_bytes=max_token_bytes(session.tokenizer))
        app = create_app(served, log=err, api_keys=args.api_key, cors_origins=args.cors_origin)
        slots = f" ({args.parallel} slots)" if args.parallel > 1 else ""
        err.write(f"sharpi: serving {model_id}{slots} on http://{args.host}:{args.port}/v1\n")
        err.flush()
        uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False)).run(sockets=[sock])
        engine.close()
        session.close()
    finally:
        sock.close()
    return 0
