"""sharpi's tokenizer on the real vocabularies llama.cpp ships as test fixtures (models/ggml-vocab-*.gguf
in the llama-cpp-python source package, fetched by tools/fetch_converter.sh), on the fixtures' own
inputs (.gguf.inp) against the ids llama.cpp's test-tokenizer-0 expects for them (.gguf.out).

Every fixture whose tokenizer sharpi supports must match exactly; one sharpi does not support (an
unknown pre-tokenizer, a WPM or UGM model) must be refused with UnsupportedError, never encoded.
Skips (never fails) when the source package cannot be fetched.
"""

from pathlib import Path

import pytest
from sharpi import UnsupportedError, _core
from sharpi.tokenizer import Tokenizer

FIXTURES = [
    "bert-bge", "command-r", "deepseek-coder", "deepseek-llm", "falcon", "gemma-4",
    "gpt-2", "llama-bpe", "llama-spm", "mpt", "phi-3", "qwen2", "qwen35", "refact", "starcoder",
]  # fmt: skip
# (aquila and baichuan ship no .inp/.out cases.)
# The pre-tokenizers / models sharpi must support among them (the rest must raise UnsupportedError).
MUST_SUPPORT = {"deepseek-coder", "deepseek-llm", "gpt-2", "llama-bpe", "llama-spm", "mpt", "qwen2", "qwen35",
                "refact", "starcoder", "command-r", "phi-3"}  # fmt: skip
SEPARATOR = "\n__ggml_vocab_test__\n"


def _cases(models: Path, name: str):
    base = models / f"ggml-vocab-{name}.gguf"
    texts = base.with_name(base.name + ".inp").read_text(encoding="utf-8").split(SEPARATOR)
    if texts[-1] == "":  # a file ending with a separator
        texts = texts[:-1]
    outs = base.with_name(base.name + ".out").read_text(encoding="utf-8").split("\n")[: len(texts)]
    return base, [(t, [int(x) for x in o.split()]) for t, o in zip(texts, outs)]


@pytest.mark.parametrize("name", FIXTURES)
def test_fixture_matches_llama_cpp(vocab_fixtures_dir, name):
    base, cases = _cases(vocab_fixtures_dir, name)
    assert len(cases) > 10
    md = _core.GgufFile(str(base)).metadata()
    try:
        tok = Tokenizer.from_metadata(md)
    except UnsupportedError:
        if name in MUST_SUPPORT:
            raise
        return  # refused with a typed error: what an unsupported tokenizer must do
    mismatches = []
    for text, want in cases:
        got = tok.encode(text, add_bos=False)
        if got != want:
            mismatches.append((text, want, got))
    assert not mismatches, f"{name}: {len(mismatches)}/{len(cases)} differ, first {mismatches[0]!r}"
