"""sharpi's tokenizer against llama.cpp's own on thousands of generated strings per vocabulary.

The oracle is llama.cpp (llama-cpp-python, the bench extra) loading the same vocab-only GGUF files
its own tokenizer test uses (models/ggml-vocab-*.gguf, fetched by tools/fetch_converter.sh) through
its C API, without a context, and tokenizing as tests/test-tokenizer-0.cpp does (add_special=false,
parse_special=false: no BOS/EOS added, special-token texts taken as plain text). The
strings come from tests/reference/random_text.py (mixed scripts, combining marks, digit runs, emoji,
whitespace runs, contractions, punctuation, byte-fallback characters) with a fresh seed every run; the
seed is printed and named in every failure, and SHARPI_TOKENIZER_SEED=<seed> replays it.

A second test checks every tokenizer.ggml.pre name sharpi accepts: a copy of the gpt-2 vocabulary
whose only change is the pre name must tokenize as llama.cpp tokenizes it, so sharpi maps each name
to the regexes llama.cpp (and the model's tokenizer.json) use.

Skips with a reason when llama_cpp is not importable (CI does not build llama.cpp: ~7 min) or the
fixtures cannot be fetched.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from ci_policy import require_llama_cpp
from reference.random_text import random_texts
from sharpi import _core
from sharpi.tokenizer import _PRE_TOKENIZERS, Tokenizer

llama_cpp = None  # imported by the fixture below: a missing one skips (fails in CI) each test, saying how to get it


@pytest.fixture(autouse=True)
def _llama_cpp():
    global llama_cpp
    llama_cpp = require_llama_cpp()

# The fixtures whose tokenizer sharpi supports (tests/test_tokenizer_fixtures.py checks the others
# are refused).
VOCABS = [
    "command-r", "deepseek-coder", "deepseek-llm", "gpt-2", "llama-bpe", "llama-spm", "mpt", "phi-3",
    "qwen2", "qwen35", "refact", "starcoder",
]  # fmt: skip
# llama.cpp runs pre-tokenizer patterns it has no hand-written splitter for through std::regex, on
# text in which it has replaced every non-ASCII whitespace character (U+0085, U+00A0, U+1680,
# U+2000-U+200A, U+2028, U+2029, U+202F, U+205F, U+3000) with U+000B (unicode.cpp,
# unicode_regex_split). The DeepSeek cascades name literal ranges that hold such characters
# ("[\u0800-\u4e00]" holds U+2000-U+3000, the punctuation class holds U+3000), so there llama.cpp
# splits differently from the model's tokenizer.json, whose `tokenizers` (sharpi's too) sees the
# real code point: "\u2029 " is one piece for llama.cpp, two for tokenizer.json. For
# these vocabularies the strings are compared with non-ASCII whitespace replaced by a space, and
# the number of raw strings that differ is printed.
WHITESPACE_AS_VT = {"deepseek-llm", "deepseek-coder"}
N_STRINGS = int(os.environ.get("SHARPI_TOKENIZER_STRINGS", "3000"))
N_STRINGS_PER_PRE_NAME = 300


def _seed() -> int:
    seed = os.environ.get("SHARPI_TOKENIZER_SEED")
    return int(seed) if seed else random.SystemRandom().randrange(2**32)


SEED = _seed()


class LlamaCppVocab:
    """llama.cpp's tokenizer of one vocab-only GGUF file (no weights, no context)."""

    def __init__(self, path: Path):
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp refused {path} (its log says why)")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.buffer = (llama_cpp.llama_token * 4096)()

    def encode(self, text: str) -> list[int]:
        data = text.encode("utf-8")
        # As test-tokenizer-0.cpp: add_special=false, parse_special=false.
        n = llama_cpp.llama_tokenize(self.vocab, data, len(data), self.buffer, len(self.buffer), False, False)
        if n < 0:
            self.buffer = (llama_cpp.llama_token * -n)()
            n = llama_cpp.llama_tokenize(
                self.vocab, data, len(data), self.buffer, len(self.buffer), False, False
            )
        return list(self.buffer[:n])

    def close(self) -> None:
        llama_cpp.llama_model_free(self.model)
        self.model = None


def _disagreements(sharpi_tok: Tokenizer, llama_vocab: LlamaCppVocab, texts: list[str]) -> list:
    out = []
    for text in texts:
        want = llama_vocab.encode(text)
        got = sharpi_tok.encode(text, add_bos=False)
        if got != want:
            out.append((text, want, got))
    return out


def _ascii_whitespace(text: str) -> str:
    return "".join(" " if c > "\x7f" and c.isspace() else c for c in text)


def _report(what: str, bad: list, total: int) -> str:
    text, want, got = bad[0]
    return (
        f"{what}: {len(bad)}/{total} generated strings tokenize differently from llama.cpp "
        f"(seed {SEED}; replay with SHARPI_TOKENIZER_SEED={SEED}); first: {text!r}\n"
        f"  llama.cpp {want}\n  sharpi    {got}"
    )


@pytest.mark.parametrize("name", VOCABS)
def test_generated_text_matches_llama_cpp(vocab_fixtures_dir, name):
    path = vocab_fixtures_dir / f"ggml-vocab-{name}.gguf"
    print(f"seed {SEED}")  # shown with -s, and in every failure message
    texts = random_texts(SEED, N_STRINGS)
    tok = Tokenizer.from_metadata(_core.GgufFile(str(path)).metadata())
    llama_vocab = LlamaCppVocab(path)
    try:
        if name in WHITESPACE_AS_VT:
            raw = len(_disagreements(tok, llama_vocab, texts))
            print(
                f"{name}: {raw}/{len(texts)} raw strings differ (non-ASCII whitespace, see WHITESPACE_AS_VT)"
            )
            texts = [_ascii_whitespace(t) for t in texts]
        bad = _disagreements(tok, llama_vocab, texts)
    finally:
        llama_vocab.close()
    assert not bad, _report(name, bad, len(texts))


def _copy_with_pre(reader, dst: Path, pre: str) -> None:
    """Write every key of `reader` (a vocab-only GGUF) to dst with its own value types, changing only
    tokenizer.ggml.pre."""
    import gguf

    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch=arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # the header fields, and the key GGUFWriter writes itself
        value = pre if key == "tokenizer.ggml.pre" else field.contents()
        vtype = field.types[0]
        sub_type = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, vtype, sub_type=sub_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()


@pytest.fixture(scope="module")
def gpt2_reader(vocab_fixtures_dir):
    import gguf

    return gguf.GGUFReader(vocab_fixtures_dir / "ggml-vocab-gpt-2.gguf")


@pytest.mark.parametrize("pre", sorted(_PRE_TOKENIZERS))
def test_every_pre_tokenizer_name_matches_llama_cpp(gpt2_reader, tmp_path, pre):
    path = tmp_path / f"gpt-2-as-{pre}.gguf"
    _copy_with_pre(gpt2_reader, path, pre)
    tok = Tokenizer.from_metadata(_core.GgufFile(str(path)).metadata())
    assert tok.pre == pre
    try:
        llama_vocab = LlamaCppVocab(path)
    except RuntimeError:
        pytest.fail(f"sharpi accepts tokenizer.ggml.pre {pre!r} but llama.cpp refuses it")
    try:
        texts = random_texts(SEED, N_STRINGS_PER_PRE_NAME)
        if pre in WHITESPACE_AS_VT:
            texts = [_ascii_whitespace(t) for t in texts]
        bad = _disagreements(tok, llama_vocab, texts)
    finally:
        llama_vocab.close()
    assert not bad, _report(f"gpt-2 vocabulary as pre {pre!r}", bad, len(texts))
