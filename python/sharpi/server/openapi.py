"""GET /openapi.json: the OpenAPI 3.1 document of every endpoint `sharpi serve` answers, written
by hand beside the code that parses each body (openai_api, anthropic_api, llama_api): the request
schemas state the same types and limits those parsers enforce, and every error response is OpenAI's
shape (Anthropic's on /v1/messages).
tests/test_serve_api.py checks that the document's paths and methods are exactly the
application's routes, and that its references resolve.
"""

from __future__ import annotations

from .. import __version__

_ERROR = {"$ref": "#/components/schemas/Error"}
_ANTHROPIC_ERROR = {"$ref": "#/components/schemas/AnthropicError"}


def _json(schema: dict) -> dict:
    return {"content": {"application/json": {"schema": schema}}}


def _operation(summary: str, ok: dict, errors: tuple = (), body: str | None = None, secured: bool = False,
               ok_type: str = "application/json", error: dict = _ERROR, streams: bool = False) -> dict:
    """One operation: its 200 answer (`ok`, a schema, in `ok_type`; with `streams` also server-sent
    events), the error statuses it can give (in the `error` schema), and its request body's schema
    name under components."""
    codes = {"400": "a bad request", "401": "no valid API key (--api-key)", "404": "an unknown model",
             "413": "a body over --max-body", "500": "a failure while generating",
             "503": "the queue of requests waiting for a slot is full (--queue-size); retry after Retry-After seconds"}
    content = {ok_type: {"schema": ok}}
    if streams:
        # One server-sent event (as a reader parses it): its data a JSON chunk (then "[DONE]" on
        # OpenAI's endpoints), its event type on Anthropic's.
        content["text/event-stream"] = {"schema": {
            "type": "object", "required": ["data"], "description": "stream: true: the answer as server-sent events",
            "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}}
    responses = {"200": {"description": "success", "content": content}}
    for code in (*errors, *(("401",) if secured else ())):
        responses[code] = {"description": codes[code], **_json(error)}
    op = {"summary": summary, "responses": responses}
    if body is not None:
        op["requestBody"] = {"required": True, **_json({"$ref": f"#/components/schemas/{body}"})}
    return op


_STOP = {"oneOf": [{"type": "string", "minLength": 1},
                   {"type": "array", "maxItems": 4, "items": {"type": "string", "minLength": 1}}]}
_MAX_TOKENS = {"type": "integer", "minimum": 1, "maximum": 2**31 - 1}

# The sampling fields both completion endpoints take (openai_api.sampling_options' limits, MAX_N,
# logit_bias, refuse_unsupported and IGNORED_FIELDS).
_SAMPLING = {
    "model": {"type": "string", "description": "the served model's name (GET /v1/models); another is a 404"},
    "max_tokens": _MAX_TOKENS,
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "minimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1},
    "repeat_penalty": {"type": "number", "exclusiveMinimum": 0, "maximum": 10},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "seed": {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1,
             "description": "choice k of n is sampled with seed + k (mod 2**32): the single-choice request "
                            "with that seed"},
    "n": {"type": "integer", "minimum": 1, "maximum": 16,
          "description": "choices per prompt, each an independent sample; prompts times n at most 16"},
    "logit_bias": {"type": "object", "propertyNames": {"pattern": "^[0-9]+$"},
                   "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
                   "description": "token id (as a string) -> bias added to its logit; -100 bans it"},
    "stop": _STOP,
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "additionalProperties": False,
                       "properties": {"include_usage": {"type": "boolean"}, "include_obfuscation": {"type": "boolean"}},
                       "description": "only with stream: true"},
    "user": {"type": "string", "description": "accepted and ignored"},
}
_IGNORED = {"metadata": {"type": "object", "additionalProperties": {"type": "string"}, "description": "ignored"},
            "safety_identifier": {"type": "string", "description": "ignored"},
            "prompt_cache_key": {"type": "string", "description": "ignored: the cache is reused for every request"},
            "prompt_cache_options": {"type": "object", "description": "ignored"},
            "prompt_cache_retention": {"type": "string", "description": "ignored"}}

_TOOL_CALL = {"type": "object", "required": ["function"], "properties": {
    "id": {"type": "string"}, "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string"},
        "arguments": {"oneOf": [{"type": "string", "description": "JSON text, as OpenAI writes it"},
                                {"type": "object"}]}}}}}
