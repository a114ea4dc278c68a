"""`sharpi serve`: an OpenAI-compatible HTTP server over one Session (Starlette + uvicorn, the
`serve` extra).

Endpoints: POST /v1/chat/completions and /v1/completions (server-sent events with "stream": true),
GET /v1/models, GET /health, GET /v1/sharpi/stats (request counts and the live expert-cache view,
sharpi.serve_live), GET / (web/index.html: a chat box beside small plots of that view). Chat
messages are rendered with the model's own chat template from the GGUF metadata
(Tokenizer.apply_chat_template, a Jinja sandbox), with the request's `tools`, `documents` and
`chat_template_kwargs`. Errors are OpenAI's shape, {"error": {"message", "type", "param",
"code"}}, with 400 for a bad request (malformed JSON, bad sampling values, a prompt longer than the
context), 404 for an unknown model or path.

Who owns what: the Engine owns the Session and one worker thread; every request is a Job queued on
that thread (the thread pool of one is the request queue), so requests run one after the other.
The event loop never calls the Session except Session.cancel() (lock-free). Text
flows one way: worker thread -> Job.queue (asyncio, via call_soon_threadsafe) -> response. A client
that goes away, or a stop string that matched, cancels its Job: a queued Job is skipped, a running
one gets Session.cancel() and stops within one layer. Engine._state guards which Job is running, so
a cancel never reaches the next request's decode. A prompt that extends the ids the cache holds
decodes only its new tokens (the next turn of a chat), one that shares a prefix with them cuts the
cache back to that prefix first (reuse_prefix). The engine never learns that a server exists.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import TextIO

import numpy as np

from .cli_args import (
    add_compute_arguments,
    add_hf_argument,
    add_streaming_arguments,
    positive_int,
    session_options,
)
from .serve_live import LiveStats
from .synthetic_tokenizer import CHAT_TEMPLATE

_END = object()


class ApiError(Exception):
    """A request the server refuses, answered in OpenAI's error shape with this HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


# The template used when the model ships none (the shipped stdlib-moe is a code model): ChatML, as
# llama.cpp's server falls back to; the synthetic models' template is exactly that.
CHATML_TEMPLATE = CHAT_TEMPLATE


def encode_chat(tok, messages: list, template: str | None = None, **template_kwargs) -> list:
    """Prompt ids for chat messages: `template` (default: the model's) rendered with a generation
    prompt, encoded with control tokens as text and no second BOS when the template writes one."""
    text = tok.apply_chat_template(messages, add_generation_prompt=True, template=template, **template_kwargs)
    starts_with_bos = tok.bos_id is not None and text.startswith(tok.id_to_token(tok.bos_id))
    return tok.encode(text, add_bos=False if starts_with_bos else None, special=True)


def reuse_prefix(session, held: list, ids: list) -> int:
    """Readies `session`, whose KV cache holds `held` (ids in order), to decode the prompt `ids`,
    and returns how many leading ids it kept: the common prefix of both (the next turn of a chat
    extends `held`; an edited or regenerated one diverges from it), less the prompt's last id,
    which is decoded again for the logits that pick the first answer token. The cache is cut back
    to that prefix (Session.truncate), or cleared when nothing is shared. Decoding only the rest
    gives a cold run's logits bit for bit, since a prefill computes each position from the cached
    rows exactly as token-by-token decoding does.

    Hybrid archs (qwen3next, qwen35moe) keep a recurrent DeltaNet state that has absorbed every
    held position and cannot be rewound: there only a prompt that extends `held` keeps it, and
    any other starts over (truncate raises UnsupportedError, caught here)."""
    from . import _core

    n = 0
    for a, b in zip(held, ids[:-1]):
        if a != b:
            break
        n += 1
    if n == 0:
        session.reset()
        return 0
    try:
        session.truncate(n)
    except _core.UnsupportedError:
        session.reset()
        return 0
    return n


# ------------------------------------------------------------------ request parsing


