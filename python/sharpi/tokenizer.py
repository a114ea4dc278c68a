"""Tokenizer built from GGUF metadata: byte-level BPE ("gpt2") and SentencePiece BPE ("llama").

What it owns: the vocabulary (pieces, scores, token types), the special token ids and, for "gpt2",
two Hugging Face `tokenizers` objects built once from the vocabulary and merges (one parses
control tokens in the text, one does not, so no shared flag is ever toggled). It reads nothing
from disk, never mutates the metadata it was given, and is immutable after construction, so one
instance may be shared between threads.

Encoding follows what llama.cpp does with the same GGUF metadata, which in turn follows the model's
original tokenizer:
- "gpt2": the pre-tokenizer regex named by tokenizer.ggml.pre splits the text, every piece is
  mapped to GPT-2's byte-to-unicode alphabet and merged by the rank of tokenizer.ggml.merges.
  The regexes are those of the models' own tokenizer.json files (llama.cpp carries adapted copies
  of the same patterns in llama-vocab.cpp).
- "llama": SentencePiece BPE. Spaces become U+2581 ("▁"), a "▁" is prepended when
  add_space_prefix is set, and adjacent symbols are merged highest score first (ties: leftmost)
  as long as the merged piece is in the vocabulary; symbols left unknown fall back to <0xXX> byte
  tokens. User-defined pieces are matched before merging and never merged further, unused pieces
  are split back into their halves, exactly as sentencepiece's BPE model does.

Control tokens (token type 3, and "unknown", type 2) are recognised in the text only when
encode(special=True); user-defined tokens (type 4) always are, as in llama.cpp.

Over 600 lines as one concept: the tokenizer of a GGUF file (both BPE kinds share the vocabulary,
special-token handling, chat template and streaming decode that make up most of it).
"""

from __future__ import annotations

import codecs
import heapq
import json
import re
import warnings
from collections.abc import Iterable, Iterator, Sequence

from ._core import FormatError, InvalidArgument, MissingTensorError, UnsupportedError

# GGUF token types (gguf.TokenType / llama_token_type).
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6

SPACE_MARKER = "\u2581"  # "▁", SentencePiece's escaped space

