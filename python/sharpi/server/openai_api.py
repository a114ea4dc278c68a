"""The OpenAI protocol: POST /v1/chat/completions and /v1/completions (server-sent events with
"stream": true) and GET /v1/models. Request bodies are checked and turned into Session.generate
options here (OpenAI's names, limits and defaults); a bad one is an ApiError naming the field.
Chat messages are rendered with the served chat template (prompt.render_chat) with the request's
`tools`, `documents` and `chat_template_kwargs`, earlier tool calls in the form the template writes
them (prompt.fit_tool_calls). A request is n choices per prompt (completions take several prompts,
as strings or token ids), one Job each, queued together; `echo` puts the prompt before each choice,
`suffix` makes a fill-in-the-middle prompt (prompt.fim_prompt_ids). An OpenAI field whose effect
sharpi lacks is a 400 naming it (refuse_unsupported). A request's sampling fields override the server's
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

import numpy as np
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from .. import _core
from . import agents
from .body import read_json, require_unicode
from .errors import ApiError
from .logprobs import completion_logprobs
from .prompt import (
    RESERVED_TEMPLATE_KWARGS,
    encode_rendered_chat,
    fim_prompt_ids,
    fit_tool_calls,
    render_chat,
)
from .scheduler import Job, QueueFull
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
    # The sampler takes float32: a value that rounds to 0 there is 0 (1e-300 must not reach it).
    if np.float32(options["repeat_penalty"]) <= 0:
        raise ApiError(400, f"'repeat_penalty' must be above 0 (1 is off), got {body['repeat_penalty']!r}",
                       param="repeat_penalty")
    if np.float32(options["top_p"]) == 0:
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


# The most choices a request may ask for (n, and prompts times n): each is a generation of its own.
MAX_N = 16
MAX_PROMPTS = 16

# OpenAI request fields sharpi takes and ignores: annotations that change no token of the answer
# (user, metadata, safety_identifier) and prompt-cache hints (sharpi reuses the cache's longest
# common prefix for every request anyway; prompt.reuse_prefix).
IGNORED_FIELDS = ("user", "metadata", "safety_identifier", "prompt_cache_key", "prompt_cache_options",
                  "prompt_cache_retention")


def refuse_unsupported(body: dict, chat: bool) -> None:
    """ApiError 400 naming an OpenAI request field whose effect sharpi does not have (never a field
    silently dropped): each field of openai-python's create() (chat and completions) is taken,
    refused here, or in IGNORED_FIELDS."""
    def refuse(name: str, why: str) -> None:
        raise ApiError(400, f"'{name}' {why}", param=name)

    if body.get("store") not in (None, False):
        refuse("store", "is not supported: sharpi keeps no completions (store: false or leave it out)")
    if body.get("stream_options") is not None:
        opts = body["stream_options"]
        if not isinstance(opts, dict):
            refuse("stream_options", "must be an object")
        if not body.get("stream"):
            refuse("stream_options", "is only allowed with 'stream': true")
        for key, value in opts.items():
            if key not in ("include_usage", "include_obfuscation"):
                refuse("stream_options", f"has no field {key!r} (include_usage, include_obfuscation)")
            if not isinstance(value, bool):
                refuse("stream_options", f"{key} must be true or false")
    if not chat:
        if body.get("best_of") not in (None, 1):
            refuse("best_of", "is not supported: ask for n choices and pick among them (best_of: 1)")
        return
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        refuse("modalities", "must be [\"text\"]: sharpi generates text only")
    for name, why in (("audio", "is not supported: sharpi generates text only"),
                      ("prediction", "(predicted outputs) is not supported"),
                      ("web_search_options", "is not supported: sharpi does not search the web"),
                      ("moderation", "is not supported"),
                      ("functions", "is deprecated and not supported: use 'tools'"),
                      ("function_call", "is deprecated and not supported: use 'tool_choice'"),
                      ("verbosity", "is not supported")):
        if body.get(name) is not None:
            refuse(name, why)
    if body.get("service_tier") not in (None, "auto", "default"):
        refuse("service_tier", "must be 'auto' or 'default': sharpi has one tier")
    if body.get("parallel_tool_calls") is not None and not isinstance(body["parallel_tool_calls"], bool):
        refuse("parallel_tool_calls", "must be true or false")


def logit_bias(body: dict, n_vocab: int, default) -> dict | None:
    """OpenAI's logit_bias, {"token id": bias in -100..100}, as Session.generate's {id: bias};
    the server's default (--logit-bias) when the request names none."""
    bias = body.get("logit_bias")
    if bias is None:
        return default
    if not isinstance(bias, dict):
        raise ApiError(400, "'logit_bias' must be an object of token ids to biases", param="logit_bias")
    out = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isdigit() and int(key) < n_vocab):
            raise ApiError(400, f"logit_bias: {key!r} is not a token id in 0..{n_vocab - 1}", param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise ApiError(400, f"logit_bias[{key!r}] must be a number in -100..100, got {value!r}",
                           param="logit_bias")
        out[int(key)] = float(value)
    return out


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
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    # No model sharpi runs can see or hear: refused, never silently dropped.
                    what = f"a '{kind}' part" if isinstance(kind, str) else "a part without a string 'type'"
                    raise ApiError(400, f"messages[{i}].content[{j}] is {what}: sharpi's models take text "
                                   "parts only (no image, audio or file input)",
                                   param=f"messages[{i}].content[{j}]")
            texts = [p.get("text") for p in content]
            if not all(isinstance(t, str) for t in texts):
                raise ApiError(400, f"messages[{i}].content: a text part's 'text' must be a string",
                               param=f"messages[{i}].content")
            content = "".join(texts)
        if content is not None and not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts",
                           param=f"messages[{i}].content")
        out.append({**m, "content": "" if content is None else content})
    return out