def _number(body: dict, name: str, default, lo: float, hi: float, integer: bool = False):
    value = body.get(name)
    if value is None:
        return default
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type:
        kind = "an integer" if integer else "a number"
        raise ApiError(400, f"'{name}' must be {kind}, got {value!r}", param=name)
    if not lo <= value <= hi:
        raise ApiError(400, f"'{name}' must be between {lo} and {hi}, got {value!r}", param=name)
    return value


def _stop_strings(body: dict) -> list:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "'stop' must be a non-empty string or a list of at most 4 of them", param="stop")
    return stop


def sampling_options(body: dict, n_prompt: int, n_ctx: int) -> dict:
    """Session.generate keyword arguments from an OpenAI request body; OpenAI's defaults
    (temperature 1, top_p 1) and no top-k / min-p unless asked for."""
    if n_prompt >= n_ctx:
        raise ApiError(
            400,
            f"the prompt is {n_prompt} tokens; this model's context is {n_ctx} tokens",
            param="messages" if "messages" in body else "prompt",
            code="context_length_exceeded",
        )
    if body.get("n") not in (None, 1):
        raise ApiError(400, f"only one choice per request is supported ('n': 1), got {body['n']!r}", param="n")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, name, None, 1, 2**31 - 1, integer=True)
    if max_tokens is not None and n_prompt + max_tokens > n_ctx:
        raise ApiError(
            400,
            f"this model's context is {n_ctx} tokens; the prompt has {n_prompt} and {name} asks for "
            f"{max_tokens} more",
            param=name,
            code="context_length_exceeded",
        )
    seed = _number(body, "seed", None, -(2**63), 2**63 - 1, integer=True)
    return {
        "max_tokens": max_tokens if max_tokens is not None else n_ctx - n_prompt,
        "temperature": float(_number(body, "temperature", 1.0, 0.0, 2.0)),
        "top_p": float(_number(body, "top_p", 1.0, 0.0, 1.0)),
        "top_k": _number(body, "top_k", 0, 0, 2**31 - 1, integer=True),
        "min_p": float(_number(body, "min_p", 0.0, 0.0, 1.0)),
        "repeat_penalty": float(_number(body, "repeat_penalty", 1.0, 0.0, 10.0)),
        "seed": None if seed is None else seed & 0xFFFFFFFF,
    }


def _chat_messages(body: dict) -> list:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a 'role'", param=f"messages[{i}]")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text is understood
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        if content is not None and not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts",
                           param=f"messages[{i}].content")
        out.append({**m, "content": "" if content is None else content})
    return out


