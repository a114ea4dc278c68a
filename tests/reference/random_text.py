"""Seeded generator of text that is hard to tokenize: the cases where pre-tokenizer regexes, Unicode
category tables and byte fallback differ between implementations.

Each string joins a few random fragments: words in Latin (with and without diacritics, precomposed
and decomposed), Cyrillic, Greek, Arabic (with harakat), Hebrew, Devanagari and Thai (with their
vowel signs, which are combining marks), CJK, kana and Hangul; stray combining marks after spaces,
digits and punctuation; digit runs of every length from 1 to 24 (ASCII and other \\p{N}: Arabic-Indic,
Devanagari, fullwidth, superscripts, fractions, Roman numerals); English contractions ('s 't 're 've 'm
'll 'd) in every letter case, also after a space and with U+2019; emoji alone, with skin tones, as
ZWJ sequences, flags and keycaps; whitespace runs of spaces, \\t, \\n, \\r, \\r\\n and Unicode spaces;
ASCII and Unicode punctuation runs; code and URLs; special-token texts written as plain text; and
characters few vocabularies hold (CJK extension B, private use, mathematical letters, C0 controls,
U+FFFD, zero-width characters) that a SentencePiece vocabulary can only write with byte tokens.

Only assigned code points of long-standing Unicode versions are drawn, so that implementations with
different Unicode table versions are still expected to agree. The same seed gives the same strings.
"""

from __future__ import annotations

import random

_LATIN_WORDS = (
    "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "Hello", "WORLD", "World",
    "it", "is", "I", "a", "an", "of", "to", "in", "on", "naïve", "café", "résumé", "Straße",
    "façade", "Ångström", "İstanbul", "ŁÓDŹ", "smörgåsbord", "Ærø", "œuvre", "ﬁnance", "don",
    "can", "won", "shouldn", "THEY", "We", "you", "they", "He", "She", "John", "O", "CamelCase",
    "snake_case", "mixedCASE", "x", "y", "z",
)  # fmt: skip
_CONTRACTION_SUFFIXES = ("s", "t", "re", "ve", "m", "ll", "d")
_APOSTROPHES = ("'", "'", "'", "\u2019")

# (first, last) inclusive ranges of assigned letters per script.
_SCRIPTS = {
    "cyrillic": [(0x0410, 0x044F), (0x0401, 0x0401), (0x0451, 0x0451)],
    "greek": [(0x0391, 0x03A1), (0x03A3, 0x03C9)],
    "arabic": [(0x0627, 0x063A), (0x0641, 0x064A)],
    "hebrew": [(0x05D0, 0x05EA)],
    "devanagari": [(0x0915, 0x0939)],
    "thai": [(0x0E01, 0x0E2E)],
    "cjk": [(0x4E00, 0x9FA5)],
    "kana": [(0x3041, 0x3096), (0x30A1, 0x30FA)],
    "hangul": [(0xAC00, 0xD7A3)],
    "fullwidth_latin": [(0xFF21, 0xFF3A), (0xFF41, 0xFF5A)],
}
# Combining marks that follow letters of each script (Mn / Mc).
_SCRIPT_MARKS = {
    "arabic": [(0x064B, 0x0652)],
    "devanagari": [(0x093E, 0x094D), (0x0901, 0x0903)],
    "thai": [(0x0E31, 0x0E31), (0x0E34, 0x0E3A), (0x0E47, 0x0E4E)],
    "hebrew": [(0x05B0, 0x05BD)],
}
_COMBINING = [(0x0300, 0x036F), (0x20D0, 0x20DC), (0xFE20, 0xFE26)]

_OTHER_DIGITS = [(0x0660, 0x0669), (0x06F0, 0x06F9), (0x0966, 0x096F), (0xFF10, 0xFF19), (0x0E50, 0x0E59)]
_OTHER_NUMBERS = "²³¹¼½¾⅓⅔ⅠⅡⅢⅣⅫⅰⅱ①②⑳⓪〇"