_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}

_USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"], "properties": {
    "prompt_tokens": {"type": "integer", "minimum": 0}, "completion_tokens": {"type": "integer", "minimum": 0},
    "total_tokens": {"type": "integer", "minimum": 0}}}
_FINISH = {"enum": ["stop", "length", "tool_calls"]}


def _completion_object(kind: str, choice: dict) -> dict:
    return {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"], "properties": {
        "id": {"type": "string"}, "object": {"const": kind}, "created": {"type": "integer"},
        "model": {"type": "string"}, "usage": _USAGE,
        "choices": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["index", "finish_reason", *choice], "properties": {
                "index": {"type": "integer", "minimum": 0}, "finish_reason": _FINISH, **choice}}}}}


_SCHEMAS = {
    "ChatCompletion": _completion_object("chat.completion", {"message": {
        "type": "object", "required": ["role"], "properties": {
            "role": {"const": "assistant"}, "content": {"type": ["string", "null"]},
            "reasoning_content": {"type": "string"}, "tool_calls": {"type": "array", "items": _TOOL_CALL}}}}),
    "TextCompletion": _completion_object("text_completion", {"text": {"type": "string"}}),
    "Error": {
        "type": "object", "required": ["error"],
        "properties": {"error": {
            "type": "object", "required": ["message", "type", "param", "code"],
            "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                           "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
    },
    "ChatMessage": {
        "type": "object", "required": ["role"],
        "properties": {"role": {"type": "string", "description": "system, developer, user, assistant, tool, ..."},
                       "content": {"oneOf": [{"type": "string"}, {"type": "null"},
                                             {"type": "array", "items": _TEXT_PART}]},
                       "name": {"type": "string"},
                       "tool_calls": {"type": "array", "items": _TOOL_CALL},
                       "tool_call_id": {"type": "string"},
                       "reasoning_content": {"type": "string"}},
    },
    "Tool": {
        "type": "object", "required": ["type", "function"],
        "properties": {"type": {"const": "function"},
                       "function": {"type": "object", "required": ["name"], "properties": {
                           "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                           "description": {"type": "string"},
                           "parameters": {"type": "object", "description": "a JSON Schema of the arguments"},
                           "strict": {"type": "boolean"}}}},
    },
    "ChatCompletionRequest": {
        "type": "object", "required": ["messages"],
        "properties": {
            **_SAMPLING, **_IGNORED,
            "messages": {"type": "array", "minItems": 1, "items": {"$ref": "#/components/schemas/ChatMessage"}},
            "max_completion_tokens": _MAX_TOKENS,
            "logprobs": {"type": "boolean"},
            "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20, "description": "needs logprobs: true"},
            "tools": {"type": "array", "minItems": 1, "items": {"$ref": "#/components/schemas/Tool"}},
            "tool_choice": {"oneOf": [
                {"enum": ["none", "auto", "required"]},
                {"type": "object", "required": ["type", "function"], "properties": {
                    "type": {"const": "function"},
                    "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}}],
                "description": "auto or required need tools; a named function must be one of them"},
            "parallel_tool_calls": {"type": "boolean", "description": "false: at most one call"},
            "response_format": {"oneOf": [
                {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
                {"type": "object", "required": ["type", "json_schema"], "properties": {
                    "type": {"const": "json_schema"},
                    "json_schema": {"type": "object", "required": ["schema"], "properties": {
                        "name": {"type": "string"}, "schema": {"type": "object"}, "strict": {"type": "boolean"}}}}}],
                "description": "constrained decoding; one of response_format, grammar and a forced tool_choice"},
            "grammar": {"type": "string", "description": "llama-server's GBNF grammar the reply must match"},
            "documents": {"type": "array", "description": "handed to the chat template"},
            "chat_template_kwargs": {"type": "object", "description": "extra template variables",
                                     "properties": {"enable_thinking": {"type": "boolean"},
                                                    "reasoning_effort": {"type": "string"}}},
            "reasoning_effort": {"enum": ["low", "medium", "high"]},
            "store": {"const": False, "description": "sharpi keeps no completions"},
            "service_tier": {"enum": ["auto", "default"]},
            "modalities": {"type": "array", "items": {"const": "text"}, "minItems": 1, "maxItems": 1},
        },
    },
    "CompletionRequest": {
        "type": "object", "required": ["prompt"],
        "properties": {
            **_SAMPLING, **_IGNORED,
            "prompt": {"oneOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0},
                 "description": "token ids, each in the vocabulary (0..n_vocab-1)"},
                {"type": "array", "minItems": 1, "maxItems": 16, "items": {"oneOf": [
                    {"type": "string", "minLength": 1},
                    {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}]},
                 "description": "several prompts: choice index = prompt index * n + sample"}]},
            "logprobs": {"type": "integer", "minimum": 0, "maximum": 5},
            "echo": {"type": "boolean", "description": "the prompt's text (and, with logprobs, its tokens' "
                                                       "entries, the first null) goes before each choice's"},
            "suffix": {"type": "string", "description": "fill-in-the-middle: the text after the hole (a model with "
                                                        "FIM tokens; not with echo)"},
            "best_of": {"type": "integer", "minimum": 1, "maximum": 1},
        },
    },
    "AnthropicError": {
        "type": "object", "required": ["type", "error"],
        "properties": {"type": {"const": "error"}, "error": {
            "type": "object", "required": ["type", "message"],
            "properties": {"type": {"enum": ["invalid_request_error", "authentication_error", "permission_error",
                                             "not_found_error", "request_too_large", "rate_limit_error",
                                             "api_error", "overloaded_error"]},
                           "message": {"type": "string"}}}},
    },
    "AnthropicMessage": {
        "type": "object", "required": ["role", "content"],
        "properties": {"role": {"enum": ["user", "assistant"]},
                       "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {
                           "type": "object", "required": ["type"],
                           "properties": {"type": {"enum": ["text", "tool_use", "tool_result", "thinking",
                                                            "redacted_thinking"]}}}}]}},
    },
    "AnthropicCountTokensRequest": {
        "type": "object", "required": ["messages"],
        "properties": {
            "model": {"type": "string"},
            "messages": {"type": "array", "minItems": 1, "items": {"$ref": "#/components/schemas/AnthropicMessage"}},
            "system": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
            "tools": {"type": "array", "items": {"type": "object", "required": ["name", "input_schema"], "properties": {
                "name": {"type": "string", "minLength": 1}, "description": {"type": "string"},
                "input_schema": {"type": "object"}}}},
            "tool_choice": {"type": "object", "required": ["type"], "properties": {
                "type": {"enum": ["auto", "any", "tool", "none"]}, "name": {"type": "string"},
                "disable_parallel_tool_use": {"type": "boolean"}}},
            "thinking": {"type": "object", "required": ["type"], "properties": {
                "type": {"enum": ["enabled", "disabled"]}, "budget_tokens": {"type": "integer", "minimum": 1}}},
        },
    },
    "AnthropicMessagesRequest": {
        "allOf": [{"$ref": "#/components/schemas/AnthropicCountTokensRequest"}, {
            "type": "object", "required": ["max_tokens"],
            "properties": {
                "max_tokens": {"type": "integer", "minimum": 1, "maximum": 2**31 - 1},
                "temperature": {"type": "number", "minimum": 0, "maximum": 1},
                "top_p": {"type": "number", "minimum": 0, "maximum": 1},
                "top_k": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1},
                "stop_sequences": {"type": "array", "items": {"type": "string", "minLength": 1}},
                "stream": {"type": "boolean"},
                "metadata": {"type": "object"},
            }}],
    },
    "TokenizeRequest": {
        "type": "object", "required": ["content"],
        "properties": {"content": {"type": "string"}, "add_special": {"type": "boolean"},
                       "parse_special": {"type": "boolean"}, "with_pieces": {"type": "boolean"}},
    },
    "DetokenizeRequest": {
        "type": "object", "required": ["tokens"],
        "properties": {"tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}}},
    },
}