def _template_kwargs(body: dict) -> dict:
    """What a chat request hands the template besides messages: `tools` and `documents` when given
    (templates test `tools is defined`), and `chat_template_kwargs` (enable_thinking, ...)."""
    extra = body.get("chat_template_kwargs") or {}
    if not isinstance(extra, dict):
        raise ApiError(400, "'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    for name in ("tools", "documents"):
        if body.get(name) is not None:
            if not isinstance(body[name], list):
                raise ApiError(400, f"'{name}' must be a list", param=name)
            extra = {**extra, name: body[name]}
    return extra


def _completion_prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise ApiError(400, "'prompt' must be a non-empty string", param="prompt")
    return prompt


def _logprob_request(body: dict, chat: bool) -> int | None:
    """How many alternatives each generated token's log-probability entry lists, None for no
    entries. Chat: `logprobs` true/false and `top_logprobs` 0..20; completions: `logprobs` 0..5
    (OpenAI's limits). `echo` (the prompt's own log-probabilities) is not supported."""
    if chat:
        want = body.get("logprobs")
        if want not in (None, True, False):
            raise ApiError(400, f"'logprobs' must be true or false, got {want!r}", param="logprobs")
        n_top = _number(body, "top_logprobs", None, 0, 20, integer=True)
        if n_top is not None and not want:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        return (n_top or 0) if want else None
    if body.get("echo") not in (None, False):
        raise ApiError(400, "'echo' is not supported", param="echo")
    return _number(body, "logprobs", None, 0, 5, integer=True)


def token_logprobs(tok, token: int, logits, n_top: int) -> dict:
    """One generated token's entry in OpenAI's chat shape, {"token", "logprob", "bytes",
    "top_logprobs": [{"token", "logprob", "bytes"}]}: log-probabilities under the model's own
    distribution, the float64 log-softmax of the raw logits before temperature or any sampling
    filter (as OpenAI's API and llama.cpp's server report them), floored at -9999 as OpenAI does
    so JSON never sees -inf. The n_top most likely tokens come most likely first, ties by lower id.
    A token's text is its bytes as UTF-8 (U+FFFD for part of a character; `bytes` is exact)."""
    x = np.asarray(logits, dtype=np.float64)
    m = x.max()
    lp = x - (m + np.log(np.exp(x - m).sum()))

    def entry(i: int) -> dict:
        b = tok.token_to_bytes(i)
        return {"token": b.decode("utf-8", errors="replace"), "logprob": max(float(lp[i]), -9999.0),
                "bytes": list(b)}

    top: list = []
    if n_top:
        kth = np.partition(lp, len(lp) - n_top)[len(lp) - n_top]
        cand = np.flatnonzero(lp >= kth)
        top = [int(i) for i in cand[np.lexsort((cand, -lp[cand]))][:n_top]]
    return {**entry(int(token)), "top_logprobs": [entry(i) for i in top]}


def completion_logprobs(entries: list) -> dict:
    """The legacy completions shape of (text offset, chat-shaped entry) pairs."""
    return {"tokens": [e["token"] for _, e in entries], "token_logprobs": [e["logprob"] for _, e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for _, e in entries],
            "text_offset": [off for off, _ in entries]}


class StopScanner:
    """Finds the first stop string in streamed text; holds back a tail that may begin one."""

    def __init__(self, stops: list):
        self.stops, self.pending = stops, ""

    def push(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string matched: then nothing after it is emitted)."""
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        keep = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.pending)), keep, -1):
                if self.pending.endswith(s[:n]):
                    keep = n
                    break
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(out) :]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


# ------------------------------------------------------------------ engine


class Job:
    """One request's generation: its pieces arrive on `queue` (the event loop's side) as (text,
    [(text offset, logprob entry)]) pairs, the entries of the tokens whose text begins the piece
    (none unless n_top is set); its counts are written by the worker before _END is queued."""

    def __init__(self, loop: asyncio.AbstractEventLoop, prompt_ids: list, options: dict,
                 n_top: int | None = None):
        self.loop, self.prompt_ids, self.options = loop, prompt_ids, options
        self.n_top = n_top  # alternatives per logprob entry; None: no entries
        self.queue: asyncio.Queue = asyncio.Queue()
        self.stopped = threading.Event()
        self.n_generated = 0
        self.n_reused = 0  # prompt tokens the KV cache already held (not decoded again)
        self.finish_reason = "stop"
        self.error: BaseException | None = None
        # Worker-side clock (time.perf_counter): start of the request's turn, first text, end.
        self.t_start = self.t_first = self.t_end = 0.0

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class Engine:
    """The one Session and the one thread that calls it (see the module docstring)."""

    def __init__(self, session):
        self.session = session
        self.n_ctx = session.info["n_ctx"]
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sharpi-serve")
        self._state = threading.Lock()
        self._current: Job | None = None
        # Finished requests, those of them stopped early by cancel() (a client that left, a stop
        # string), and their generated tokens: GET /v1/sharpi/stats. Written by the worker under _state.
        self.counts = {"requests": 0, "cancelled": 0, "completion_tokens": 0, "prompt_tokens_reused": 0,
                       "prompt_tokens_prefilled": 0}
        # The ids the KV cache holds, in order (worker thread only); [] after an error, so the
        # next request starts from reset().
        self._history: list = []
        # The expert-cache view the page at / plots: sampled by the worker between tokens.
        self.live = LiveStats(session.info["n_expert_used"])
        self._counted = 0  # session.n_past when positions were last counted into `live`

    def _sample(self, force: bool = False) -> None:
        """Counts the positions decoded since the last call into the live view and samples the
        expert cache when due (worker thread, between decodes)."""
        n_past = self.session.n_past
        self.live.add_tokens(n_past - self._counted)
        self._counted = n_past
        if force or self.live.due():
            self.live.observe(self.session.expert_stats())

    def submit(self, prompt_ids: list, options: dict, n_top: int | None = None) -> Job:
        job = Job(asyncio.get_running_loop(), prompt_ids, options, n_top)
        self._pool.submit(self._run, job)
        return job

    def cancel(self, job: Job) -> None:
        with self._state:
            job.stopped.set()
            if self._current is job:
                self.session.cancel()

    def _run(self, job: Job) -> None:
        from . import _core

        s = self.session
        with self._state:
            if job.stopped.is_set():
                job.put(_END)
                return
            self._current = job
            s.clear_cancel()
        s.last_tokens = []
        try:
            job.t_start = time.perf_counter()
            ids = job.prompt_ids
            job.n_reused = reuse_prefix(s, self._history, ids)
            self._counted = job.n_reused
            self.live.begin_request(s.expert_stats())
            pending: list = []  # logprob entries of tokens whose text has not been put yet
            produced = 0  # characters put so far: the next piece's offset

            def on_token(token, logits):
                pending.append(token_logprobs(s.tokenizer, token, logits, job.n_top))

            gen = s.generate(ids[job.n_reused :], history=ids[: job.n_reused],
                             on_token=None if job.n_top is None else on_token, **job.options)
            try:
                for piece in gen:
                    job.t_first = job.t_first or time.perf_counter()
                    job.put((piece, [(produced, e) for e in pending]))
                    pending.clear()
                    produced += len(piece)
                    self._sample()
                    if job.stopped.is_set():
                        break
            finally:
                gen.close()
            if pending:  # tokens that wrote no text (a control token before the end)
                job.put(("", [(produced, e) for e in pending]))
            self._sample(force=True)
        except _core.CancelledError:
            # The client left or a stop string matched: nothing more to say. (A failure here
            # leaves through the finally below, which still ends the request.)
            self._sample(force=True)
        except BaseException as e:  # noqa: BLE001 - handed to the request, which answers it
            job.error = e
        finally:
            job.n_generated = len(s.last_tokens)
            # A cancelled decode appended nothing, so the cache holds a prefix of prompt + sampled.
            self._history = [] if job.error else (job.prompt_ids + s.last_tokens)[: s.n_past]
            job.t_end = time.perf_counter()
            with self._state:
                self._current = None
                s.clear_cancel()
                self.counts["requests"] += 1
                self.counts["cancelled"] += job.stopped.is_set()
                self.counts["completion_tokens"] += job.n_generated
                self.counts["prompt_tokens_reused"] += job.n_reused
                self.counts["prompt_tokens_prefilled"] += len(job.prompt_ids) - job.n_reused
            full = job.n_generated >= job.options["max_tokens"] or s.n_past >= self.n_ctx
            job.finish_reason = "length" if full and not job.stopped.is_set() else "stop"
            job.put(_END)


async def _pieces(engine: Engine, job: Job, stops: list):
    """(text, logprob entries) of a Job as it streams, cut at the first stop string; cancels the
    Job when the caller stops early (a stop string, a disconnect: asyncio cancels us at an await).
    An entry goes out with the text its token's text begins in; entries of tokens that begin at or
    after a stop string are dropped with their text."""
    scan = StopScanner(stops)
    waiting: list = []  # (offset, entry) whose text the scanner has not let out yet
    emitted = 0  # characters let out

    def release(everything: bool = False) -> list:
        nonlocal waiting
        out = [w for w in waiting if everything or w[0] < emitted]
        waiting = waiting[len(out) :]
        return out

    finished = False
    try:
        while True:
            item = await job.queue.get()
            if item is _END:
                finished = True
                break
            text, entries = item
            waiting += entries
            text, hit = scan.push(text)
            emitted += len(text)
            out = release()
            if text or out:
                yield text, out
            if hit:
                engine.cancel(job)
                job.finish_reason = "stop"
                while await job.queue.get() is not _END:
                    pass
                finished = True
                return
        tail = scan.flush()
        out = release(everything=True)
        if tail or out:
            yield tail, out
    finally:
        if not finished:
            engine.cancel(job)
    if job.error is not None:
        raise job.error


# ------------------------------------------------------------------ app


def create_app(engine: Engine, model_id: str, chat_template: str | None = None,
               template_kwargs: dict | None = None):
    """The Starlette application serving `engine` under the model name `model_id`; chat requests
    use `chat_template`, None for the model's own, with `template_kwargs` (--chat-template-kwargs)
    under a request's own chat_template_kwargs."""
    template_kwargs = template_kwargs or {}
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect, Request
    from starlette.responses import HTMLResponse, JSONResponse, StreamingResponse
    from starlette.routing import Route

    from . import _core

    created = int(time.time())
    with open(os.path.join(os.path.dirname(__file__), "web", "index.html"), encoding="utf-8") as f:
        page_html = f.read()

    def error_response(e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    async def read_body(request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except ClientDisconnect:
            raise ApiError(400, "the client went away before sending its request") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != model_id:
            raise ApiError(404, f"the model '{model}' does not exist; this server has '{model_id}'",
                           param="model", code="model_not_found")
        return body

    def usage(job: Job) -> dict:
        n_prompt = len(job.prompt_ids)
        return {"prompt_tokens": n_prompt, "completion_tokens": job.n_generated,
                "total_tokens": n_prompt + job.n_generated,
                "prompt_tokens_details": {"cached_tokens": job.n_reused}}

    def timings(job: Job) -> dict:
        """Beside `usage`, as llama.cpp's server reports them: time to the first text (prefill and
        one sample) and the decode rate after it, on the worker's clock."""
        t_first = job.t_first or job.t_end
        steps = max(job.n_generated - 1, 0)
        decode_s = job.t_end - t_first
        return {"prompt_n": len(job.prompt_ids), "cache_n": job.n_reused, "ttft_ms": (t_first - job.t_start) * 1e3,
                "predicted_n": job.n_generated, "predicted_ms": decode_s * 1e3,
                "predicted_per_second": steps / decode_s if steps and decode_s > 0 else 0.0}

    async def wait_disconnect(request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def complete(request: Request, chat: bool):
        try:
            body = await read_body(request)
            tok = engine.session.tokenizer
            if chat:
                prompt_ids = encode_chat(tok, _chat_messages(body), template=chat_template,
                                         **{**template_kwargs, **_template_kwargs(body)})
            else:
                prompt_ids = tok.encode(_completion_prompt(body))
            options = sampling_options(body, len(prompt_ids), engine.n_ctx)
            stops = _stop_strings(body)
            n_top = _logprob_request(body, chat)
            if not isinstance(body.get("stream", False), bool):
                raise ApiError(400, "'stream' must be true or false", param="stream")
            if not isinstance(body.get("stream_options") or {}, dict):
                raise ApiError(400, "'stream_options' must be an object", param="stream_options")
        except ApiError as e:
            return error_response(e)
        except _core.SharpiError as e:  # a template that refuses these messages, a bad token
            return error_response(ApiError(400, str(e)))

        job = engine.submit(prompt_ids, options, n_top)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        head = {"id": rid, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": model_id}

        def choice(text: str | None, finish: str | None, entries: list, first: bool = False) -> dict:
            """One choice (a whole answer or a streamed chunk of it) with the logprob entries of
            its tokens, when they were asked for."""
            if not chat:
                lp = None if n_top is None else completion_logprobs(entries)
                return {"index": 0, "text": text or "", "logprobs": lp, "finish_reason": finish}
            key = "delta" if body.get("stream") else "message"
            msg = {} if text is None else {"content": text}
            if first or key == "message":
                msg = {"role": "assistant", **msg}
            lp = None if n_top is None or first else {"content": [e for _, e in entries], "refusal": None}
            return {"index": 0, key: msg, "logprobs": lp, "finish_reason": finish}

        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            chunk_head = {**head, "object": "chat.completion.chunk"} if chat else head

            def event(data: dict) -> str:
                return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

            async def events():
                if chat:
                    yield event({**chunk_head, "choices": [choice("", None, [], first=True)]})
                try:
                    async for text, entries in _pieces(engine, job, stops):
                        yield event({**chunk_head, "choices": [choice(text, None, entries)]})
                except Exception as e:  # noqa: BLE001 - the status line is sent: report in-stream
                    yield event(ApiError(500, f"generation failed: {e}").body())
                    return
                yield event({**chunk_head, "choices": [choice(None, job.finish_reason, [])]})
                if include_usage:
                    yield event({**chunk_head, "choices": [], "usage": usage(job), "timings": timings(job)})
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        # Not streamed: gather the text, cancelling the job if the client goes away meanwhile.
        async def gather() -> tuple[str, list]:
            parts = [p async for p in _pieces(engine, job, stops)]
            return "".join(t for t, _ in parts), [e for _, entries in parts for e in entries]

        gather_task = asyncio.ensure_future(gather())
        gone = asyncio.ensure_future(wait_disconnect(request))
        await asyncio.wait({gather_task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not gather_task.done():
            gather_task.cancel()
            engine.cancel(job)
            return JSONResponse({}, status_code=499)
        gone.cancel()
        try:
            text, entries = gather_task.result()
        except Exception as e:  # noqa: BLE001
            return error_response(ApiError(500, f"generation failed: {e}"))
        return JSONResponse({**head, "choices": [choice(text, job.finish_reason, entries)], "usage": usage(job),
                             "timings": timings(job)})

    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    async def completions(request: Request):
        return await complete(request, chat=False)

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [
            {"id": model_id, "object": "model", "created": created, "owned_by": "sharpi"}]})

    async def stats(request: Request):
        with engine._state:
            counts, busy = dict(engine.counts), engine._current is not None
        return JSONResponse({**counts, "busy": busy, "live": engine.live.view()})

    async def page(request: Request):
        return HTMLResponse(page_html)

    async def health(request: Request):
        return JSONResponse({"status": "ok"})

    async def http_error(request: Request, exc: HTTPException):
        return error_response(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}"))

    async def server_error(request: Request, exc: Exception):
        # A bug, not a bad request: still OpenAI's shape, so clients show the message.
        return error_response(ApiError(500, f"{type(exc).__name__}: {exc}"))

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/v1/sharpi/stats", stats, methods=["GET"]),
            Route("/", page, methods=["GET"]),
        ],
        exception_handlers={HTTPException: http_error, Exception: server_error},
    )


# ------------------------------------------------------------------ command


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


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
    p.add_argument("--chat-template-kwargs", type=_json_object, default={}, metavar="JSON",
                   help="keyword arguments for the template, e.g. '{\"enable_thinking\": false}' "
                        "(serve: a request's chat_template_kwargs go on top)")
    add_compute_arguments(p)
    add_streaming_arguments(p)


def load_model(args):
    """(Session, chat template) from add_model_arguments' options: the template is the file's
    text, None for the model's own, or ChatML when the model has none."""
    from .progress import open_session

    if args.model is None:
        from .models import default_model_path

        args.model = default_model_path()
    if not os.path.isfile(args.model):
        raise FileNotFoundError(f"{args.model}: no such file")
    session = open_session(args.model, **session_options(args))
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
    add_model_arguments(p)
    return p


def cmd_serve(args, out: TextIO, err: TextIO) -> int:
    try:
        import uvicorn
    except ImportError as e:
        raise ImportError(f"{e}; install the serve extra: pip install 'sharpi[serve]'") from None
    session, template = load_model(args)
    model_id = args.alias or os.path.basename(args.model)
    app = create_app(Engine(session), model_id, template, args.chat_template_kwargs)
    err.write(f"sharpi: serving {model_id} on http://{args.host}:{args.port}/v1\n")
    err.flush()
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    session.close()
    return 0