_EMOJI = [(0x1F600, 0x1F64F), (0x1F300, 0x1F3FA), (0x1F680, 0x1F6C5), (0x2600, 0x2604), (0x2614, 0x2615)]
_HANDS = "\U0001f44b\U0001f44d\U0001f44f\U0001f64f\U0001f590\u270b\U0001f466\U0001f469\U0001f468"
_SKIN_TONES = [(0x1F3FB, 0x1F3FF)]
_ZWJ = "\u200d"
_ZWJ_SEQUENCES = (
    "\U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466",
    "\U0001f3f3\ufe0f\u200d\U0001f308",
    "\U0001f469\U0001f3fd\u200d\U0001f4bb",
    "\U0001f9d1\u200d\U0001f91d\u200d\U0001f9d1",
    "\u2764\ufe0f\u200d\U0001f525",
    "\U0001f441\ufe0f\u200d\U0001f5e8\ufe0f",
)
_KEYCAPS = ("#\ufe0f\u20e3", "1\ufe0f\u20e3", "*\u20e3", "9\u20e3")

_WHITESPACE = (
    [" "] * 8 + ["\t"] * 3 + ["\n"] * 4 + ["\r"] * 2 + ["\r\n"] * 2
    + ["\u00a0", "\u2002", "\u2003", "\u2009", "\u200a", "\u3000", "\u202f", "\u205f", "\u1680",
       "\u2028", "\u2029", "\u0085", "\x0b", "\x0c"]
)  # fmt: skip
_PUNCT = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~" + "—–…«»¿¡「」『』、。，！？·•§¶†‡‹›„“”‘’"
_CODE = (
    "def f(x):\n    return x ** 2\n", "if (a && b) { c[i] = d->e; }", "for i in range(10):", "x += 1;",
    "https://example.com/a/b?c=1&d=%20", "user@example.org", "#include <stdio.h>", "</div><br/>",
    "0x1F600", "3.14159", "1,000,000.00", "2026-11-27T22:04:31Z", "v1.2.3-rc4", "$HOME/.cache",
)  # fmt: skip
_SPECIAL_TEXTS = (
    "<s>", "</s>", "<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>",
    "<|eot_id|>", "<pad>", "<mask>", "<|fim_prefix|>", "[CLS]", "<think>",
)  # fmt: skip
# Characters few vocabularies hold: SentencePiece writes them with <0xXX> byte tokens.
_RARE = [
    (0x20000, 0x2A6D6),  # CJK extension B
    (0xE000, 0xF8FF),  # private use
    (0x1D400, 0x1D454),  # mathematical bold / italic letters (\p{L})
    (0x10000, 0x1000B),  # Linear B syllables
    (0x13000, 0x1342E),  # Egyptian hieroglyphs
    (0x0001, 0x0008),  # C0 controls
    (0x000E, 0x001F),
    (0x007F, 0x007F),
    (0xFFFD, 0xFFFD),
    (0xFEFF, 0xFEFF),
    (0x200B, 0x200D),
    (0x2060, 0x2060),
]


def _pick(rng: random.Random, ranges) -> str:
    first, last = ranges[rng.randrange(len(ranges))]
    return chr(rng.randint(first, last))


def _run(rng: random.Random, ranges, lo: int, hi: int) -> str:
    return "".join(_pick(rng, ranges) for _ in range(rng.randint(lo, hi)))


def _case(rng: random.Random, text: str) -> str:
    style = rng.randrange(4)
    if style == 0:
        return text.upper()
    if style == 1:
        return text.lower()
    if style == 2:
        return text.capitalize()
    return "".join(c.upper() if rng.random() < 0.5 else c.lower() for c in text)


def _latin(rng: random.Random) -> str:
    word = rng.choice(_LATIN_WORDS)
    if rng.random() < 0.2:  # decomposed: base letters followed by combining marks
        word = "".join(c + (_pick(rng, _COMBINING[:1]) if rng.random() < 0.3 else "") for c in word)
    return word