# Template variables whose type the templates that read them assume: Qwen3's `enable_thinking is
# false`, gpt-oss's "Reasoning: " + reasoning_effort (a number there would fail the render).
TEMPLATE_KWARG_TYPES = {"enable_thinking": bool, "reasoning_effort": str}
REASONING_EFFORTS = ("low", "medium", "high")


def _template_kwargs(body: dict) -> dict:
    """What a chat request hands the template besides messages: `tools` and `documents` when given
    (templates test `tools is defined`), `reasoning_effort` (gpt-oss's "Reasoning: low|medium|high"
    system line) and `chat_template_kwargs` (enable_thinking, ...; a request's reasoning_effort
    wins over one given there)."""
    extra = body.get("chat_template_kwargs") or {}
    if not isinstance(extra, dict):
        raise ApiError(400, "'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(extra))
    if reserved:
        raise ApiError(400, f"'chat_template_kwargs' may not set {', '.join(reserved)}",
                       param="chat_template_kwargs")
    for name, kind in TEMPLATE_KWARG_TYPES.items():
        if name in extra and not isinstance(extra[name], kind):
            raise ApiError(400, f"chat_template_kwargs '{name}' must be a {kind.__name__}, got {extra[name]!r}",
                           param="chat_template_kwargs")
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise ApiError(400, f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}",
                           param="reasoning_effort")
        extra = {**extra, "reasoning_effort": effort}
    for name in ("tools", "documents"):
        if body.get(name) is not None:
            if not isinstance(body[name], list):
                raise ApiError(400, f"'{name}' must be a list", param=name)
            extra = {**extra, name: body[name]}
    return extra


