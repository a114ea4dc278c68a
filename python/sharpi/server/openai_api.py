"""The OpenAI protocol: POST /v1/chat/completions and /v1/completions (server-sent events with
"stream": true) and GET /v1/models. Request bodies are checked and turned into Session.generate
options here (OpenAI's names, limits and defaults); a bad one is an ApiError naming the field.
Chat messages are rendered with the served chat template (prompt.render_chat) with the request's
`tools`, `documents` and `chat_template_kwargs`. A request's sampling fields override the server's
defaults (ServedModel.sampling_defaults, `sharpi serve`'s sampling flags), which are OpenAI's when
no flag is given. Responses carry `usage`, and `timings` as llama.cpp's server reports them.

Runs on the event loop, except rendering and tokenizing prompts, which run in Starlette's thread
pool; the only Session calls it makes go through Engine (submit, cancel).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from .. import _core
from . import agents
from .body import read_json, require_unicode
from .errors import ApiError
from .logprobs import completion_logprobs
from .prompt import RESERVED_TEMPLATE_KWARGS, encode_rendered_chat, fit_tool_calls, render_chat
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


# What a request that names no sampling field gets when `sharpi serve` is given no sampling flag:
# OpenAI's defaults (temperature 1, top_p 1, no top-k / min-p / penalties), every token up to the
# end of the context. Keys as Session.generate's (cli_args.sampling_options gives the same keys).
OPENAI_SAMPLING_DEFAULTS = {"max_tokens": -1, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                            "repeat_penalty": 1.0, "seed": None}


def sampling_options(body: dict, n_prompt: int, n_ctx: int, defaults: dict | None = None) -> dict:
    """Session.generate keyword arguments from an OpenAI request body. A field the request leaves
    out takes its value from `defaults` (`sharpi serve`'s sampling flags, as
    cli_args.sampling_options gives them; default OPENAI_SAMPLING_DEFAULTS); a default max_tokens
    of N >= 0 is cut to what the context has left, -1 is all of it."""
    defaults = {**OPENAI_SAMPLING_DEFAULTS, **(defaults or {})}
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
    if max_tokens is None:
        max_tokens = n_ctx - n_prompt
        if defaults["max_tokens"] >= 0:
            max_tokens = min(max_tokens, defaults["max_tokens"])
    seed = _number(body, "seed", None, -(2**63), 2**63 - 1, integer=True)
    options = {
        **defaults,
        "max_tokens": max_tokens,
        "temperature": float(_number(body, "temperature", defaults["temperature"], 0.0, 2.0)),
        "top_p": float(_number(body, "top_p", defaults["top_p"], 0.0, 1.0)),
        "top_k": _number(body, "top_k", defaults["top_k"], 0, 2**31 - 1, integer=True),
        "min_p": float(_number(body, "min_p", defaults["min_p"], 0.0, 1.0)),
        "repeat_penalty": float(_number(body, "repeat_penalty", defaults["repeat_penalty"], 0.0, 10.0)),
        "seed": defaults["seed"] if seed is None else seed & 0xFFFFFFFF,
    }
    if options["repeat_penalty"] <= 0:
        raise ApiError(400, f"'repeat_penalty' must be above 0 (1 is off), got {body['repeat_penalty']!r}",
                       param="repeat_penalty")
    if options["top_p"] == 0:
        # OpenAI allows top_p 0: the nucleus keeps only the most likely token (llama.cpp keeps at
        # least one), which is top_k 1; the sampler itself takes top_p in (0, 1].
        options.update(top_p=1.0, top_k=1)
    # OpenAI's penalties, -2..2: present only when not 0, as cli_args.sampling_options leaves them.
    for penalty in ("presence_penalty", "frequency_penalty"):
        value = float(_number(body, penalty, defaults.get(penalty, 0.0), -2.0, 2.0))
        options.pop(penalty, None)
        if value:
            options[penalty] = value
    return options


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
            texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if not all(isinstance(t, str) for t in texts):
                raise ApiError(400, f"messages[{i}].content: a text part's 'text' must be a string",
                               param=f"messages[{i}].content")
            content = "".join(texts)
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
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(extra))
    if reserved:
        raise ApiError(400, f"'chat_template_kwargs' may not set {', '.join(reserved)}",
                       param="chat_template_kwargs")
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



# ------------------------------------------------------------------ prompts (worker threads)

# Rendering and tokenizing a long prompt takes seconds: these run in Starlette's thread pool, off
# the event loop (the Tokenizer is immutable, shared with the engine's thread; its encode releases
# the GIL). A text that must be more tokens than the context holds is refused before it is
# tokenized: freeing a megabyte's tokenization holds the GIL for tens of milliseconds.


def _refuse_if_surely_too_long(served: ServedModel, text: str, param: str) -> None:
    """ApiError 400 when `text` has more bytes than n_ctx - 1 tokens can stand for."""
    per_token, n_ctx = served.max_token_bytes, served.engine.n_ctx
    if per_token is None or len(text) * 4 <= (n_ctx - 1) * per_token:  # a character is 1 to 4 bytes
        return
    n_bytes = len(text.encode("utf-8"))
    if n_bytes > (n_ctx - 1) * per_token:
        raise ApiError(400, f"the prompt is {-(-n_bytes // per_token)} tokens or more ({n_bytes} bytes, at most "
                       f"{per_token} a token); this model's context is {n_ctx} tokens", param=param,
                       code="context_length_exceeded")


def _chat_prompt_ids(served: ServedModel, messages: list, template_kwargs: dict) -> list:
    tok = served.engine.tokenizer
    messages = fit_tool_calls(tok, served.chat_template, messages)
    text = render_chat(tok, messages, served.chat_template, **template_kwargs)
    require_unicode(text, "messages")
    _refuse_if_surely_too_long(served, text, "messages")
    return encode_rendered_chat(tok, text)


def _completion_prompt_ids(served: ServedModel, prompt: str) -> list:
    require_unicode(prompt, "prompt")
    _refuse_if_surely_too_long(served, prompt, "prompt")
    return served.engine.tokenizer.encode(prompt)


# ------------------------------------------------------------------ responses


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def read_body(request: Request, served: ServedModel) -> dict:
    """The request's JSON object (body.read_json); a `model` other than the served one is a 404."""
    body = await read_json(request, served.max_body)
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
        chat_plan = None
        if chat:
            messages, kwargs = _chat_messages(body), {**served.template_kwargs, **_template_kwargs(body)}
            template = served.chat_template or engine.tokenizer.chat_template
            chat_plan, messages = await run_in_threadpool(agents.plan, body, engine.tokenizer, template, messages)
            prompt_ids = await run_in_threadpool(_chat_prompt_ids, served, messages, kwargs)
        else:
            for name in ("tools", "tool_choice", "response_format", "grammar"):
                if body.get(name) is not None:
                    raise ApiError(400, f"'{name}' is a chat completions parameter", param=name)
            prompt_ids = await run_in_threadpool(_completion_prompt_ids, served, _completion_prompt(body))
        options = sampling_options(body, len(prompt_ids), engine.n_ctx, served.sampling_defaults)
        if chat_plan is not None and served.reasoning_format == "none":
            chat_plan.markers = None
        if chat_plan is not None and chat_plan.markers is not None:  # a prompt that opened a think block
            chat_plan.start_in_reasoning = agents.reasoning.starts_in_reasoning(
                engine.tokenizer.decode(prompt_ids[-16:]), chat_plan.markers)
        if chat_plan is not None and chat_plan.mask is not None:
            options["logits_processor"] = chat_plan.mask
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
            buffered = chat_plan is not None and chat_plan.tools is not None
            splitter = None
            if chat_plan is not None and chat_plan.markers is not None:
                splitter = agents.reasoning.ReasoningSplitter(chat_plan.markers, chat_plan.start_in_reasoning)

            def reasoning_delta(thought: str, said: str, entries: list) -> dict:
                out = choice(said, None, entries)
                out["delta"] = {**({"reasoning_content": thought} if thought else {}),
                                **({"content": said} if said else {})}
                return out
            parts = []
            try:
                async for text, entries in stream_until_stop(engine, job, stops):
                    if buffered:  # a reply that may hold calls is parsed whole (module docstring of agents)
                        parts.append(text)
                    elif splitter is not None:
                        thought, said = splitter.push(text)
                        yield event({**chunk_head, "choices": [reasoning_delta(thought, said, entries)]})
                    else:
                        yield event({**chunk_head, "choices": [choice(text, None, entries)]})
            except Exception as e:  # noqa: BLE001 - the status line is sent: report in-stream
                yield event(ApiError(500, f"generation failed: {e}").body())
                return
            finish = job.finish_reason
            if splitter is not None and not buffered:
                thought, said = splitter.flush()
                if thought or said:
                    yield event({**chunk_head, "choices": [reasoning_delta(thought, said, [])]})
            if buffered:
                msg, finish = agents.message(chat_plan, "".join(parts), engine.tokenizer, job.tokens, finish)
                delta = {k: v for k, v in msg.items() if k in ("content", "reasoning_content") and v}
                if msg.get("tool_calls"):
                    delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(msg["tool_calls"])]
                if delta:
                    yield event({**chunk_head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                            "finish_reason": None}]})
            yield event({**chunk_head, "choices": [choice(None, finish, [])]})
            request.state.generation = timings(job)  # for the access log line
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
    request.state.generation = timings(job)  # for the access log line
    answer = choice(text, job.finish_reason, entries)
    if chat:
        answer["message"], answer["finish_reason"] = agents.message(chat_plan, text, engine.tokenizer, job.tokens,
                                                                    job.finish_reason)
    return JSONResponse({**head, "choices": [answer], "usage": usage(job), "timings": request.state.generation})


def models(served: ServedModel, created: int) -> dict:
    """GET /v1/models: the one served model."""
    return {"object": "list", "data": [
        {"id": served.model_id, "object": "model", "created": created, "owned_by": "sharpi"}]}