# Pre-tokenizer patterns, written as the models' tokenizer.json files write them (Oniguruma syntax,
# which `tokenizers` uses). A list is a cascade: every pattern splits the pieces the previous one
# produced, keeping matched and unmatched spans as separate pieces (llama.cpp applies its lists the
# same way).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5 / Qwen3.6 (tokenizer.ggml.pre "qwen35"): the pattern of their tokenizer.json. Unlike Qwen2's,
# letters take their combining marks (\p{M}) along, and a mark never starts a punctuation run.
_QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GPT-4o's o200k pattern, which Llama 4's and MiniMax-M2's tokenizer.json use too ("gpt-4o" and "llama4"
# are llama.cpp's LLAMA_VOCAB_PRE_TYPE_GPT4O, "minimax-m2" its MINIMAX_M2, which runs the same
# regexes), in llama.cpp's adapted form, so that files tokenize as llama.cpp tokenizes them: the tokenizer.json form splits a word into an upper-case run then a lower-case run
# by Unicode case (\p{Lu}, \p{Ll}, marks joining either); llama.cpp's form approximates the two classes
# by "a letter other than a-z" and "a letter other than A-Z", so outside ASCII (Cyrillic, marks) its
# words differ from the model's own tokenizer, and sharpi follows llama.cpp there.
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Non-ASCII ranges are written as escapes: an editor or a copy that normalises Unicode (NFC turns
# U+1FD3 into U+0390) would otherwise silently turn a range like U+1FD0-U+1FD3 into an empty one.
_CJK_HANGUL = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DEEPSEEK_LLM = [
    "[\r\n]",
    (
        "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
        "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
        "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
        "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
        "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
        "\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc"
        "\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
        "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
        "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06"
        "\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
        "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
        "\U0001e900-\U0001e943]+"
    ),
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    r"\s+$",
    _CJK_HANGUL,
    r"\p{N}+",
]
_DEEPSEEK_CODER = [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}"]
# DeepSeek-V3 / R1 / V3.1 / V3.2 / V4 ("deepseek-v3", llama.cpp's DEEPSEEK3_LLM; their tokenizer.json's
# Split sequence): digit runs of up to three, then runs of Han, hiragana and katakana, then words
# (with their marks; one leading ASCII punctuation character joins ASCII letters), punctuation and
# symbol runs, newlines and spaces.
_DEEPSEEK_V3 = [
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    (
        r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
]
_STARCODER = [r"\p{N}", _GPT2]
# llama.cpp's "default" (also what it uses when tokenizer.ggml.pre is missing, as in GGUF files from
# converters older than the pre-tokenizer key): punctuation runs first, then GPT-2's pattern, then
# digit runs cut into groups of three from the left. No model's tokenizer.json has this cascade; it
# is here so that such files tokenize as llama.cpp, which they were written for, tokenizes them.
_LLAMA_CPP_DEFAULT = [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"]

# tokenizer.ggml.pre -> (patterns, ignore_merges, add_bos default). The names and groups are
# llama.cpp's (llama-vocab.cpp): a name llama.cpp does not know is refused, a name it knows maps to
# the same patterns. "ignore_merges" means a pre-token that is itself in the vocabulary is emitted
# whole (Llama 3's tokenizer.json sets it).
_PRE_TOKENIZERS: dict[str, tuple[list[str], bool, bool]] = {}
for _names, _spec in [
    (
        (
            "gpt-2",
            "phi-2",
            "mpt",
            "olmo",
            "jina-es",
            "jina-de",
            "jina-v2-es",
            "jina-v2-de",
            "gigachat",
            "mellum",
            "trillion",
            "granite-docling",
        ),
        ([_GPT2], False, False),
    ),
    (
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "falcon-h1", "midm-2.0", "lfm2"),
        ([_LLAMA3], True, True),
    ),
    (("dbrx", "smaug-bpe", "chatglm-bpe"), ([_LLAMA3], False, False)),
    # GLM-4.5 / 4.6 / 4.7 (and GLM-5): chatglm-bpe's pattern with whole-vocabulary pre-tokens kept.
    (("glm4", "glm5"), ([_LLAMA3], True, False)),
    (("qwen2", "deepseek-r1-qwen", "stablelm2", "kormo", "hunyuan"), ([_QWEN2], False, False)),
    (("qwen35",), ([_QWEN35], False, False)),
    (("gpt-4o", "llama4", "minimax-m2"), ([_GPT4O], False, False)),
    (("default",), (_LLAMA_CPP_DEFAULT, False, False)),
    (("deepseek-llm",), (_DEEPSEEK_LLM, False, False)),
    (("deepseek-coder",), (_DEEPSEEK_CODER, False, False)),
    (("deepseek-v3",), (_DEEPSEEK_V3, False, False)),
    (
        ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"),
        (_STARCODER, False, False),
    ),
]:
    for _name in _names:
        _PRE_TOKENIZERS[_name] = _spec

# Token texts llama.cpp treats as end of generation whatever their id (llama-vocab.cpp keeps the
# same list; the converters do not always write eot/eom ids). llama.cpp also makes each of them a
# control token when the file types it otherwise (Phi-3 types "</s>" user-defined), so that text
# encoded without special=True never turns into an end-of-generation token.
_EOG_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
)  # fmt: skip
# gpt-oss's message markers, which llama.cpp always parses and renders (user-defined), whatever their type.
_ALWAYS_USER_DEFINED_TEXTS = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")
# Candidates for the single "end of turn" id when tokenizer.ggml.eot_token_id is absent, in order.
_EOT_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>", "_<EOT>", "<｜end▁of▁sentence｜>", "<end_of_utterance>",
)  # fmt: skip


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters.

    Printable Latin-1 bytes map to themselves; the other 68 (controls, space, 0x7f-0xa0, 0xad)
    map, in byte order, to U+0100, U+0101, ...
    """
    printable = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    out = {}
    extra = 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(0x100 + extra)
            extra += 1
    return out


_BYTE_TO_UNICODE = _byte_to_unicode()
_UNICODE_TO_BYTE = {c: b for b, c in _BYTE_TO_UNICODE.items()}
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class _Key:
    """Typed access to the metadata dict with errors that name the key."""

    def __init__(self, md: dict):
        self.md = md

    def get(self, key: str, kind, default=None):
        if key not in self.md or self.md[key] is None:
            return default
        value = self.md[key]
        if kind is bool:
            if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
                return bool(value)
        elif kind is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return value
            if hasattr(value, "__index__") and not isinstance(value, (bool, float)):
                return int(value)
        elif kind is str:
            if isinstance(value, str):
                return value
            if isinstance(value, (bytes, bytearray)):
                return _utf8(value, key)
        elif kind is list:
            if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
                value = value.tolist()  # numpy arrays: sharpi's GGUF reader returns numeric arrays so
                if isinstance(value, list):
                    return value
            elif not isinstance(value, (str, bytes)):
                try:
                    return list(value)
                except TypeError:
                    pass
        raise FormatError(
            f"[tokenizer] metadata key {key} has the wrong type: expected {kind.__name__}, "
            f"got {type(value).__name__}"
        )

    def require(self, key: str, kind):
        value = self.get(key, kind)
        if value is None:
            raise MissingTensorError(f"[tokenizer] metadata key {key} is missing")
        return value


def _utf8(value, what: str) -> str:
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as e:
        raise FormatError(f"[tokenizer] {what} is not valid UTF-8: {e}") from None


class _SentencePieceBPE:
    """SentencePiece's BPE encoding (bpe_model.cc semantics) over one text fragment.

    Merge targets are the NORMAL, USER_DEFINED and UNUSED pieces (sentencepiece's `pieces_`; the
    first id wins for a duplicated piece). Control, unknown and byte pieces are never produced by
    merging. Pure Python: O(n log n) in the fragment length, fine for prompts.
    """

    def __init__(self, pieces: list[str], scores: list[float], types: list[int], unk_id: int | None):
        self.scores = scores
        self.types = types
        self.unk_id = unk_id
        self.merge_ids: dict[str, int] = {}
        for i, (p, t) in enumerate(zip(pieces, types)):
            if t in (TOKEN_NORMAL, TOKEN_USER_DEFINED, TOKEN_UNUSED):
                self.merge_ids.setdefault(p, i)
        # User-defined pieces are matched greedily (longest first) on the escaped text.
        self.user_defined: dict[str, list[str]] = {}
        for p, t in zip(pieces, types):
            if t == TOKEN_USER_DEFINED and p:
                self.user_defined.setdefault(p[0], []).append(p)
        for lst in self.user_defined.values():
            lst.sort(key=len, reverse=True)
        self.byte_ids: dict[int, int] = {}
        for i, (p, t) in enumerate(zip(pieces, types)):
            if t == TOKEN_BYTE:
                m = _BYTE_PIECE.fullmatch(p)
                if m:
                    self.byte_ids.setdefault(int(m.group(1), 16), i)

    def encode(self, text: str, out: list[int]) -> None:
        # Initial symbols: user-defined pieces (frozen) or single code points.
        syms: list[str] = []
        frozen: list[bool] = []
        i, n = 0, len(text)
        while i < n:
            match = None
            for cand in self.user_defined.get(text[i], ()):
                if text.startswith(cand, i):
                    match = cand
                    break
            if match is not None:
                syms.append(match)
                frozen.append(True)
                i += len(match)
            else:
                syms.append(text[i])
                frozen.append(False)
                i += 1
        count = len(syms)
        if count == 0:
            return
        prev = list(range(-1, count - 1))
        nxt = list(range(1, count + 1))
        nxt[-1] = -1
        heap: list[tuple[float, int, int, str]] = []
        rev_merge: dict[str, tuple[str, str]] = {}

        def push(left: int, right: int) -> None:
            if left < 0 or right < 0 or frozen[left] or frozen[right]:
                return
            piece = syms[left] + syms[right]
            pid = self.merge_ids.get(piece)
            if pid is None:
                return
            # Highest score first, then leftmost: heapq pops the smallest tuple.
            heapq.heappush(heap, (-self.scores[pid], left, right, piece))
            if self.types[pid] == TOKEN_UNUSED:
                rev_merge[piece] = (syms[left], syms[right])

        for k in range(count - 1):
            push(k, k + 1)
        while heap:
            _, left, right, piece = heapq.heappop(heap)
            # Stale entry: one side was merged away or grew since it was queued. Symbols only ever
            # absorb their right neighbour, so two live entries queued as neighbours still are.
            if not syms[left] or not syms[right] or syms[left] + syms[right] != piece:
                continue
            syms[left] = piece
            syms[right] = ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            push(prev[left], left)
            push(left, nxt[left])

        pending_unk = False  # sentencepiece emits one <unk> for a run of unknown symbols
        k = 0
        while k != -1:
            pending_unk = self._resegment(syms[k], rev_merge, out, pending_unk)
            k = nxt[k]

    def _resegment(self, piece: str, rev_merge: dict, out: list[int], prev_unk: bool) -> bool:
        pid = self.merge_ids.get(piece)
        if pid is not None and self.types[pid] == TOKEN_UNUSED and piece in rev_merge:
            left, right = rev_merge[piece]
            prev_unk = self._resegment(left, rev_merge, out, prev_unk)
            return self._resegment(right, rev_merge, out, prev_unk)
        if pid is not None:
            out.append(pid)
            return False
        if self.byte_ids:
            for b in piece.encode("utf-8"):
                if b not in self.byte_ids:
                    raise FormatError(
                        f"[tokenizer] byte fallback token <0x{b:02X}> is missing from the vocabulary"
                    )
                out.append(self.byte_ids[b])
            return False
        if self.unk_id is None:
            raise FormatError(
                f"[tokenizer] text piece {piece!r} has no token and the vocabulary has "
                "neither byte tokens nor an unknown token"
            )
        if not prev_unk:
            out.append(self.unk_id)
        return True


class StreamDecoder:
    """Incremental detokenizer: push token ids, get back text as soon as it is complete UTF-8.

    A token may end inside a multi-byte character (byte-fallback tokens, byte-level BPE pieces of
    emoji/CJK); those bytes are held until the character completes. Invalid bytes come out as
    U+FFFD. Text is only ever returned once: concatenating every push() and the final flush()
    gives decode(ids) of the same ids (with at_start=True for a sequence that begins the text).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True, at_start: bool = False):
        self._tok = tokenizer
        self._skip_special = skip_special
        self._strip_space = at_start and tokenizer.model == "llama" and tokenizer.add_space_prefix
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        data = self._tok._piece_bytes(token_id, self._skip_special)
        # The space prefix belongs to the first token that writes text; specials do not count.
        if (
            self._strip_space
            and data
            and self._tok.token_type(token_id) not in (TOKEN_CONTROL, TOKEN_UNKNOWN)
        ):
            if data.startswith(b" "):
                data = data[1:]
            self._strip_space = False
        return self._utf8.decode(data)

    def flush(self) -> str:
        """Text of any incomplete trailing character (as U+FFFD); the decoder is reset."""
        return self._utf8.decode(b"", final=True)