def _completion_prompts(body: dict, n_vocab: int) -> list:
    """The prompts of a completions request, each a str or a list of token ids: `prompt` is a
    string, a list of token ids, a list of strings or a list of token-id lists (OpenAI's and
    llama-server's four forms); each prompt is its own choices."""
    prompt = body.get("prompt")

    def token_ids(ids: list, where: str) -> list:
        for i, t in enumerate(ids):
            if type(t) is not int:
                raise ApiError(400, f"{where}[{i}] must be a token id (an integer), got {t!r}", param="prompt")
            if not 0 <= t < n_vocab:
                raise ApiError(400, f"{where}[{i}]: token id {t} is not in the vocabulary (0..{n_vocab - 1})",
                               param="prompt")
        return ids

    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        prompts = [token_ids(prompt, "prompt")]
    elif isinstance(prompt, list) and prompt:
        prompts = []
        for k, p in enumerate(prompt):
            if isinstance(p, list) and p:
                prompts.append(token_ids(p, f"prompt[{k}]"))
            elif isinstance(p, str):
                prompts.append(p)
            else:
                raise ApiError(400, f"prompt[{k}] must be a string or a non-empty list of token ids", param="prompt")
    else:
        raise ApiError(400, "'prompt' must be a string, a list of strings, a list of token ids or a list of "
                       "token-id lists", param="prompt")
    if any(p == "" for p in prompts):
        raise ApiError(400, "'prompt' must not be empty", param="prompt")
    if len(prompts) > MAX_PROMPTS:
        raise ApiError(400, f"at most {MAX_PROMPTS} prompts a request, got {len(prompts)}", param="prompt")
    return prompts


def _logprob_request(body: dict, chat: bool) -> int | None:
    """How many alternatives each generated token's log-probability entry lists, None for no
    entries. Chat: `logprobs` true/false and `top_logprobs` 0..20; completions: `logprobs` 0..5
    (OpenAI's limits)."""
    if chat:
        want = body.get("logprobs")
        if want not in (None, True, False):
            raise ApiError(400, f"'logprobs' must be true or false, got {want!r}", param="logprobs")
        n_top = _number(body, "top_logprobs", None, 0, 20, integer=True)
        if n_top is not None and not want:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        return (n_top or 0) if want else None
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


def _chat_prompt_ids(served: ServedModel, messages: list, template_kwargs: dict, prefill: str = "") -> list:
    tok = served.engine.tokenizer
    messages = fit_tool_calls(tok, served.chat_template, messages)
    text = render_chat(tok, messages, served.chat_template, **template_kwargs) + prefill
    require_unicode(text, "messages")
    _refuse_if_surely_too_long(served, text, "messages")
    return encode_rendered_chat(tok, text)


def _completion_prompt_ids(served: ServedModel, prompt, suffix: str | None) -> list:
    """The ids of one completions prompt (a str or token ids), in fill-in-the-middle form with a suffix."""
    tok = served.engine.tokenizer
    if suffix is not None:
        text = prompt if isinstance(prompt, str) else tok.decode(prompt)
        require_unicode(text, "prompt")
        _refuse_if_surely_too_long(served, text + suffix, "prompt")
        return fim_prompt_ids(tok, served.engine.fim_ids, text, suffix)
    if not isinstance(prompt, str):
        return list(prompt)
    require_unicode(prompt, "prompt")
    _refuse_if_surely_too_long(served, prompt, "prompt")
    return tok.encode(prompt)


async def chat_prompt(served: ServedModel, body: dict, messages: list, template_kwargs: dict | None = None,
                      prefill: str = "") -> tuple[agents.ChatPlan, list]:
    """The ChatPlan and prompt ids of chat `messages` under a request body in OpenAI's shape (its
    tools, tool_choice, response_format, grammar: agents.plan), rendered with the served template
    and the body's template variables (_template_kwargs) on top of the server's, and
    `template_kwargs` on top of those; `prefill` (Anthropic's final assistant text) is written
    after the generation prompt, for the reply to continue."""
    engine = served.engine
    template = served.chat_template or engine.tokenizer.chat_template
    kwargs = {**served.template_kwargs, **_template_kwargs(body), **(template_kwargs or {})}
    plan, messages = await run_in_threadpool(agents.plan, body, engine.tokenizer, template, messages)
    prompt_ids = await run_in_threadpool(_chat_prompt_ids, served, messages, kwargs, prefill)
    if served.reasoning_format == "none":
        plan.markers = None
    if plan.markers is not None:  # a prompt that opened a think block
        plan.start_in_reasoning = agents.reasoning.starts_in_reasoning(
            engine.tokenizer.decode(prompt_ids[-16:]), plan.markers)
        await run_in_threadpool(agents.close_reasoning_first, plan, engine.tokenizer)
    return plan, prompt_ids