_OBJECT = {"type": "object"}


def openapi_document(api_key: bool = False) -> dict:
    """The document (a fresh dict each call); `api_key`: the server takes --api-key, so every
    operation but /health, / and this document needs a key (bearer or x-api-key) and can answer 401."""
    secured = api_key
    completion_errors = ("400", "404", "413", "500", "503")
    paths = {
        "/v1/chat/completions": {"post": _operation(
            "OpenAI chat completion, whole or as server-sent events (stream: true)",
            {"$ref": "#/components/schemas/ChatCompletion"}, completion_errors, body="ChatCompletionRequest",
            secured=secured, streams=True)},
        "/v1/completions": {"post": _operation(
            "OpenAI (legacy) text completion, whole or as server-sent events",
            {"$ref": "#/components/schemas/TextCompletion"}, completion_errors, body="CompletionRequest",
            secured=secured, streams=True)},
        "/v1/messages": {"post": _operation(
            "Anthropic Messages, whole or as Anthropic's server-sent events (stream: true)", _OBJECT,
            completion_errors, body="AnthropicMessagesRequest", secured=secured, error=_ANTHROPIC_ERROR,
            streams=True)},
        "/v1/messages/count_tokens": {"post": _operation(
            "Anthropic's token count of a Messages request's prompt", _OBJECT, ("400", "404", "413"),
            body="AnthropicCountTokensRequest", secured=secured, error=_ANTHROPIC_ERROR)},
        "/v1/models": {"get": _operation("the served model", _OBJECT, secured=secured)},
        "/v1/sharpi/stats": {"get": _operation("request counts and the live expert-cache view", _OBJECT, secured=secured)},
        "/tokenize": {"post": _operation("llama-server's /tokenize", _OBJECT, ("400", "413"),
                                         body="TokenizeRequest", secured=secured)},
        "/detokenize": {"post": _operation("llama-server's /detokenize", _OBJECT, ("400", "413"),
                                           body="DetokenizeRequest", secured=secured)},
        "/props": {"get": _operation("llama-server's /props: model, context, chat template, defaults", _OBJECT,
                                     secured=secured)},
        "/metrics": {"get": _operation("Prometheus metrics", {"type": "string"}, ok_type="text/plain",
                                    secured=secured)},
        "/health": {"get": {**_operation("liveness", _OBJECT), "security": []}},
        "/openapi.json": {"get": {**_operation("this document", _OBJECT), "security": []}},
        "/": {"get": {**_operation("the chat page with the live expert-cache plots", {"type": "string"},
                                   ok_type="text/html"), "security": []}},
    }
    doc = {
        "openapi": "3.1.0",
        "info": {"title": "sharpi serve", "version": __version__,
                 "description": "OpenAI-, Anthropic- and llama-server-compatible HTTP API of one sharpi model."},
        "paths": paths,
        "components": {"schemas": _SCHEMAS},
    }
    if api_key:
        # Either header carries the key: Bearer (OpenAI's clients) or x-api-key (Anthropic's).
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"},
                                                "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}}
        doc["security"] = [{"bearer": []}, {"apiKey": []}]
    return doc
