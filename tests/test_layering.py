"""The C++ core's layering rules (docs/design.md §3, issue 11), checked on the sources' #include lines.

- Predictors (cpp/src/predict/) only produce hints: they include nothing from the MoE runtime
  (cpp/src/moe/: the cache, its policies, the prefetcher, the MoE FFN).
- The expert cache and everything it is built from (cpp/src/moe/ except the MoE FFN, which bridges
  the layer builders and the cache) and the readers (cpp/src/io/) know the model only as an
  ExpertLayout: they include nothing from cpp/src/model/ or cpp/src/gguf/.
- The model (cpp/src/model/) never includes the public session header.

Each rule is also run against a source with one forbidden include added, so a rule that can no
longer fail is caught too.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "cpp" / "src"
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)

# The MoE FFN sits between the layer builders (model/forward.h) and the expert source: it may see both.
MOE_BRIDGE = {"moe/moe_ffn.h", "moe/moe_ffn.cpp"}


def _sources(folder: str) -> dict[str, str]:
    base = SRC / folder
    return {
        p.relative_to(SRC).as_posix(): p.read_text()
        for p in sorted(base.rglob("*"))
        if p.suffix in (".h", ".cpp")
    }


def _includes(text: str) -> list[str]:
    return INCLUDE.findall(text)


RULES = [
    # (name, files the rule covers, forbidden include prefixes)
    ("predictors include nothing of the MoE runtime", lambda name: name.startswith("predict/"), ("moe/",)),
    (
        "the expert cache includes nothing of model/ or gguf/",
        lambda name: name.startswith("moe/") and name not in MOE_BRIDGE,
        ("model/", "gguf/"),
    ),
    (
        "the readers include nothing of model/ or gguf/",
        lambda name: name.startswith("io/"),
        ("model/", "gguf/"),
    ),
    (
        "model/ never includes the public session header",
        lambda name: name.startswith("model/"),
        ("sharpi/session.h",),
    ),
]


def _violations(files: dict[str, str]) -> list[str]:
    out = []
    for rule, covers, forbidden in RULES:
        for name, text in files.items():
            if not covers(name):
                continue
            for inc in _includes(text):
                if inc.startswith(forbidden):
                    out.append(f'{rule}: {name} includes "{inc}"')
    return out


def _all_sources() -> dict[str, str]:
    files = {}
    for folder in ("predict", "moe", "io", "model"):
        files.update(_sources(folder))
    return files


def test_the_folders_exist():
    for folder in ("predict", "moe", "io", "model", "gguf"):
        assert (SRC / folder).is_dir(), folder
    assert (SRC / "moe" / "expert_cache.h").is_file()
    assert (SRC / "moe" / "prefetcher.h").is_file()
    assert not (SRC / "cache").exists(), "cpp/src/cache/ moved to cpp/src/moe/"


def test_no_forbidden_include():
    assert _violations(_all_sources()) == []


@pytest.mark.parametrize(
    "victim, include",
    [
        ("predict/predictor.cpp", "moe/expert_cache.h"),
        ("moe/expert_cache.cpp", "model/model.h"),
        ("moe/prefetcher.h", "gguf/gguf_file.h"),
        ("io/reader_common.cpp", "model/hparams.h"),
        ("model/forward.h", "sharpi/session.h"),
    ],
)
def test_each_rule_catches_a_forbidden_include(victim, include):
    files = _all_sources()
    assert victim in files, victim
    files[victim] = f'#include "{include}"\n' + files[victim]
    found = _violations(files)
    assert len(found) == 1 and victim in found[0] and include in found[0], found


def test_include_lines_are_found():
    # The parser itself: spacing variants count, system headers and comments do not.
    text = '#include "a/b.h"\n  #  include "c.h"\n#include <vector>\n// #include "d.h"\n'
    assert _includes(text) == ["a/b.h", "c.h"]
