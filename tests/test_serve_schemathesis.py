"""`sharpi serve` against its own OpenAPI document (issue 43, acceptance 3): schemathesis generates
requests from /openapi.json, valid ones (positive) and ones that break the documented schemas
(negative), a bounded number per operation, and sends them to the live server.

Oracles: HTTP itself and the document: no answer is a 5xx; every 4xx is OpenAI's error shape
{"error": {"message", "type", "param", "code"}} (Anthropic's on /v1/messages); every status the server gives is one the document
lists for that operation, in a documented content type, and a JSON answer matches its schema
(schemathesis' status_code_conformance, content_type_conformance, response_schema_conformance).
A schema-valid request may still be refused (the model named wrong, a prompt longer than the
context), so acceptance of valid data is not required, only the documented error.
"""

from __future__ import annotations

import json

import pytest
import schemathesis  # tests/requirements.txt: a missing one fails, never skips
from test_serve_api import Server

# Examples per generation mode: the completion endpoints, whose bodies have dozens of fields,
# get most; the rest have small bodies or none. About 30 s on the 2-core machine (the server's
# context is small, so no answer is long).
MAX_EXAMPLES = {"/v1/chat/completions": 40, "/v1/completions": 40, "/v1/messages": 30}
MAX_EXAMPLES_OTHER = 10


@pytest.fixture(scope="module")
def server():
    s = Server("-c", "96")
    yield s
    s.stop()


def error_shape_problem(path: str, body) -> str | None:
    """Why `body` is not the error shape of `path`'s protocol (None when it is): OpenAI's
    {"error": {"message", "type", "param", "code"}}, or Anthropic's {"type": "error", "error":
    {"type", "message"}} on /v1/messages."""
    if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
        return f"no error object: {body!r}"
    err = body["error"]
    if not (isinstance(err.get("message"), str) and err["message"] and isinstance(err.get("type"), str)):
        return f"no message and type: {body!r}"
    if path.startswith("/v1/messages"):
        return None if body.get("type") == "error" and set(body) == {"type", "error"} else f"not Anthropic's: {body!r}"
    return None if set(body) == {"error"} and "param" in err and "code" in err else f"not OpenAI's: {body!r}"


def check_error(path: str, response) -> None:
    status = response.status_code
    assert status < 500, f"{status}: {response.text[:500]}"
    if 400 <= status < 500:
        problem = error_shape_problem(path, json.loads(response.text))
        assert problem is None, problem


def test_live_server_conforms_to_its_openapi_document(server):
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import GenerationMode
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    base_url = f"http://127.0.0.1:{server.port}"
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    checks = [status_code_conformance, content_type_conformance, response_schema_conformance]
    operations = [result.ok() for result in schema.get_all_operations()]
    documented = server.json("GET", "/openapi.json")[1]["paths"]
    # Every documented operation but the document itself, which schemathesis leaves out (it was
    # just read, above).
    assert {f"{o.method.upper()} {o.path}" for o in operations} == {
        f"{method.upper()} {path}" for path, ops in documented.items() for method in ops} - {"GET /openapi.json"}
    failures = []
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            if mode is GenerationMode.NEGATIVE and not operation.body:
                continue  # a GET with no body to break

            @settings(max_examples=MAX_EXAMPLES.get(operation.path, MAX_EXAMPLES_OTHER), deadline=None, database=None, derandomize=True,
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def run(case):
                response = case.call(base_url=base_url, timeout=60)
                check_error(case.operation.path, response)
                case.validate_response(response, checks=checks)

            try:
                run()
            except Exception as e:  # noqa: BLE001 - gathered, so one run reports every operation's failure
                failures.append(f"{operation.method.upper()} {operation.path} ({mode.value}): {e}")
    assert not failures, "\n\n".join(failures)
    assert server.request("GET", "/health")[0] == 200


# -- every documented field, one at a time ------------------------------------------------------------

# A valid body per operation, and JSON values of every type to put in one field of it.
BASE_BODIES = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
               "/v1/completions": {"prompt": "x", "max_tokens": 1},
               "/tokenize": {"content": "x"}, "/detokenize": {"tokens": [1]},
               "/v1/messages": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
               "/v1/messages/count_tokens": {"messages": [{"role": "user", "content": "x"}]}}
ODD_VALUES = [None, True, False, 0, -1, 1, 1.5, 2**70, -(2**70), 1e-300, "", "x", [], [None], [1, "a"], [[]], {},
              {"type": None}, {"a": [1]}]


def documented_bounds(schema: dict) -> list:
    """Values just inside and outside a numeric field's documented range."""
    out = []
    for key in ("minimum", "maximum", "exclusiveMinimum"):
        if key in schema:
            out += [schema[key] - 1, schema[key], schema[key] + 1]
    return out


def documented_properties(doc: dict, ref: str) -> dict:
    """The top-level properties of a request schema, through its allOf parts."""
    schema = doc["components"]["schemas"][ref.rsplit("/", 1)[1]]
    props = dict(schema.get("properties", {}))
    for part in schema.get("allOf", []):
        props.update(documented_properties(doc, part["$ref"]) if "$ref" in part else part.get("properties", {}))
    return props


def test_every_documented_field_with_odd_values(server):
    """Fuzzing draws fields jointly, so a field it rarely draws can hide a crash: here each
    documented top-level field of each request body gets each kind of JSON value, alone."""
    doc = server.json("GET", "/openapi.json")[1]
    sent = 0
    failures = []
    for path, base in BASE_BODIES.items():
        ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        props = documented_properties(doc, ref)
        for name, schema in props.items():
            for value in ODD_VALUES + documented_bounds(schema):
                status, _, data = server.request("POST", path, {**base, name: value})
                sent += 1
                if status >= 500:
                    failures.append(f"{path} {name}={value!r}: {status} {data[:300]!r}")
                elif status >= 400 and (problem := error_shape_problem(path, json.loads(data))):
                    failures.append(f"{path} {name}={value!r}: {status} {problem[:300]}")
    assert not failures, "\n".join(failures)
    assert sent > 500
