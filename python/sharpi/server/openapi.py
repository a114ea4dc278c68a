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
               ok_type: str = "application/json", error: dict = _ERROR) -> dict:
    """One operation: its 200 answer (`ok`, a schema, in `ok_type`), the error statuses it can
    give (in the `error` schema), and its request body's schema name under components."""
    codes = {"400": "a bad request", "401": "no valid API key (--api-key)", "404": "an unknown model",
             "413": "a body over --max-body", "500": "a failure while generating"}
    responses = {"200": {"description": "success", "content": {ok_type: {"schema": ok}}}}
    for code in (*errors, *(("401",) if secured else ())):
        responses[code] = {"description": codes[code], **_json(error)}
    op = {"summary": summary, "responses": responses}
    if body is not None:
        op["requestBody"] = {"required": True, **_json({"$ref": f"#/components/schemas/{body}"})}
    return op


_STOP = {"oneOf": [{"type": "string", "minLength": 1},
                   {"type": "array", "maxItems": 4, "items": {"type": "string", "minLength": 1}}]}

# The sampling fields both completion endpoints take (openai_api.sampling_options' limits).
_SAMPLING = {
    "model": {"type": "string"},
    "max_tokens": {"type": "integer", "minimum": 1, "maximum": 2**31 - 1},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "minimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1},
    "repeat_penalty": {"type": "number", "exclusiveMinimum": 0, "maximum": 10},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "seed": {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1},
    "n": {"type": "integer", "minimum": 1, "maximum": 1},
    "stop": _STOP,
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
}

_SCHEMAS = {
    "Error": {
        "type": "object", "required": ["error"],
        "properties": {"error": {
            "type": "object", "required": ["message", "type", "param", "code"],
            "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                           "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
    },
    "ChatMessage": {
        "type": "object", "required": ["role"],
        "properties": {"role": {"type": "string"},
                       "content": {"oneOf": [{"type": "string"}, {"type": "null"}, {"type": "array", "items": {
                           "type": "object", "properties": {"type": {"type": "string"}, "text": {"type": "string"}}}}]}},
    },
    "ChatCompletionRequest": {
        "type": "object", "required": ["messages"],
        "properties": {
            **_SAMPLING,
            "messages": {"type": "array", "minItems": 1, "items": {"$ref": "#/components/schemas/ChatMessage"}},
            "max_completion_tokens": {"type": "integer", "minimum": 1, "maximum": 2**31 - 1},
            "logprobs": {"type": "boolean"},
            "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
            "tools": {"type": "array", "items": {"type": "object"}},
            "documents": {"type": "array"},
            "chat_template_kwargs": {"type": "object", "properties": {"enable_thinking": {"type": "boolean"},
                                                                      "reasoning_effort": {"type": "string"}}},
            "reasoning_effort": {"enum": ["low", "medium", "high"]},
        },
    },
    "CompletionRequest": {
        "type": "object", "required": ["prompt"],
        "properties": {
            **_SAMPLING,
            "prompt": {"oneOf": [{"type": "string", "minLength": 1},
                                 {"type": "array", "minItems": 1, "maxItems": 1,
                                  "items": {"type": "string", "minLength": 1}}]},
            "logprobs": {"type": "integer", "minimum": 0, "maximum": 5},
            "echo": {"const": False},
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
    completion_errors = ("400", "404", "413", "500")
    paths = {
        "/v1/chat/completions": {"post": _operation(
            "OpenAI chat completion, whole or as server-sent events (stream: true)", _OBJECT, completion_errors,
            body="ChatCompletionRequest", secured=secured)},
        "/v1/completions": {"post": _operation(
            "OpenAI (legacy) text completion, whole or as server-sent events", _OBJECT, completion_errors,
            body="CompletionRequest", secured=secured)},
        "/v1/messages": {"post": _operation(
            "Anthropic Messages, whole or as Anthropic's server-sent events (stream: true)", _OBJECT,
            completion_errors, body="AnthropicMessagesRequest", secured=secured, error=_ANTHROPIC_ERROR)},
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
