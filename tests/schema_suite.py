"""The official JSON-Schema-Test-Suite (draft 2020-12) as a public set of schemas for constrained
decoding, and the 20 of its cases the tests pin.

The suite (github.com/json-schema-org/JSON-Schema-Test-Suite) is not in the repository: it ships
inside the `jsonschema` source distribution on PyPI, which tools/fetch_schema_suite.sh downloads
(a pinned version) and unpacks on first use. Without PyPI the tests that need it skip saying so,
and under SHARPI_REQUIRE_ALL=1 that skip is a failure (ci_policy.py), as every missing
prerequisite is.

Each suite file is a list of cases {description, schema, tests: [{description, data, valid}]}.

How the 20 were chosen (a fixed rule, then pinned, so a changed suite fails loudly instead of
quietly testing other schemas): for each of KEYWORD_FILES, keyword files whose schemas describe an
output shape a JSON producer can meet, in that order, take the file's first case; keep it when the
suite lists at least one valid instance for it and llguidance compiles a grammar for it. llguidance
refuses the first case of oneOf.json and defs.json (REFUSED, with its error); the remaining 20 are
PINNED. It refuses the first cases of uniqueItems.json, dependentRequired.json, not.json and
boolean_schema.json too (REFUSED_ELSEWHERE).

Most suite schemas carry no "type" (the suite tests each keyword where it applies and that it is
ignored elsewhere), so the grammar also allows JSON the keyword does not constrain: a producer may
meet {"minimum": 1.1} with a string. test_constrained.py therefore also checks each pinned
grammar against the suite's own instances, the valid and the invalid ones.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ci_policy import prerequisite_missing

FETCH_SCRIPT = Path(__file__).resolve().parent.parent / "tools" / "fetch_schema_suite.sh"

KEYWORD_FILES = (
    "type.json", "properties.json", "required.json", "enum.json", "const.json", "minimum.json",
    "maximum.json", "minLength.json", "maxLength.json", "items.json", "prefixItems.json", "minItems.json",
    "maxItems.json", "pattern.json", "anyOf.json", "oneOf.json", "allOf.json", "ref.json", "defs.json",
    "additionalProperties.json", "format.json", "multipleOf.json",
)

# (file, case description): the first case of each of KEYWORD_FILES, less REFUSED.
PINNED = (
    ("type.json", "integer type matches integers"),
    ("properties.json", "object properties validation"),
    ("required.json", "required validation"),
    ("enum.json", "simple enum validation"),
    ("const.json", "const validation"),
    ("minimum.json", "minimum validation"),
    ("maximum.json", "maximum validation"),
    ("minLength.json", "minLength validation"),
    ("maxLength.json", "maxLength validation"),
    ("items.json", "a schema given for items"),
    ("prefixItems.json", "a schema given for prefixItems"),
    ("minItems.json", "minItems validation"),
    ("maxItems.json", "maxItems validation"),
    ("pattern.json", "pattern validation"),
    ("anyOf.json", "anyOf"),
    ("allOf.json", "allOf"),
    ("ref.json", "root pointer ref"),
    ("additionalProperties.json", "additionalProperties being false does not allow other properties"),
    ("format.json", "email format"),
    ("multipleOf.json", "by int"),
)

# The first cases of KEYWORD_FILES llguidance refuses -> a fragment of its error. It cannot enforce
# oneOf's "exactly one" (it offers to approximate it with anyOf, which sharpi does not ask for), and
# defs.json's first case refers to the draft's metaschema, which uses $dynamicAnchor.
REFUSED = {
    ("oneOf.json", "oneOf"): "oneOf constraints are not supported",
    ("defs.json", "validate definition against metaschema"): "$dynamicAnchor",
}

# First cases of other keyword files (output shapes too, but none of KEYWORD_FILES) that llguidance
# refuses as well -> a fragment of its error; the rule test checks these refusals too, so the record
# stays true when llguidance learns one of them.
REFUSED_ELSEWHERE = {
    ("uniqueItems.json", "uniqueItems validation"): "uniqueItems",
    ("dependentRequired.json", "single dependency"): "dependentRequired",
    ("not.json", "not"): '"not"',
    ("boolean_schema.json", "boolean schema 'true'"): "Expecting object schema",
}

# Valid instances (file, case, test description) the pinned grammar refuses: llguidance is stricter
# than the schema there, never looser. An integer must be written without a fraction (1.0 is an
# integer to JSON Schema); properties the schema names come in the schema's order (allOf's instance
# has "foo" before "bar", its schema names bar first); a "format" is asserted, where draft 2020-12
# makes it an annotation unless a metaschema asks for the format-assertion vocabulary.
STRICTER = {
    ("type.json", "integer type matches integers", "a float with zero fractional part is an integer"),
    ("allOf.json", "allOf", "allOf"),
    ("format.json", "email format", "invalid email string is only an annotation by default"),
}


def suite_dir() -> Path:
    """The draft2020-12 directory, fetched by tools/fetch_schema_suite.sh on first use; or
    prerequisite_missing saying why it could not be fetched (no PyPI on this machine)."""
    env = {**os.environ, "PYTHON": sys.executable}
    try:
        done = subprocess.run(["bash", str(FETCH_SCRIPT)], capture_output=True, text=True, timeout=600,
                              check=False, env=env)
    except (OSError, subprocess.TimeoutExpired) as error:
        why = f"tools/fetch_schema_suite.sh failed: {error}"
    else:
        path = Path(done.stdout.strip().splitlines()[-1]) if done.stdout.strip() else None
        if done.returncode == 0 and path is not None and (path / "type.json").is_file():
            return path
        why = f"tools/fetch_schema_suite.sh failed (rc {done.returncode}): {done.stderr[-2000:]}"
    # Outside the except: the failure is not shown chained to the error.
    prerequisite_missing(f"JSON-Schema-Test-Suite unavailable (the jsonschema sdist comes from PyPI): {why}")


def first_case(directory: Path, file: str) -> dict:
    return json.loads((directory / file).read_text(encoding="utf-8"))[0]


def pinned_case(directory: Path, file: str, description: str) -> dict:
    """The case of `file` with that description; an AssertionError naming it if the suite lost it."""
    cases = [c for c in json.loads((directory / file).read_text(encoding="utf-8")) if c["description"] == description]
    assert len(cases) == 1, f"the suite changed: {file} has {len(cases)} cases named {description!r}"
    return cases[0]


def compact(value) -> str:
    """value as JSON with no whitespace outside strings, the only spelling sharpi's grammars allow."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
