"""The OpenAI protocol: POST /v1/chat/completions and /v1/completions (server-sent events with
"stream": true) and GET /v1/models. Request bodies are checked and turned into Session.generate
options here (OpenAI's names, limits and defaults); a bad one is an ApiError naming the field.
Chat messages are rendered with the served chat template (prompt.encode_chat) with the request's
`tools`, `documents` and `chat_template_kwargs`. Responses carry `usage`, and `timings` as
llama.cpp's server reports them.

Runs on the event loop; the only Session call it makes is through Engine (submit, cancel).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, StreamingResponse

from .. import _core
from .errors import ApiError
from .logprobs import completion_logprobs
from .prompt import encode_chat
from .scheduler import Job
from .served import ServedModel
from .stops import stream_until_stop


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



# ------------------------------------------------------------------ responses


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def read_body(request: Request, served: ServedModel) -> dict:
    """The request's JSON object; a `model` other than the served one is a 404."""
    try:
        body = json.loads(await request.body())
    except ClientDisconnect:
        raise ApiError(400, "the client went away before sending its request") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != served.model_id:
        raise ApiError(404, f"the model '{model}' does not exist; this server has '{served.model_id}'",
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


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ------------------------------------------------------------------ handlers


async def complete(request: Request, served: ServedModel, chat: bool):
    """POST /v1/chat/completions (chat) or /v1/completions: one generation, whole or streamed."""
    engine = served.engine
    try:
        body = await read_body(request, served)
        tok = engine.session.tokenizer
        if chat:
            prompt_ids = encode_chat(tok, _chat_messages(body), template=served.chat_template,
                                     **{**served.template_kwargs, **_template_kwargs(body)})
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
            "created": int(time.time()), "model": served.model_id}

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
                async for text, entries in stream_until_stop(engine, job, stops):
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
        parts = [p async for p in stream_until_stop(engine, job, stops)]
        return "".join(t for t, _ in parts), [e for _, entries in parts for e in entries]

    gather_task = asyncio.ensure_future(gather())
    gone = asyncio.ensure_future(_wait_disconnect(request))
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


def models(served: ServedModel, created: int) -> dict:
    """GET /v1/models: the one served model."""
    return {"object": "list", "data": [
        {"id": served.model_id, "object": "model", "created": created, "owned_by": "sharpi"}]}