def _script(rng: random.Random) -> str:
    name = rng.choice(list(_SCRIPTS))
    out = []
    for _ in range(rng.randint(1, 8)):
        out.append(_pick(rng, _SCRIPTS[name]))
        marks = _SCRIPT_MARKS.get(name)
        if marks and rng.random() < 0.5:
            out.append(_run(rng, marks, 1, 2))
    return "".join(out)


def _stray_marks(rng: random.Random) -> str:
    lead = rng.choice([" ", "", "1", ".", "-", "\n", "a", "("])
    return lead + _run(rng, _COMBINING, 1, 3) + rng.choice(["", " ", "x", "!", "7"])


def _digits(rng: random.Random) -> str:
    length = rng.randint(1, 24)
    if rng.random() < 0.8:
        run = "".join(rng.choice("0123456789") for _ in range(length))
    else:
        run = _run(rng, _OTHER_DIGITS, length, length)
    if rng.random() < 0.3:
        run = rng.choice(_LATIN_WORDS) + run + rng.choice(["", "th", "px", "%", ".5", "k"])
    if rng.random() < 0.1:
        run += rng.choice(_OTHER_NUMBERS)
    return run


def _contraction(rng: random.Random) -> str:
    suffix = _case(rng, rng.choice(_CONTRACTION_SUFFIXES))
    apostrophe = rng.choice(_APOSTROPHES)
    word = _case(rng, rng.choice(_LATIN_WORDS)) if rng.random() < 0.8 else rng.choice(["", " ", "1", "."])
    tail = rng.choice(["", "", " ", "s", "x", "'", "!"])
    return word + apostrophe + suffix + tail


def _emoji(rng: random.Random) -> str:
    kind = rng.randrange(6)
    if kind == 0:
        return _run(rng, _EMOJI, 1, 3)
    if kind == 1:
        return rng.choice(_HANDS) + _pick(rng, _SKIN_TONES)
    if kind == 2:
        return rng.choice(_ZWJ_SEQUENCES)
    if kind == 3:  # a flag: two regional indicators (or a lone one)
        return "".join(chr(0x1F1E6 + rng.randrange(26)) for _ in range(rng.choice([1, 2, 2, 4])))
    if kind == 4:
        return rng.choice(_KEYCAPS)
    return _pick(rng, _EMOJI) + rng.choice(["\ufe0f", "\ufe0e", _ZWJ, ""]) + _pick(rng, _EMOJI)


def _whitespace(rng: random.Random) -> str:
    return "".join(rng.choice(_WHITESPACE) for _ in range(rng.randint(1, 8)))


def _punct(rng: random.Random) -> str:
    return "".join(rng.choice(_PUNCT) for _ in range(rng.randint(1, 6)))


def _rare(rng: random.Random) -> str:
    return _run(rng, _RARE, 1, 4)


_FRAGMENTS = (
    (_latin, 6), (_script, 5), (_stray_marks, 1), (_digits, 3), (_contraction, 3), (_emoji, 2),
    (_whitespace, 3), (_punct, 2), (lambda rng: rng.choice(_CODE), 1),
    (lambda rng: rng.choice(_SPECIAL_TEXTS), 1), (_rare, 1),
)  # fmt: skip
_MAKERS = [maker for maker, weight in _FRAGMENTS for _ in range(weight)]


def random_text(rng: random.Random) -> str:
    """One string of 1-12 fragments, joined by nothing, a space or a whitespace run."""
    parts = []
    for _ in range(rng.randint(1, 12)):
        parts.append(rng.choice(_MAKERS)(rng))
        joint = rng.random()
        parts.append("" if joint < 0.3 else " " if joint < 0.85 else _whitespace(rng))
    if rng.random() < 0.7:
        parts.pop()  # most strings end with their last fragment, some with a joint
    return "".join(parts)


def random_texts(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    return [random_text(rng) for _ in range(count)]