def chat_options(served: ServedModel, body: dict, plan: agents.ChatPlan, prompt_ids: list) -> dict:
    """Session.generate options of a chat request (sampling_options) with its grammar's mask."""
    options = sampling_options(body, len(prompt_ids), served.engine.n_ctx, served.sampling_defaults)
    if plan.mask is not None:
        options["logits_processor"] = plan.mask
    return options


# ------------------------------------------------------------------ responses


def error_response(e: ApiError) -> JSONResponse:
    # A full queue (503) says when to try again, as llama-server and OpenAI's overloaded answers do.
    headers = {"Retry-After": "1"} if e.status == 503 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def submit_all(engine, specs: list) -> list:
    """Jobs for the (prompt ids, options, Engine.submit keywords) of one request, all or none:
    when the queue cannot take them all, the ones queued are cancelled and it is ApiError 503."""
    jobs = []
    try:
        for ids, options, kwargs in specs:
            jobs.append(engine.submit(ids, options, **kwargs))
    except QueueFull as e:
        for job in jobs:
            engine.cancel(job)
        raise ApiError(503, str(e), code="queue_full") from None
    return jobs


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


async def gather_unless_gone(request: Request, engine, job: Job, stops: list) -> tuple[str, list] | None:
    """A Job's whole text (cut at the first stop string) and its logprob entries, or None when the
    client went away first (the job is cancelled then). Leaves the Job's timings for the access log."""
    async def gather() -> tuple[str, list]:
        parts = [p async for p in stream_until_stop(engine, job, stops)]
        return "".join(t for t, _ in parts), [e for _, entries in parts for e in entries]

    gather_task = asyncio.ensure_future(gather())
    gone = asyncio.ensure_future(_wait_disconnect(request))
    await asyncio.wait({gather_task, gone}, return_when=asyncio.FIRST_COMPLETED)
    if not gather_task.done():
        gather_task.cancel()
        engine.cancel(job)
        return None
    gone.cancel()
    result = gather_task.result()
    request.state.generation = timings(job)  # for the access log line
    return result


def reply_delta(event: tuple) -> dict:
    """The chat.completion.chunk delta of one agents.ReplyStream event: tool calls as OpenAI streams
    them, the first chunk of a call with its index, id, type, name and empty arguments, then its
    argument fragments under the same index."""
    kind = event[0]
    if kind == "reasoning":
        return {"reasoning_content": event[1]}
    if kind == "content":
        return {"content": event[1]}
    if kind == "call":
        return {"tool_calls": [{"index": event[1], "id": event[2], "type": "function",
                                "function": {"name": event[3], "arguments": ""}}]}
    return {"tool_calls": [{"index": event[1], "function": {"arguments": event[2]}}]}


# ------------------------------------------------------------------ handlers


def _suffix(body: dict, served: ServedModel) -> str | None:
    """A completions request's `suffix` (fill-in-the-middle), None without one; ApiError 400 when
    the model has no fill-in-the-middle tokens or it is combined with echo."""
    suffix = body.get("suffix")
    if suffix is None:
        return None
    if not isinstance(suffix, str):
        raise ApiError(400, "'suffix' must be a string", param="suffix")
    if served.engine.fim_ids is None:
        raise ApiError(400, "'suffix' (fill-in-the-middle) needs a model whose vocabulary has fill-in-the-middle "
                       "tokens (tokenizer.ggml.fim_pre/suf/mid_token_id, or <|fim_prefix|> <|fim_suffix|> "
                       "<|fim_middle|>); this one has none", param="suffix")
    if body.get("echo"):
        raise ApiError(400, "'suffix' and 'echo' cannot be combined", param="suffix")
    require_unicode(suffix, "suffix")
    return suffix