# Names a message's reasoning goes by; templates read the first (gpt-oss's read "thinking").
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning_fields(messages: Sequence[dict]) -> list:
    """Messages whose reasoning, under any of _REASONING_FIELDS, is also under `thinking` and
    `reasoning_content` (transformers does the same before rendering)."""
    out = []
    for m in messages:
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        out.append(m if reasoning is None else {"thinking": reasoning, **m, "reasoning_content": reasoning})
    return out


_CHAT_ENV = None


def _chat_environment():
    """The Jinja environment chat templates render in: a sandbox set up as transformers'
    render_jinja_template sets up its own (trim_blocks, lstrip_blocks, loop controls, a `tojson`
    that leaves non-ASCII and HTML characters alone, raise_exception, strftime_now), so every
    template renders to the same text. `{% generation %}...{% endgeneration %}` (which marks the
    assistant's tokens for training masks) renders its body. One filter transformers lacks:
    `from_json`, which llama.cpp's Jinja engine has and its DeepSeek-V3.2 / V4 templates use to read
    a tool call's arguments given as OpenAI's JSON text (transformers fails on those messages)."""
    global _CHAT_ENV
    if _CHAT_ENV is not None:
        return _CHAT_ENV
    import datetime

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        tags = frozenset({"generation"})

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise InvalidArgument(f"[tokenizer] chat template: {message}")

    def as_json_value(value):
        # Jinja's map, select and friends give generators (llama.cpp's deepseek-r1 template writes
        # `tools | map(attribute='function') | tojson`): written as the list they yield, as
        # llama.cpp's minja (whose filters give lists) renders them; anything else is an error.
        if isinstance(value, Iterator):
            return list(value)
        raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys, default=as_json_value)

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.filters["from_json"] = json.loads
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    _CHAT_ENV = env
    return env


