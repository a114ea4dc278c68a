"""sharpi.tokenizer.Tokenizer against independent tokenizers.

Oracles:
- gpt2 (byte-level BPE): a BPE trained here with Hugging Face `tokenizers`, configured the way the
  real models' tokenizer.json files are (GPT-2's ByteLevel pre-tokenizer, Llama 3's / Qwen2's
  regex Split with ignore_merges where Llama 3 sets it). Its vocabulary and merges go through a
  real GGUF file (gguf.GGUFWriter -> gguf.GGUFReader) into Tokenizer.from_metadata, and the
  Tokenizer must encode and decode exactly like the trained object. A second, fully separate
  oracle re-implements GPT-2 BPE in plain Python over the `regex` module, using llama.cpp's
  spelling of the patterns, so the regex tables themselves are checked by another engine.
- llama (SentencePiece BPE): a tiny model trained here with `sentencepiece`, its pieces, scores and
  types exported into GGUF metadata; encodings and decodings must equal sentencepiece's.
Texts are random (seeded) mixes of words, unicode (accents, Cyrillic, CJK, emoji, flags), code,
digits and odd whitespace, plus fixed edge cases.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from sharpi import FormatError, InvalidArgument, MissingTensorError, UnsupportedError
from sharpi.tokenizer import (
    TOKEN_BYTE,
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_UNUSED,
    TOKEN_USER_DEFINED,
    Tokenizer,
)

gguf = pytest.importorskip("gguf")
tokenizers = pytest.importorskip("tokenizers")

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "hello",
    "world",
    "tokenizer",
    "engine",
    "expert",
    "mixture",
    "model",
    "streaming",
    "memory",
    "cache",
    "layer",
    "router",
    "token",
    "sample",
    "running",
    "runner",
    "ran",
    "runs",
    "don't",
    "it's",
    "we're",
    "they've",
    "I'm",
    "you'll",
    "he'd",
    "naïve",
    "café",
    "résumé",
    "über",
    "straße",
    "Größe",
    "façade",
    "piñata",
    "São",
    "Paulo",
    "Москва",
    "привет",
    "мир",
    "東京",
    "日本語",
    "中文",
    "你好",
    "世界",
    "한국어",
    "안녕하세요",
    "ελληνικά",
    "αλφα",
    "βήτα",
    "😀",
    "🚀",
    "👍🏽",
    "🇩🇪",
    "∑",
    "∫",
    "√",
    "π",
    "≈",
    "≠",
    "def",
    "class",
    "return",
    "lambda",
    "import",
    "numpy",
    "np.array([1,",
    "2,",
    "3])",
    "x",
    "+=",
    "1;",
    "y",
    "=",
    "x",
    "**",
    "2",
    "if",
    "a",
    "!=",
    "b:",
    "for",
    "i",
    "in",
    "range(10):",
    'print(f"{i:03d}")',
    "//",
    "comment",
    "/*",
    "block",
    "*/",
    "#include",
    "<vector>",
    "std::vector<int>",
    "0",
    "1",
    "2",
    "3",
    "12",
    "123",
    "1234",
    "12345",
    "3.14159",
    "1e-5",
    "0xFF",
    "2026-11-22",
    "$100",
    "50%",
    "a@b.com",
    "https://example.org/path?q=1",
]

CHARS = list("abcdefghijklmnopqrstuvwxyzABCXYZ0123456789 \t\n\r.,;:!?'\"()[]{}<>/\\|-_=+*&^%$#@~`") + [
    "é", "ß", "ж", "東", "😀", "🇩🇪", "\u200b", "\u00a0", "ü", "👍🏽", "\u3000", "’", "…", "٣", "Ⅻ",
]  # fmt: skip

EDGE_TEXTS = [
    "", " ", "  ", "a", " Hello", "Hello  world", "\n\nnew\nlines\t tabs", "trailing   ", "ÆØÅ ǅ ﬁ",
    "unseen: ✓ ☃ ⅞ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ʕ•ᴥ•ʔ", "don't DON'T we'Re", "1234567 12.5e-3", "    indented code():\n\treturn x",
    "<|im_start|>user\nhi<|im_end|>", "a<|endoftext|>b<|endoftext|>", "emoji 👩‍👩‍👧‍👦 zwj", "a\r\n\r\nb",
]  # fmt: skip


def make_corpus(seed: int, n_lines: int = 3000) -> list[str]:
    rng = np.random.default_rng(seed)
    seps = [" ", " ", " ", " ", "  ", ", ", ". ", "\t", " - ", "", "!", "? "]
    lines = []
    for _ in range(n_lines):
        parts = []
        for _ in range(int(rng.integers(3, 16))):
            w = WORDS[int(rng.integers(len(WORDS)))]
            if rng.random() < 0.1:
                w = w.capitalize()
            parts.append(w + seps[int(rng.integers(len(seps)))])
        lines.append("".join(parts).strip())
    return lines


def make_texts(seed: int, n: int) -> list[str]:
    rng = np.random.default_rng(seed)
    out = list(EDGE_TEXTS)
    for _ in range(n):
        if rng.random() < 0.5:
            k = int(rng.integers(1, 12))
            out.append(" ".join(WORDS[int(i)] for i in rng.integers(0, len(WORDS), k)))
        else:
            k = int(rng.integers(1, 40))
            out.append("".join(CHARS[int(i)] for i in rng.integers(0, len(CHARS), k)))
    return out


def gguf_metadata(tmp_path, fill) -> dict:
    """Write a tensor-less GGUF with fill(writer), read it back with gguf.GGUFReader as a dict."""
    path = tmp_path / "tok.gguf"
    w = gguf.GGUFWriter(str(path), arch="llama")
    fill(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader = gguf.GGUFReader(str(path))
    return {name: field.contents() for name, field in reader.fields.items()}


# ------------------------------------------------------------------------------------------ gpt2

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# The patterns as the models' tokenizer.json files spell them.
HF_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5's tokenizer.json pattern (Qwen/Qwen3.5-35B-A3B), copied from the model, not from sharpi.
HF_QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
HF_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def reference_pre_tokenizer(pre: str):
    from tokenizers import Regex, pre_tokenizers

    def split(*patterns):
        steps = [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in patterns]
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
        return pre_tokenizers.Sequence(steps)

    if pre in ("gpt-2", "olmo", "no-such-pre"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False), False
    if pre == "default":
        # llama.cpp's own cascade for "default" (llama-vocab.cpp), written out here independently.
        gpt2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
        return split(r"[\p{P}\$\+<=>\^~\|]+", gpt2, r"\p{N}+", r"[0-9]{3}"), False
    if pre == "llama-bpe":
        return split(HF_LLAMA3), True
    if pre in ("dbrx", "smaug-bpe"):
        return split(HF_LLAMA3), False
    if pre == "qwen2":
        return split(HF_QWEN2), False
    if pre == "qwen35":
        return split(HF_QWEN35), False
    if pre == "deepseek-llm":
        # No second source for this long table here; this case checks the cascade plumbing.
        from sharpi.tokenizer import _DEEPSEEK_LLM

        return split(*_DEEPSEEK_LLM), False
    raise AssertionError(pre)


def train_bpe(pre: str, vocab_size: int = 800):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    pre_tok, ignore_merges = reference_pre_tokenizer(pre)
    hf = HFTokenizer(models.BPE(ignore_merges=ignore_merges))
    hf.pre_tokenizer = pre_tok
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(make_corpus(0), trainer)
    return hf


def bpe_gguf_metadata(tmp_path, hf, pre: str, add_bos=None) -> dict:
    model = json.loads(hf.to_str())["model"]
    tokens = [None] * len(model["vocab"])
    for text, i in model["vocab"].items():
        tokens[i] = text
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    types = [TOKEN_CONTROL if t in SPECIALS else TOKEN_NORMAL for t in tokens]

    def fill(w):
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_eos_token_id(model["vocab"]["<|endoftext|>"])
        w.add_bos_token_id(model["vocab"]["<|endoftext|>"])
        if add_bos is not None:
            w.add_add_bos_token(add_bos)

    return gguf_metadata(tmp_path, fill)


@pytest.fixture(scope="module")
def trained_bpe():
    cache = {}

    def get(pre):
        if pre not in cache:
            cache[pre] = train_bpe(pre)
        return cache[pre]

    return get


@pytest.mark.parametrize(
    "pre", ["gpt-2", "default", "olmo", "llama-bpe", "qwen2", "qwen35", "dbrx", "smaug-bpe", "deepseek-llm"]
)
def test_gpt2_matches_trained_tokenizers(tmp_path, trained_bpe, pre):
    hf = trained_bpe(pre)
    tok = Tokenizer.from_metadata(bpe_gguf_metadata(tmp_path, hf, pre))
    assert tok.model == "gpt2" and tok.pre == pre and tok.n_vocab == hf.get_vocab_size()
    for text in make_texts(seed=len(pre), n=300):
        hf.encode_special_tokens = False
        want_special = hf.encode(text, add_special_tokens=False).ids
        hf.encode_special_tokens = True
        want_plain = hf.encode(text, add_special_tokens=False).ids
        assert tok.encode(text, add_bos=False, special=True) == want_special, repr(text)
        assert tok.encode(text, add_bos=False, special=False) == want_plain, repr(text)
        assert tok.decode(want_special) == hf.decode(want_special, skip_special_tokens=False), repr(text)
        assert tok.decode(want_special, skip_special=True) == hf.decode(
            want_special, skip_special_tokens=True
        )
        assert tok.decode(want_plain) == text  # byte-level BPE is lossless


def test_unknown_pre_is_unsupported_unless_opted_in(tmp_path, trained_bpe):
    hf = trained_bpe("gpt-2")
    md = bpe_gguf_metadata(tmp_path, hf, "no-such-pre")
    with pytest.raises(UnsupportedError, match="no-such-pre"):
        Tokenizer.from_metadata(md)
    with pytest.raises(InvalidArgument, match="pre_fallback"):
        Tokenizer.from_metadata(md, pre_fallback="llama3")
    with pytest.warns(UserWarning, match="no-such-pre"):
        tok = Tokenizer.from_metadata(md, pre_fallback="gpt-2")
    for text in make_texts(seed=5, n=50):
        assert tok.encode(text, add_bos=False) == hf.encode(text, add_special_tokens=False).ids


def test_add_bos_defaults_and_overrides(tmp_path, trained_bpe):
    hf = trained_bpe("gpt-2")
    eot = hf.token_to_id("<|endoftext|>")
    body = hf.encode("hi there", add_special_tokens=False).ids
    gpt2 = Tokenizer.from_metadata(bpe_gguf_metadata(tmp_path, hf, "gpt-2"))
    assert gpt2.encode("hi there") == body  # gpt2 default: no BOS
    assert gpt2.encode("hi there", add_bos=True) == [eot] + body
    llama3 = Tokenizer.from_metadata(bpe_gguf_metadata(tmp_path, trained_bpe("llama-bpe"), "llama-bpe"))
    assert llama3.encode("hi")[0] == eot  # llama3 pre-tokenizer group adds BOS by default
    explicit = Tokenizer.from_metadata(bpe_gguf_metadata(tmp_path, hf, "gpt-2", add_bos=True))
    assert explicit.encode("hi there") == [eot] + body
    assert explicit.encode("hi there", add_bos=False) == body


def test_end_of_generation_ids(tmp_path, trained_bpe):
    hf = trained_bpe("qwen2")
    tok = Tokenizer.from_metadata(bpe_gguf_metadata(tmp_path, hf, "qwen2"))
    v = hf.get_vocab()
    assert tok.eos_id == v["<|endoftext|>"]
    assert tok.eot_id == v["<|im_end|>"]  # found by text, as llama.cpp does
    assert tok.eog_ids == {v["<|endoftext|>"], v["<|im_end|>"]}
    assert tok.is_eog(v["<|im_end|>"]) and not tok.is_eog(v["<|im_start|>"])
    assert tok.is_special(v["<|im_start|>"]) and not tok.is_special(v["Ġthe"])


# Independent second oracle: GPT-2 BPE in plain Python over the `regex` module, with llama.cpp's
# adapted spelling of the patterns (explicit case classes instead of (?i:...)).
LCPP_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LCPP_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LCPP_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LCPP_CASCADES = {
    "gpt-2": [LCPP_GPT2],
    "llama-bpe": [LCPP_LLAMA3],
    "qwen2": [LCPP_QWEN2],
    "starcoder": [r"\p{N}", LCPP_GPT2],
    "deepseek-coder": [
        r"[\r\n]",
        r"\s?\p{L}+",
        r"\s?\p{P}+",
        "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
        r"\p{N}",
    ],
}


def regex_cascade(patterns, text):
    import regex

    pieces = [text] if text else []
    for pattern in patterns:
        compiled = regex.compile(pattern)
        out = []
        for piece in pieces:
            pos = 0
            for m in compiled.finditer(piece):
                if m.start() > pos:
                    out.append(piece[pos : m.start()])
                if m.end() > m.start():
                    out.append(m.group(0))
                pos = m.end()
            if pos < len(piece):
                out.append(piece[pos:])
        pieces = out
    return pieces


def gpt2_byte_alphabet():
    keep = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    )
    mapping, extra = {}, 0
    for b in range(256):
        if b in keep:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def plain_bpe(word: str, ranks: dict, vocab: dict) -> list[int]:
    parts = list(word)
    while len(parts) > 1:
        rank, i = min((ranks.get((parts[i], parts[i + 1]), math.inf), i) for i in range(len(parts) - 1))
        if rank == math.inf:
            break
        pair = (parts[i], parts[i + 1])
        merged, j = [], 0
        while j < len(parts):
            if j + 1 < len(parts) and (parts[j], parts[j + 1]) == pair:
                merged.append(parts[j] + parts[j + 1])
                j += 2
            else:
                merged.append(parts[j])
                j += 1
        parts = merged
    return [vocab[p] for p in parts]


@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe", "qwen2", "starcoder", "deepseek-coder"])
def test_pre_tokenizer_and_bpe_match_plain_python_oracle(tmp_path, trained_bpe, pre):
    pytest.importorskip("regex")
    hf = trained_bpe("gpt-2")  # any byte-level vocabulary will do: the oracle merges with its ranks
    tok = Tokenizer.from_metadata(bpe_gguf_metadata(tmp_path, hf, pre))
    model = json.loads(hf.to_str())["model"]
    ranks = {tuple(m if isinstance(m, list) else m.split(" ")): r for r, m in enumerate(model["merges"])}
    vocab = model["vocab"]
    alphabet = gpt2_byte_alphabet()
    ignore_merges = pre == "llama-bpe"
    for text in make_texts(seed=11, n=300):
        pieces = regex_cascade(LCPP_CASCADES[pre], text)
        assert tok.pre_tokenize(text) == pieces, repr(text)
        want = []
        for piece in pieces:
            mapped = "".join(alphabet[b] for b in piece.encode("utf-8"))
            if ignore_merges and mapped in vocab:
                want.append(vocab[mapped])
            else:
                want.extend(plain_bpe(mapped, ranks, vocab))
        assert tok.encode(text, add_bos=False) == want, repr(text)


def test_ignore_merges_only_for_llama3_group(tmp_path):
    # "abc" is in the vocabulary but the merges cannot build it from "a" "bc": Llama 3's
    # ignore_merges emits it whole, plain GPT-2 BPE stops at ["a", "bc"].
    tokens = ["a", "b", "c", "bc", "ab", "abc"]

    def md(pre):
        return {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": pre,
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.merges": ["b c", "a b"],
            "tokenizer.ggml.add_bos_token": False,
        }

    assert Tokenizer.from_metadata(md("gpt-2")).encode("abc") == [0, 3]
    assert Tokenizer.from_metadata(md("llama-bpe")).encode("abc") == [5]
    assert Tokenizer.from_metadata(md("dbrx")).encode("abc") == [0, 3]


def test_user_defined_tokens_always_parsed(tmp_path, trained_bpe):
    hf = trained_bpe("gpt-2")
    md = bpe_gguf_metadata(tmp_path, hf, "gpt-2")
    tokens = list(md["tokenizer.ggml.tokens"]) + ["<tool_call>"]
    md["tokenizer.ggml.tokens"] = tokens
    md["tokenizer.ggml.token_type"] = list(md["tokenizer.ggml.token_type"]) + [TOKEN_USER_DEFINED]
    tok = Tokenizer.from_metadata(md)
    ud = len(tokens) - 1
    plain = hf.encode("x ", add_special_tokens=False).ids
    for special in (False, True):
        assert tok.encode("x <tool_call>", add_bos=False, special=special) == plain + [ud]
    assert tok.decode([ud]) == "<tool_call>"


# ------------------------------------------------------------------------------------------ streaming


def longest_complete_prefix(data: bytes) -> str:
    for cut in range(len(data), max(len(data) - 4, -1), -1):
        try:
            return data[:cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
    raise AssertionError("not UTF-8")


def test_stream_decoder_yields_complete_utf8_only(tmp_path, trained_bpe):
    hf = trained_bpe("llama-bpe")
    tok = Tokenizer.from_metadata(bpe_gguf_metadata(tmp_path, hf, "llama-bpe"))
    split_inside_char = 0
    for text in make_texts(seed=3, n=200):
        ids = tok.encode(text, add_bos=False)
        dec = tok.stream()
        produced = ""
        for k, tid in enumerate(ids):
            produced += dec.push(tid)
            so_far = b"".join(tok.token_to_bytes(t) for t in ids[: k + 1])
            assert produced == longest_complete_prefix(so_far), repr(text)
            split_inside_char += produced.encode() != so_far
        produced += dec.flush()
        assert produced == text == tok.decode(ids)
    assert split_inside_char > 0  # the texts did cut characters between tokens


def test_stream_decoder_invalid_bytes_and_specials(tmp_path, trained_bpe):
    hf = trained_bpe("gpt-2")
    tok = Tokenizer.from_metadata(bpe_gguf_metadata(tmp_path, hf, "gpt-2"))
    v = hf.get_vocab()
    lead = v[gpt2_byte_alphabet()[0xF0]]  # first byte of a 4-byte character, then nothing
    ids = [v["<|im_start|>"], lead, v["a"], v["<|im_end|>"]]
    assert "".join(tok.detokenize_stream(ids)) == "\ufffda" == tok.decode(ids, skip_special=True)
    dec = tok.stream(skip_special=False)
    out = "".join(dec.push(t) for t in ids) + dec.flush()
    assert out == "<|im_start|>\ufffda<|im_end|>" == tok.decode(ids)
    dec = tok.stream()
    assert dec.push(lead) == "" and dec.flush() == "\ufffd"


# ------------------------------------------------------------------------------------------ llama / sentencepiece


def train_sentencepiece(tmp_path, name, **options):
    spm = pytest.importorskip("sentencepiece")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(make_corpus(1)), encoding="utf-8")
    settings = {
        "vocab_size": 700,
        "model_type": "bpe",
        "normalization_rule_name": "identity",
        "remove_extra_whitespaces": False,
        "add_dummy_prefix": True,
        "byte_fallback": True,
        "character_coverage": 0.995,
        "user_defined_symbols": ["<ud1>", "\u2581foo\u2581bar"],
        "num_threads": 1,
        "minloglevel": 2,
    }
    settings.update(options)
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / name), **settings)
    return spm.SentencePieceProcessor(model_file=str(tmp_path / f"{name}.model")), settings


def spm_gguf_metadata(tmp_path, sp, settings) -> dict:
    user_defined = set(settings["user_defined_symbols"])
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        piece = sp.id_to_piece(i)
        tokens.append(piece)
        scores.append(sp.get_score(i))
        if sp.is_unknown(i):
            types.append(2)
        elif sp.is_control(i):
            types.append(TOKEN_CONTROL)
        elif sp.is_unused(i):
            types.append(TOKEN_UNUSED)
        elif sp.is_byte(i):
            types.append(TOKEN_BYTE)
        elif piece in user_defined:
            types.append(TOKEN_USER_DEFINED)
        else:
            types.append(TOKEN_NORMAL)

    def fill(w):
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(sp.bos_id())
        w.add_eos_token_id(sp.eos_id())
        w.add_unk_token_id(sp.unk_id())
        w.add_add_space_prefix(settings["add_dummy_prefix"])
        if settings["remove_extra_whitespaces"]:
            w.add_remove_extra_whitespaces(True)

    return gguf_metadata(tmp_path, fill)


SPM_CONFIGS = {
    "byte_fallback": {},
    "no_byte_fallback": {"byte_fallback": False},
    "remove_extra_whitespaces": {"remove_extra_whitespaces": True},
    "no_space_prefix": {"add_dummy_prefix": False},
}


@pytest.mark.parametrize("config", list(SPM_CONFIGS))
def test_llama_matches_sentencepiece(tmp_path, config):
    sp, settings = train_sentencepiece(tmp_path, config, **SPM_CONFIGS[config])
    tok = Tokenizer.from_metadata(spm_gguf_metadata(tmp_path, sp, settings))
    assert tok.model == "llama" and tok.add_bos and tok.bos_id == sp.bos_id()
    for text in make_texts(seed=7, n=400):
        ids = sp.encode(text)
        assert tok.encode(text, add_bos=False) == ids, repr(text)
        assert tok.encode(text) == [sp.bos_id()] + ids
        if settings["byte_fallback"]:
            # Without byte fallback sentencepiece renders <unk> as " ⁇ "; llama.cpp (and sharpi)
            # render the piece text, so decodings are compared on lossless models only.
            assert tok.decode(ids) == sp.decode(ids), repr(text)
            assert tok.decode([sp.bos_id()] + ids, skip_special=True) == sp.decode(ids)


def test_numeric_arrays_may_be_numpy(tmp_path):
    # sharpi's own GGUF reader returns numeric arrays as numpy arrays; the result must not change.
    sp, settings = train_sentencepiece(tmp_path, "numpy")
    md = spm_gguf_metadata(tmp_path, sp, settings)
    md_np = dict(md)
    md_np["tokenizer.ggml.scores"] = np.asarray(md["tokenizer.ggml.scores"], dtype=np.float32)
    md_np["tokenizer.ggml.token_type"] = np.asarray(md["tokenizer.ggml.token_type"], dtype=np.int32)
    md_np["tokenizer.ggml.bos_token_id"] = np.uint32(md["tokenizer.ggml.bos_token_id"])
    tok = Tokenizer.from_metadata(md_np)
    for text in make_texts(seed=17, n=100):
        assert tok.encode(text) == [sp.bos_id()] + sp.encode(text)
    md_np["tokenizer.ggml.token_type"] = np.int32(1)
    with pytest.raises(FormatError, match="token_type"):
        Tokenizer.from_metadata(md_np)


def test_llama_special_tokens_split_like_llama_cpp(tmp_path):
    # With special=True, control tokens written in the text become their ids and each text
    # fragment is encoded on its own, a fragment after a control token getting the space prefix:
    # that is sentencepiece applied fragment by fragment.
    sp, settings = train_sentencepiece(tmp_path, "special")
    tok = Tokenizer.from_metadata(spm_gguf_metadata(tmp_path, sp, settings))
    bos, eos = sp.bos_id(), sp.eos_id()
    assert tok.encode("<s>hello world</s> again", add_bos=False, special=True) == (
        [bos] + sp.encode("hello world") + [eos] + sp.encode(" again")
    )
    assert tok.encode("a</s>b", special=True) == [bos] + sp.encode("a") + [eos] + sp.encode("b")
    # Without special=True the same text is plain text, exactly as sentencepiece reads it.
    assert tok.encode("a</s>b", add_bos=False) == sp.encode("a</s>b")
    assert eos in tok.eog_ids


def test_llama_unused_pieces_are_resegmented():
    # A hand-checked case of sentencepiece's rule: merging may pass through an UNUSED piece ("ab"),
    # but an unused piece is never emitted; it is split back into the pieces it was made of.
    tokens = ["<unk>", "<s>", "</s>", "\u2581", "a", "b", "c", "ab", "abc"]
    scores = [0, 0, 0, -1, -2, -3, -4, -0.5, -0.7]
    types = [2, 3, 3, 1, 1, 1, 1, TOKEN_UNUSED, 1]
    tok = Tokenizer.from_metadata({
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.add_space_prefix": False,
    })  # fmt: skip
    assert tok.encode("abc", add_bos=False) == [8]
    assert tok.encode("ab", add_bos=False) == [4, 5]
    assert tok.encode("abab c", add_bos=False) == [4, 5, 4, 5, 3, 6]
    assert tok.encode("x", add_bos=False) == [0]  # unknown, no byte tokens


# ------------------------------------------------------------------------------------------ metadata errors


def minimal_gpt2():
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": ["a", "b", "ab"],
        "tokenizer.ggml.merges": ["a b"],
    }


def test_bad_metadata_raises_typed_errors():
    with pytest.raises(MissingTensorError, match="tokenizer.ggml.model"):
        Tokenizer.from_metadata({})
    with pytest.raises(UnsupportedError, match="bert"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})
    md = minimal_gpt2()
    del md["tokenizer.ggml.tokens"]
    with pytest.raises(MissingTensorError, match="tokenizer.ggml.tokens"):
        Tokenizer.from_metadata(md)
    md = minimal_gpt2()
    del md["tokenizer.ggml.merges"]
    with pytest.raises(MissingTensorError, match="tokenizer.ggml.merges"):
        Tokenizer.from_metadata(md)
    md = minimal_gpt2()
    md["tokenizer.ggml.merges"] = ["ab"]
    with pytest.raises(FormatError, match=r"merges\[0\]"):
        Tokenizer.from_metadata(md)
    md = minimal_gpt2()
    md["tokenizer.ggml.merges"] = ["a c"]
    with pytest.raises(FormatError, match=r"merges\[0\] = 'a c': 'c' is not in"):
        Tokenizer.from_metadata(md)
    md = minimal_gpt2()
    md["tokenizer.ggml.token_type"] = [1, 1]
    with pytest.raises(FormatError, match="token_type"):
        Tokenizer.from_metadata(md)
    md = minimal_gpt2()
    md["tokenizer.ggml.eos_token_id"] = 3
    with pytest.raises(FormatError, match="eos_token_id"):
        Tokenizer.from_metadata(md)
    md = minimal_gpt2()
    md["tokenizer.ggml.tokens"] = "ab"
    with pytest.raises(FormatError, match="tokenizer.ggml.tokens"):
        Tokenizer.from_metadata(md)
    md = minimal_gpt2()
    md["tokenizer.ggml.add_bos_token"] = True
    with pytest.raises(FormatError, match="BOS"):
        Tokenizer.from_metadata(md)


def test_bad_ids_and_text_raise_invalid_argument():
    tok = Tokenizer.from_metadata(minimal_gpt2())
    assert tok.encode("abba") == [2, 1, 0]
    with pytest.raises(InvalidArgument, match="token id 3"):
        tok.decode([0, 3])
    with pytest.raises(InvalidArgument, match="-1"):
        tok.token_to_piece(-1)
    with pytest.raises(InvalidArgument):
        tok.encode(b"ab")
    with pytest.raises(InvalidArgument, match="BOS"):
        tok.encode("ab", add_bos=True)


def test_pieces_and_types(tmp_path):
    sp, settings = train_sentencepiece(tmp_path, "pieces")
    tok = Tokenizer.from_metadata(spm_gguf_metadata(tmp_path, sp, settings))
    newline = sp.piece_to_id("<0x0A>")
    word = next(
        i for i in range(sp.get_piece_size())
        if tok.token_type(i) == TOKEN_NORMAL and sp.id_to_piece(i).startswith("\u2581") and len(sp.id_to_piece(i)) > 2
    )  # fmt: skip
    assert tok.id_to_token(word) == sp.id_to_piece(word)
    assert tok.token_to_piece(word) == " " + sp.id_to_piece(word)[1:]
    assert tok.token_to_piece(sp.piece_to_id("\u2581foo\u2581bar")) == " foo bar"
    assert tok.token_to_bytes(newline) == b"\n" and tok.token_type(newline) == TOKEN_BYTE
    assert tok.token_to_piece(sp.bos_id()) == "<s>"
    assert tok.decode([sp.bos_id()]) == "<s>" and tok.decode([sp.bos_id()], skip_special=True) == ""


# ------------------------------------------------------------------------------------------ chat template

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_chat_template(tmp_path, trained_bpe):
    pytest.importorskip("jinja2")
    hf = trained_bpe("qwen2")
    md = bpe_gguf_metadata(tmp_path, hf, "qwen2")
    assert Tokenizer.from_metadata(md).chat_template is None
    with pytest.raises(UnsupportedError, match="chat template"):
        Tokenizer.from_metadata(md).apply_chat_template([{"role": "user", "content": "hi"}])
    md["tokenizer.chat_template"] = CHATML
    tok = Tokenizer.from_metadata(md)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ☃"}]
    text = tok.apply_chat_template(messages)
    assert (
        text
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi ☃<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(messages, add_generation_prompt=False).endswith("<|im_end|>\n")
    ids = tok.encode(text, special=True)
    v = hf.get_vocab()
    assert ids.count(v["<|im_start|>"]) == 3 and ids.count(v["<|im_end|>"]) == 2
    bad = Tokenizer.from_metadata(
        {**md, "tokenizer.chat_template": "{{ raise_exception('no system role') }}"}
    )
    with pytest.raises(InvalidArgument, match="no system role"):
        bad.apply_chat_template(messages)


def test_llama_stream_with_byte_fallback(tmp_path):
    # Characters the tiny model never saw are byte-fallback tokens: a 4-byte emoji is 4 tokens, and
    # the stream must hold the text back until the 4th arrives.
    sp, settings = train_sentencepiece(tmp_path, "stream")
    tok = Tokenizer.from_metadata(spm_gguf_metadata(tmp_path, sp, settings))
    held_back = 0
    for text in make_texts(seed=13, n=150):
        ids = sp.encode(text)
        dec = tok.stream(at_start=True)
        produced = ""
        for tid in ids:
            piece = dec.push(tid)
            held_back += piece == "" and tok.token_type(tid) == TOKEN_BYTE
            produced += piece
            assert "\ufffd" not in produced, repr(text)
        produced += dec.flush()
        assert produced == sp.decode(ids), repr(text)
        # Mid-sequence (after a prompt) the space marker of the first token is kept.
        keeps_marker = bool(ids) and sp.id_to_piece(ids[0]).startswith("\u2581")
        assert "".join(tok.detokenize_stream(ids)) == (" " if keeps_marker else "") + sp.decode(ids)
    assert held_back > 0