def choice_seed(seed: int | None, sample: int) -> int | None:
    """The seed of a prompt's sample `sample` (0..n-1) when a request asks for n choices: the
    request's seed (or the server's --seed) plus the sample's index, modulo 2**32, so choice k of a
    seeded request equals the single-choice request with seed + k. None stays None (a seed from the
    clock per choice)."""
    return None if seed is None else (seed + sample) & 0xFFFFFFFF


def usage_of(jobs: list, n: int) -> dict:
    """`usage` of a request's jobs (n per prompt, in order): each prompt counted once, as OpenAI
    counts it for n choices; every choice's completion tokens."""
    firsts = jobs[::n]
    n_prompt = sum(len(j.prompt_ids) for j in firsts)
    n_completion = sum(j.n_generated for j in jobs)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion,
            "prompt_tokens_details": {"cached_tokens": sum(j.n_reused for j in firsts)}}


def timings_of(jobs: list, n: int) -> dict:
    """timings() of a request's jobs together: the first prompt's time to its first text, and the
    decode rate over all choices."""
    if len(jobs) == 1:
        return timings(jobs[0])
    firsts = jobs[::n]
    decode_s = sum(j.t_end - (j.t_first or j.t_end) for j in jobs)
    steps = sum(max(j.n_generated - 1, 0) for j in jobs)
    n_predicted = sum(j.n_generated for j in jobs)
    return {"prompt_n": sum(len(j.prompt_ids) for j in firsts), "cache_n": sum(j.n_reused for j in firsts),
            "ttft_ms": timings(jobs[0])["ttft_ms"], "predicted_n": n_predicted, "predicted_ms": decode_s * 1e3,
            "predicted_per_second": steps / decode_s if steps and decode_s > 0 else 0.0}


def _single_call(msg: dict, finish: str) -> tuple[dict, str]:
    """parallel_tool_calls false: at most one call, the first, in a reply that made several."""
    if msg.get("tool_calls") and len(msg["tool_calls"]) > 1:
        msg = {**msg, "tool_calls": msg["tool_calls"][:1]}
    return msg, finish


