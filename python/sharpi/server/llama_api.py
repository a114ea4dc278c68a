"""llama-server's own endpoints, in its request and response shapes, for the scripts and editors
written against it:

- POST /tokenize {"content": str, "add_special": false, "parse_special": true, "with_pieces": false}
  -> {"tokens": [id, ...]}, or with_pieces {"tokens": [{"id": id, "piece": str or [bytes]}]} (a
  piece that is not whole UTF-8 comes as its byte values, as llama-server gives it);
- POST /detokenize {"tokens": [id, ...]} -> {"content": str} (control tokens as their text);
- GET /props: the model file, the context, the chat template, the request defaults and the slots.

Tokenizing runs in a worker thread (a long text takes seconds); bad input is an ApiError naming
the field. Never calls the Session, only its immutable Tokenizer.
"""

from __future__ import annotations

import inspect
import json

from starlette.concurrency import run_in_threadpool

from .. import __version__
from ..session import Session
from .body import require_unicode
from .errors import ApiError
from .openai_api import OPENAI_SAMPLING_DEFAULTS
from .prompt import CHATML_TEMPLATE
from .served import ServedModel


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be true or false, got {value!r}", param=name)
    return value


def _piece(tok, token_id: int):
    raw = tok.token_to_bytes(token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def _json_list(items: list, chunk: int = 4096) -> str:
    """json.dumps(items), a chunk at a time: one json.dumps of a million ids holds the GIL for a
    tenth of a second (the event loop waits), between chunks the loop can take it."""
    return "[" + ",".join([json.dumps(items[i : i + chunk], ensure_ascii=False)[1:-1]
                           for i in range(0, len(items), chunk)]) + "]"


def _tokenize(tok, content: str, add_special: bool, parse_special: bool, with_pieces: bool) -> bytes:
    """The response body, JSON already (a megabyte of text is a million ids: not on the event loop)."""
    ids = tok.encode(content, add_bos=add_special, special=parse_special, add_eos=False)
    tokens = [{"id": i, "piece": _piece(tok, i)} for i in ids] if with_pieces else ids
    return ('{"tokens":' + _json_list(tokens) + "}").encode("utf-8")


async def tokenize(served: ServedModel, body: dict) -> bytes:
    """POST /tokenize: the JSON response body."""
    content = body.get("content")
    if not isinstance(content, str):
        raise ApiError(400, "'content' must be a string", param="content")
    require_unicode(content, "content")
    tok = served.engine.tokenizer
    add_special = _flag(body, "add_special", False) and tok.bos_id is not None
    return await run_in_threadpool(_tokenize, tok, content, add_special, _flag(body, "parse_special", True),
                                   _flag(body, "with_pieces", False))


async def detokenize(served: ServedModel, body: dict) -> dict:
    tokens = body.get("tokens")
    tok = served.engine.tokenizer
    if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < tok.n_vocab for t in tokens):
        raise ApiError(400, f"'tokens' must be a list of token ids, each in 0..{tok.n_vocab - 1}", param="tokens")
    return {"content": await run_in_threadpool(tok.decode, tokens)}


def _generation_params(served: ServedModel) -> dict:
    """What a request that names no sampling field gets, in llama-server's names (`params`)."""
    generate = inspect.signature(Session.generate).parameters
    o = {**OPENAI_SAMPLING_DEFAULTS, **served.sampling_defaults}
    return {
        "n_predict": o["max_tokens"],
        "seed": -1 if o["seed"] is None else o["seed"],
        "temperature": o["temperature"],
        "top_k": o["top_k"],
        "top_p": o["top_p"],
        "min_p": o["min_p"],
        "repeat_penalty": o["repeat_penalty"],
        "repeat_last_n": o.get("repeat_last_n", generate["repeat_last_n"].default),
        "presence_penalty": o.get("presence_penalty", 0.0),
        "frequency_penalty": o.get("frequency_penalty", 0.0),
        "ignore_eos": not o.get("stop_at_eos", True),
        "logit_bias": [[t, b] for t, b in sorted((o.get("logit_bias") or {}).items())],
    }


def props(served: ServedModel) -> dict:
    tok = served.engine.tokenizer
    snap = served.engine.snapshot()
    n_ctx = served.engine.n_ctx

    def token_text(token_id):
        return None if token_id is None else tok.id_to_token(token_id)

    return {
        "default_generation_settings": {"id": 0, "n_ctx": n_ctx, "is_processing": snap["busy"],
                                        "params": _generation_params(served)},
        "total_slots": served.engine.n_slots,
        "model_alias": served.model_id,
        "model_path": served.model_path,
        "n_ctx": n_ctx,
        "n_ctx_train": served.engine.info["n_ctx_train"],
        "chat_template": served.chat_template if served.chat_template is not None else tok.chat_template,
        # sharpi's own field: the model has no template and none was given, so chat renders a generic
        # ChatML the model never saw (the page offers completion mode then).
        "chat_template_fallback": not tok.chat_template and served.chat_template == CHATML_TEMPLATE,
        "bos_token": token_text(tok.bos_id),
        "eos_token": token_text(tok.eos_id),
        "modalities": {"vision": False, "audio": False},
        "build_info": f"sharpi {__version__}",
    }