class Tokenizer:
    """Text <-> token ids for one GGUF model. Build with Tokenizer.from_metadata(metadata)."""

    def __init__(self, *_args, **_kwargs):
        raise TypeError("use Tokenizer.from_metadata(metadata)")

    # ---------------------------------------------------------------- construction

    @classmethod
    def from_metadata(cls, md: dict, pre_fallback: str | None = None) -> Tokenizer:
        """md: GGUF metadata as a dict of Python values (arrays as lists).

        Raises MissingTensorError for absent required keys, FormatError for malformed ones,
        UnsupportedError for a tokenizer.ggml.model other than "gpt2" and "llama", and for a
        tokenizer.ggml.pre sharpi does not know (as llama.cpp refuses one): the GPT-2 regex would
        encode such a model's text wrongly. pre_fallback="gpt-2" opts into that fallback anyway
        (with a warning); Session reads it from $SHARPI_PRE_TOKENIZER_FALLBACK.
        """
        if pre_fallback not in (None, "", "gpt-2"):
            raise InvalidArgument(f"[tokenizer] pre_fallback must be 'gpt-2' or None, not {pre_fallback!r}")
        self = object.__new__(cls)
        key = _Key(md)
        self.model = key.require("tokenizer.ggml.model", str)
        if self.model not in ("gpt2", "llama"):
            raise UnsupportedError(
                f"[tokenizer] tokenizer.ggml.model {self.model!r} is not supported "
                "(supported: 'gpt2', 'llama')"
            )

        tokens = key.require("tokenizer.ggml.tokens", list)
        if not tokens:
            raise FormatError("[tokenizer] tokenizer.ggml.tokens is empty")
        pieces = []
        for i, t in enumerate(tokens):
            if isinstance(t, str):
                pieces.append(t)
            elif isinstance(t, (bytes, bytearray)):
                pieces.append(_utf8(t, f"tokenizer.ggml.tokens[{i}]"))
            else:
                raise FormatError(
                    f"[tokenizer] tokenizer.ggml.tokens[{i}] is a {type(t).__name__}, not a string"
                )
        self._pieces = pieces
        n_vocab = len(pieces)
        # Last id wins for a duplicated piece, as in llama.cpp's token_to_id.
        self._text_to_id = {p: i for i, p in enumerate(pieces)}

        types = key.get("tokenizer.ggml.token_type", list)
        if types is None:
            types = [TOKEN_NORMAL] * n_vocab
        if len(types) != n_vocab:
            raise FormatError(
                f"[tokenizer] tokenizer.ggml.token_type has {len(types)} entries for {n_vocab} tokens"
            )
        self._types = [int(t) for t in types]
        scores = key.get("tokenizer.ggml.scores", list)
        if scores is None:
            scores = [0.0] * n_vocab
        if len(scores) != n_vocab:
            raise FormatError(
                f"[tokenizer] tokenizer.ggml.scores has {len(scores)} entries for {n_vocab} tokens"
            )
        self._scores = [float(s) for s in scores]

        # Special ids: an explicit id outside the vocabulary is a broken file; a default that does
        # not fit (tiny vocabularies) just means "none".
        def special(name: str, default: int | None) -> int | None:
            k = f"tokenizer.ggml.{name}_token_id"
            value = key.get(k, int)
            if value is None:
                return default if default is not None and 0 <= default < n_vocab else None
            if not 0 <= value < n_vocab:
                raise FormatError(f"[tokenizer] {k} = {value} is outside the vocabulary (n_vocab {n_vocab})")
            return value

        spm = self.model == "llama"
        self.bos_id = special("bos", 1 if spm else None)
        self.eos_id = special("eos", 2 if spm else None)
        self.unk_id = special("unknown", 0 if spm else None)
        self.pad_id = special("padding", None)
        self.eot_id = special("eot", None)
        self.eom_id = special("eom", None)
        if self.eot_id is None:
            for text in _EOT_TEXTS:
                tid = self._lookup_text(text)
                if tid is not None:
                    self.eot_id = tid
                    break
        if self.eom_id is None:
            self.eom_id = self._lookup_text("<|eom_id|>")
        eog = {t for t in (self.eos_id, self.eot_id, self.eom_id) if t is not None}
        for name in ("fim_pad", "fim_rep", "fim_sep"):
            tid = special(name, None)
            if tid is not None:
                eog.add(tid)
        for text in _EOG_TEXTS:
            tid = self._lookup_text(text)
            if tid is not None:
                eog.add(tid)
                if self._types[tid] != TOKEN_CONTROL:
                    self._types[tid] = TOKEN_CONTROL
        self._apply_llama_cpp_exceptions(eog)
        self.eog_ids = frozenset(eog)

        self.pre = None
        add_bos_default = spm
        self.add_space_prefix = False
        self.remove_extra_whitespaces = False
        if spm:
            self.add_space_prefix = key.get("tokenizer.ggml.add_space_prefix", bool, True)
            self.remove_extra_whitespaces = key.get("tokenizer.ggml.remove_extra_whitespaces", bool, False)
            self._spm = _SentencePieceBPE(pieces, self._scores, self._types, self.unk_id)
            self._hf_plain = self._hf_special = self._hf_split = None
        else:
            self.pre = key.get("tokenizer.ggml.pre", str)
            if not self.pre:
                warnings.warn(
                    "[tokenizer] tokenizer.ggml.pre is missing; using llama.cpp's 'default' pre-tokenizer",
                    stacklevel=2,
                )
                spec = _PRE_TOKENIZERS["default"]
            elif self.pre not in _PRE_TOKENIZERS:
                if not pre_fallback:
                    raise UnsupportedError(
                        f"[tokenizer] unknown pre-tokenizer {self.pre!r} (tokenizer.ggml.pre); the GPT-2 "
                        "fallback would split text differently from the model's own tokenizer. Opt in with "
                        "pre_fallback='gpt-2' (SHARPI_PRE_TOKENIZER_FALLBACK=gpt-2) to use it anyway"
                    )
                warnings.warn(
                    f"[tokenizer] unknown pre-tokenizer {self.pre!r}; using the GPT-2 pre-tokenizer (opted in)",
                    stacklevel=2,
                )
                spec = _PRE_TOKENIZERS["gpt-2"]
            else:
                spec = _PRE_TOKENIZERS[self.pre]
            patterns, ignore_merges, add_bos_default = spec
            merges = key.require("tokenizer.ggml.merges", list)
            self._hf_plain, self._hf_special = self._build_byte_level_bpe(patterns, ignore_merges, merges)
            self._spm = None

        self.add_bos = key.get("tokenizer.ggml.add_bos_token", bool, add_bos_default)
        self.add_eos = key.get("tokenizer.ggml.add_eos_token", bool, False)
        if self.add_bos and self.bos_id is None:
            raise FormatError(
                "[tokenizer] tokenizer.ggml.add_bos_token is set but the model has no BOS token"
            )
        if self.add_eos and self.eos_id is None:
            raise FormatError(
                "[tokenizer] tokenizer.ggml.add_eos_token is set but the model has no EOS token"
            )

        self.chat_template = key.get("tokenizer.chat_template", str)

        # Control (and unknown) tokens that encode(special=True) recognises in the text, longest
        # first so that "<|im_start|>" wins over a shorter token it begins with.
        specials = sorted(
            {p for p, t in zip(pieces, self._types) if t in (TOKEN_CONTROL, TOKEN_UNKNOWN) and p},
            key=len,
            reverse=True,
        )
        self._special_re = re.compile("|".join(re.escape(p) for p in specials)) if specials else None
        self._special_ids = {
            p: i for i, p in enumerate(pieces) if self._types[i] in (TOKEN_CONTROL, TOKEN_UNKNOWN)
        }
        return self

    def _lookup_text(self, text: str) -> int | None:
        return self._text_to_id.get(text)

    def _apply_llama_cpp_exceptions(self, eog: set) -> None:
        """The token-type fixes llama.cpp applies after its end-of-generation list (llama-vocab.cpp),
        so that every vocabulary splits and renders text as llama.cpp does. Mutates eog and _types."""
        for text in _ALWAYS_USER_DEFINED_TEXTS:
            tid = self._lookup_text(text)
            if tid is not None:
                self._types[tid] = TOKEN_USER_DEFINED
        texts = {self._pieces[t]: t for t in eog}
        # gpt-oss (o200k_harmony) and Solar Open: "<|end|>" ends a message, not the generation.
        if "<|end|>" in texts and (
            {"<|return|>", "<|call|>"} <= texts.keys() or {"<|calls|>", "<|flush|>"} <= texts.keys()
        ):
            eog.discard(texts["<|end|>"])
            self._types[texts["<|end|>"]] = TOKEN_USER_DEFINED
        # Gemma 4 and PLaMo 2: "</s>" is ordinary text.
        if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
            eog.discard(texts["</s>"])
            self._types[texts["</s>"]] = TOKEN_NORMAL

    @staticmethod
    def _parse_merges(merges: list) -> list[tuple[str, str]]:
        """'left right' strings -> (left, right). The separator is the first space after the first
        character (llama.cpp's rule), so a left part that is itself a space still parses."""
        pairs = []
        for i, m in enumerate(merges):
            if isinstance(m, (bytes, bytearray)):
                m = _utf8(m, f"tokenizer.ggml.merges[{i}]")
            if not isinstance(m, str):
                raise FormatError(
                    f"[tokenizer] tokenizer.ggml.merges[{i}] is a {type(m).__name__}, not a string"
                )
            pos = m.find(" ", 1)
            if pos < 0:
                raise FormatError(
                    f"[tokenizer] tokenizer.ggml.merges[{i}] = {m!r} is not two pieces separated by a space"
                )
            pairs.append((m[:pos], m[pos + 1 :]))
        return pairs

    def _build_byte_level_bpe(self, patterns: list[str], ignore_merges: bool, merges: list):
        from tokenizers import AddedToken, Regex, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        vocab = self._text_to_id
        pairs = self._parse_merges(merges)
        # `tokenizers` panics (a Rust backtrace on stderr) on a merge whose parts or result are not
        # tokens, so check first and name the entry. Comprehensions: this runs over ~150k merges.
        bad = [i for i, (left, right) in enumerate(pairs) if left not in vocab or right not in vocab
               or left + right not in vocab]  # fmt: skip
        if bad:
            left, right = pairs[bad[0]]
            part = next(p for p in (left, right, left + right) if p not in vocab)
            raise FormatError(
                f"[tokenizer] tokenizer.ggml.merges[{bad[0]}] = {left + ' ' + right!r}: {part!r} is not in "
                f"tokenizer.ggml.tokens ({len(bad)} bad merges)"
            )
        try:
            model = models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges, fuse_unk=False)
        except Exception as e:  # noqa: BLE001 - `tokenizers` raises untyped exceptions
            raise FormatError(
                f"[tokenizer] tokenizer.ggml.merges do not fit tokenizer.ggml.tokens: {e}"
            ) from None
        steps = [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in patterns]
        self._hf_split = pre_tokenizers.Sequence(list(steps))
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False))
        pre = pre_tokenizers.Sequence(steps)

        control = [p for p, t in zip(self._pieces, self._types) if t in (TOKEN_CONTROL, TOKEN_UNKNOWN) and p]
        user = [p for p, t in zip(self._pieces, self._types) if t == TOKEN_USER_DEFINED and p]
        built = []
        for parse_control in (False, True):
            hf = HFTokenizer(model)  # the BPE model is read-only after construction: shared
            hf.pre_tokenizer = pre
            if user:
                hf.add_tokens([AddedToken(p, special=False, normalized=False) for p in user])
            if control:
                hf.add_special_tokens([AddedToken(p, special=True, normalized=False) for p in control])
            # encode_special_tokens=True means "treat special added tokens as plain text".
            hf.encode_special_tokens = not parse_control
            built.append(hf)
        return built[0], built[1]

    # ---------------------------------------------------------------- vocabulary

    @property
    def n_vocab(self) -> int:
        return len(self._pieces)

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary entry as stored in the GGUF ("Ġhello", "▁hello", "<0x0A>", "<s>")."""
        self._check_id(token_id)
        return self._pieces[token_id]

    def token_type(self, token_id: int) -> int:
        self._check_id(token_id)
        return self._types[token_id]

    def token_score(self, token_id: int) -> float:
        self._check_id(token_id)
        return self._scores[token_id]

    def is_eog(self, token_id: int) -> bool:
        """True for ids that end generation (EOS, EOT, EOM and the end-of-turn texts llama.cpp knows)."""
        return token_id in self.eog_ids

    def is_special(self, token_id: int) -> bool:
        """True for control and unknown tokens (what decode(skip_special=True) leaves out)."""
        self._check_id(token_id)
        return self._types[token_id] in (TOKEN_CONTROL, TOKEN_UNKNOWN)

    def token_to_bytes(self, token_id: int) -> bytes:
        """The bytes the token stands for in text (a byte token is one byte, maybe half a character)."""
        return self._piece_bytes(token_id, skip_special=False)

    def token_to_piece(self, token_id: int) -> str:
        """The text the token stands for (" hello" for "▁hello"/"Ġhello"); bytes that are not a whole
        UTF-8 character come out as U+FFFD. Use StreamDecoder for text that must stay exact."""
        return self.token_to_bytes(token_id).decode("utf-8", errors="replace")

    def _check_id(self, token_id: int) -> None:
        if not isinstance(token_id, int) and hasattr(token_id, "__index__"):
            token_id = int(token_id)
        if not isinstance(token_id, int) or not 0 <= token_id < len(self._pieces):
            raise InvalidArgument(
                f"[tokenizer] token id {token_id!r} is outside the vocabulary [0, {len(self._pieces)})"
            )

    def _piece_bytes(self, token_id: int, skip_special: bool) -> bytes:
        self._check_id(token_id)
        token_id = int(token_id)
        t = self._types[token_id]
        piece = self._pieces[token_id]
        if t in (TOKEN_CONTROL, TOKEN_UNKNOWN):
            return b"" if skip_special else piece.encode("utf-8")
        if t == TOKEN_USER_DEFINED:
            # Rendered as written (llama.cpp does the same for both tokenizer types).
            return piece.replace(SPACE_MARKER, " ").encode("utf-8") if self._spm else piece.encode("utf-8")
        if t == TOKEN_BYTE:
            m = _BYTE_PIECE.fullmatch(piece)
            if m:
                return bytes([int(m.group(1), 16)])
            return piece.encode("utf-8")
        if t == TOKEN_UNUSED:
            return b""  # llama.cpp renders unused tokens as nothing
        if self._spm is not None:
            return piece.replace(SPACE_MARKER, " ").encode("utf-8")
        # Byte-level BPE: every character stands for one byte; characters outside GPT-2's byte
        # alphabet (hand-edited vocabularies) are taken as their own UTF-8.
        out = bytearray()
        for ch in piece:
            b = _UNICODE_TO_BYTE.get(ch)
            if b is None:
                out += ch.encode("utf-8")
            else:
                out.append(b)
        return bytes(out)

    # ---------------------------------------------------------------- encode / decode

    def encode(
        self, text: str, add_bos: bool | None = None, special: bool = False, add_eos: bool | None = None
    ) -> list[int]:
        """Token ids of text.

        add_bos / add_eos: None = the model's tokenizer.ggml.add_bos_token / add_eos_token.
        special: recognise control tokens written in the text ("<|im_start|>") as single tokens;
        when False they are tokenized as plain text.
        """
        if not isinstance(text, str):
            raise InvalidArgument(f"[tokenizer] encode() takes a str, got {type(text).__name__}")
        add_bos = self.add_bos if add_bos is None else bool(add_bos)
        add_eos = self.add_eos if add_eos is None else bool(add_eos)
        if add_bos and self.bos_id is None:
            raise InvalidArgument("[tokenizer] add_bos=True but the model has no BOS token")
        if add_eos and self.eos_id is None:
            raise InvalidArgument("[tokenizer] add_eos=True but the model has no EOS token")
        out: list[int] = [self.bos_id] if add_bos else []
        if self._spm is None:
            if text:
                hf = self._hf_special if special else self._hf_plain
                # encode_batch, not encode: it releases the GIL while it works (encode holds it, a
                # megabyte of text stalls every other thread for seconds); the same ids.
                out.extend(hf.encode_batch([text], add_special_tokens=False)[0].ids)
        else:
            self._encode_spm(text, special, out)
        if add_eos:
            out.append(self.eos_id)
        return out

    def pre_tokenize(self, text: str) -> list[str]:
        """The pieces the pre-tokenizer regexes cut text into (before byte mapping and merges);
        they concatenate back to text. SentencePiece models have no pre-tokenizer: [text]."""
        if self._hf_split is None:
            return [text] if text else []
        return [piece for piece, _ in self._hf_split.pre_tokenize_str(text)]

    def _encode_spm(self, text: str, special: bool, out: list[int]) -> None:
        # Fragments between control tokens are encoded separately; a fragment that starts the text
        # or follows a control token gets the space prefix (llama.cpp's rule).
        fragments: list = []
        if special and self._special_re is not None:
            pos = 0
            for m in self._special_re.finditer(text):
                if m.start() > pos:
                    fragments.append(text[pos : m.start()])
                fragments.append(self._special_ids[m.group(0)])
                pos = m.end()
            if pos < len(text):
                fragments.append(text[pos:])
        elif text:
            fragments.append(text)
        prev_special = True
        for frag in fragments:
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
                continue
            if self.remove_extra_whitespaces:
                frag = " ".join(w for w in frag.split(" ") if w)
            if self.add_space_prefix and prev_special and frag:
                frag = " " + frag
            self._spm.encode(frag.replace(" ", SPACE_MARKER), out)
            prev_special = False

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of ids. For SentencePiece models the space prefix of the first text token is
        removed, as sentencepiece does. Incomplete or invalid UTF-8 comes out as U+FFFD."""
        data = bytearray()
        strip = self._spm is not None and self.add_space_prefix
        for tid in ids:
            piece = self._piece_bytes(tid, skip_special)
            if strip and piece and self._types[int(tid)] not in (TOKEN_CONTROL, TOKEN_UNKNOWN):
                if piece.startswith(b" "):
                    piece = piece[1:]
                strip = False
            data += piece
        return data.decode("utf-8", errors="replace")

    def stream(self, skip_special: bool = True, at_start: bool = False) -> StreamDecoder:
        """A StreamDecoder for generated ids. at_start: the ids begin the text (strip the space
        prefix of the first text token, as decode() does); generation after a prompt leaves it False."""
        return StreamDecoder(self, skip_special=skip_special, at_start=at_start)

    def detokenize_stream(self, ids: Iterable[int], skip_special: bool = True) -> Iterator[str]:
        """Yields text pieces for ids as soon as each is complete UTF-8 (empty pieces are skipped)."""
        dec = self.stream(skip_special=skip_special)
        for tid in ids:
            text = dec.push(tid)
            if text:
                yield text
        tail = dec.flush()
        if tail:
            yield tail

    # ---------------------------------------------------------------- chat

    def apply_chat_template(
        self,
        messages: Sequence[dict],
        add_generation_prompt: bool = True,
        template: str | None = None,
        **extra,
    ) -> str:
        """Render messages ([{"role": ..., "content": ...}]) with the model's Jinja chat template.

        Encode the result with special=True (the template writes control tokens as text) and
        add_bos=False when the template already starts with the BOS text.
        Raises UnsupportedError when the model has no template or jinja2 is not installed.
        """
        source = template if template is not None else self.chat_template
        if not source:
            raise UnsupportedError("[tokenizer] the model has no chat template (tokenizer.chat_template)")
        try:
            import jinja2
        except ImportError:
            raise UnsupportedError("[tokenizer] chat templates need jinja2 (pip install jinja2)") from None
        try:
            compiled = _chat_environment().from_string(source)
        except jinja2.TemplateError as e:
            raise FormatError(f"[tokenizer] chat template does not parse: {e}") from None
        bos = self._pieces[self.bos_id] if self.bos_id is not None else ""
        eos = self._pieces[self.eos_id] if self.eos_id is not None else ""
        # As transformers' render_jinja_template: `tools` and `documents` are always defined (None
        # when not given), and a message's reasoning is visible under each name templates read.
        extra = {"tools": None, "documents": None, "bos_token": bos, "eos_token": eos, **extra}
        try:
            return compiled.render(
                messages=_alias_reasoning_fields(messages),
                add_generation_prompt=add_generation_prompt,
                **extra,
            )
        except InvalidArgument:
            raise  # the template's own raise_exception()
        except Exception as e:  # noqa: BLE001 - a template's TypeError on these messages is a bad request too
            what = str(e) if isinstance(e, jinja2.TemplateError) else f"{type(e).__name__}: {e}"
            raise InvalidArgument(f"[tokenizer] chat template failed to render: {what}") from None

    def __repr__(self) -> str:
        pre = f", pre={self.pre!r}" if self.pre else ""
        return f"Tokenizer(model={self.model!r}{pre}, n_vocab={self.n_vocab}, bos={self.bos_id}, eos={self.eos_id})"