async def complete(request: Request, served: ServedModel, chat: bool):
    """POST /v1/chat/completions (chat) or /v1/completions: n choices per prompt (one job each,
    queued together so they run back to back and share the prompt's cache), whole or streamed."""
    engine = served.engine
    tok = engine.tokenizer
    try:
        body = await read_body(request, served)
        refuse_unsupported(body, chat)
        n = _number(body, "n", 1, 1, MAX_N, integer=True)
        chat_plan = None
        echo = False
        if chat:
            chat_plan, prompt_ids = await chat_prompt(served, body, _chat_messages(body))
            prompts = [prompt_ids]
            echo_texts, echo_from_ids = [None], [False]
        else:
            for name in ("tools", "tool_choice", "response_format", "grammar"):
                if body.get(name) is not None:
                    raise ApiError(400, f"'{name}' is a chat completions parameter", param=name)
            if not isinstance(body.get("echo", False), bool):
                raise ApiError(400, "'echo' must be true or false", param="echo")
            echo = bool(body.get("echo"))
            given = _completion_prompts(body, tok.n_vocab)
            suffix = _suffix(body, served)
            if len(given) * n > MAX_N:
                raise ApiError(400, f"{len(given)} prompts times n = {n} is {len(given) * n} choices; at most "
                               f"{MAX_N} a request", param="n")
            prompts = [await run_in_threadpool(_completion_prompt_ids, served, p, suffix) for p in given]
            # A string prompt echoes as given; token ids as their text, control tokens written (as
            # /detokenize writes them): echoed() offsets its tokens the same way.
            echo_texts = [(p if isinstance(p, str) else await run_in_threadpool(tok.decode, p)) if echo else None
                          for p in given]
            echo_from_ids = [not isinstance(p, str) for p in given]
        bias = logit_bias(body, tok.n_vocab, served.sampling_defaults.get("logit_bias"))
        options = []
        for ids in prompts:
            o = sampling_options(body, len(ids), engine.n_ctx, served.sampling_defaults)
            if bias:
                o["logit_bias"] = bias
            else:
                o.pop("logit_bias", None)
            options.append(o)
        stops = _stop_strings(body)
        n_top = _logprob_request(body, chat)
        if not isinstance(body.get("stream", False), bool):
            raise ApiError(400, "'stream' must be true or false", param="stream")
    except ApiError as e:
        return error_response(e)
    except _core.SharpiError as e:  # a template that refuses these messages, a bad token
        return error_response(ApiError(400, str(e)))

    specs = []
    for p, ids in enumerate(prompts):
        for k in range(n):
            o = {**options[p], "seed": choice_seed(options[p]["seed"], k)}
            if chat_plan is not None and chat_plan.mask is not None:
                o["logits_processor"] = chat_plan.mask if not specs else chat_plan.mask.fresh_copy()
            specs.append((ids, o, {"n_top": n_top, "keep_special": chat_plan is not None and bool(chat_plan.tools),
                                   "prompt_logprobs": echo and n_top is not None}))
    try:
        jobs = submit_all(engine, specs)
    except ApiError as e:
        return error_response(e)
    single_call = chat and body.get("parallel_tool_calls") is False
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    head = {"id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": served.model_id}

    def choice(index: int, text: str | None, finish: str | None, entries: list, first: bool = False) -> dict:
        """One choice (a whole answer or a streamed chunk of it) with the logprob entries of
        its tokens, when they were asked for."""
        if not chat:
            lp = None if n_top is None else completion_logprobs(entries)
            return {"index": index, "text": text or "", "logprobs": lp, "finish_reason": finish}
        key = "delta" if body.get("stream") else "message"
        msg = {} if text is None else {"content": text}
        if first or key == "message":
            msg = {"role": "assistant", **msg}
        lp = None if n_top is None or first else {"content": [e for _, e in entries], "refusal": None}
        return {"index": index, key: msg, "logprobs": lp, "finish_reason": finish}

    def echoed(index: int) -> tuple[str, list]:
        """The prompt's text and its tokens' (offset, entry) pairs that an echo choice starts with."""
        text = echo_texts[index // n]
        if n_top is None:
            return text, []
        # A string prompt's BOS (added by the tokenizer, not in the text) is at offset 0 and writes nothing.
        entries, offset, stream = [], 0, tok.stream(skip_special=not echo_from_ids[index // n])
        for e, token in zip(jobs[index].prompt_entries, jobs[index].prompt_ids):
            entries.append((offset, e))
            offset += len(stream.push(token))
        return text, entries

    def shifted(entries: list, by: int) -> list:
        return [(off + by, e) for off, e in entries] if by else entries

    if body.get("stream"):
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        chunk_head = {**head, "object": "chat.completion.chunk"} if chat else head

        def event(data: dict) -> str:
            return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

        async def choice_events(index: int, job: Job):
            """One choice's chunks, ending with its finish_reason."""
            if chat:
                yield event({**chunk_head, "choices": [choice(index, "", None, [], first=True)]})
            reply = agents.ReplyStream(chat_plan) if chat_plan is not None else None

            def chunks(reply_events: list, entries: list):
                """The chunks of one piece's events; its logprob entries ride on the first.
                parallel_tool_calls false: the events of calls after the first are dropped."""
                if single_call:
                    reply_events = [e for e in reply_events if e[0] not in ("call", "arguments") or e[1] == 0]
                deltas = [reply_delta(e) for e in reply_events] or ([{}] if entries else [])
                for k, delta in enumerate(deltas):
                    out = choice(index, None, None, entries if k == 0 else [])
                    out["delta"] = delta
                    yield event({**chunk_head, "choices": [out]})
            offset, echo_sent = 0, not echo

            def echo_event() -> str:
                # The prompt goes first, with its tokens' entries (the worker has them by the time
                # the first piece or the end arrives).
                prompt_text, prompt_entries = echoed(index)
                return event({**chunk_head, "choices": [choice(index, prompt_text, None, prompt_entries)]})
            async for text, entries in stream_until_stop(engine, job, stops):
                if not echo_sent:
                    yield echo_event()
                    offset, echo_sent = len(echo_texts[index // n]), True
                if reply is None:
                    yield event({**chunk_head, "choices": [choice(index, text, None, shifted(entries, offset))]})
                else:
                    for chunk in chunks(reply.push(text), entries):
                        yield chunk
            if not echo_sent:  # nothing generated: the prompt alone
                yield echo_event()
            finish = job.finish_reason
            if reply is not None:
                for chunk in chunks(reply.flush(), []):
                    yield chunk
                finish = "tool_calls" if reply.n_calls else finish
            yield event({**chunk_head, "choices": [choice(index, None, finish, [])]})

        async def events():
            try:
                for index, job in enumerate(jobs):
                    try:
                        async for chunk in choice_events(index, job):
                            yield chunk
                    except Exception as e:  # noqa: BLE001 - the status line is sent: report in-stream
                        yield event(ApiError(500, f"generation failed: {e}").body())
                        return
                request.state.generation = timings_of(jobs, n)  # for the access log line
                if include_usage:
                    yield event({**chunk_head, "choices": [], "usage": usage_of(jobs, n),
                                 "timings": timings_of(jobs, n)})
                yield "data: [DONE]\n\n"
            finally:
                for job in jobs:  # a client that left: the queued choices are skipped
                    engine.cancel(job)

        return StreamingResponse(events(), media_type="text/event-stream")

    # Not streamed: gather the texts, cancelling the jobs if the client goes away meanwhile.
    async def gather() -> list:
        out = []
        for job in jobs:
            parts = [p async for p in stream_until_stop(engine, job, stops)]
            out.append(("".join(t for t, _ in parts), [e for _, entries in parts for e in entries]))
        return out

    gather_task = asyncio.ensure_future(gather())
    gone = asyncio.ensure_future(_wait_disconnect(request))
    await asyncio.wait({gather_task, gone}, return_when=asyncio.FIRST_COMPLETED)
    if not gather_task.done():
        gather_task.cancel()
        for job in jobs:
            engine.cancel(job)
        return JSONResponse({}, status_code=499)
    gone.cancel()
    try:
        results = gather_task.result()
    except Exception as e:  # noqa: BLE001
        for job in jobs:
            engine.cancel(job)
        return error_response(ApiError(500, f"generation failed: {e}"))
    request.state.generation = timings_of(jobs, n)  # for the access log line
    choices = []
    for index, (job, (text, entries)) in enumerate(zip(jobs, results)):
        if echo:
            prompt_text, prompt_entries = echoed(index)
            text, entries = prompt_text + text, prompt_entries + shifted(entries, len(prompt_text))
        answer = choice(index, text, job.finish_reason, entries)
        if chat:
            answer["message"], answer["finish_reason"] = agents.message(chat_plan, text, tok, job.finish_reason)
            if single_call:
                answer["message"], answer["finish_reason"] = _single_call(answer["message"], answer["finish_reason"])
        choices.append(answer)
    return JSONResponse({**head, "choices": choices, "usage": usage_of(jobs, n), "timings": request.state.generation})


def models(served: ServedModel, created: int) -> dict:
    """GET /v1/models: the one served model."""
    return {"object": "list", "data": [
        {"id": served.model_id, "object": "model", "created": created, "owned_by": "sharpi"}]}
