"""Constrained decoding: a token mask that keeps sampling inside a grammar, through llguidance.

Why llguidance (PyPI `llguidance`, the engine behind OpenAI's and guidance's structured output and
llama.cpp's optional one) rather than xgrammar: its wheel depends on nothing (xgrammar's pulls
torch, which the `serve` extra must not), it takes JSON schema, Lark and GBNF (llama-server's
`grammar` dialect) as they are, and it computes the next token's mask without precompiling
per-grammar tables, so a new request's schema costs milliseconds.

One GrammarMask constrains one generation: Session.generate calls it as its `logits_processor`
with the ids generated so far and the step's logits; it feeds the matcher the ids it has not seen,
computes the allowed set and returns a copy of the logits with every other token at -inf. When the
grammar is complete the only allowed token is end-of-generation, so generation stops there; a
reply cut by max_tokens is incomplete (finish_reason "length"). The mask is computed on the
generating thread (llguidance drops the GIL while it works).
"""

from __future__ import annotations

import json
import time

import numpy as np

from ._core import InvalidArgument, UnsupportedError


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise UnsupportedError("constrained decoding needs llguidance (pip install 'sharpi[serve]')") from None
    return llguidance


class _VocabView:
    """What llguidance.TokenizerWrapper reads from a tokenizer: each token's bytes (control tokens
    as 0xFF + their name, llguidance's mark for special tokens, so text never matches them and
    grammars name them as <[id]>), the end-of-generation id and a text encoder."""

    def __init__(self, tok):
        self._tok = tok
        self.eos_token_id = tok.eos_id if tok.eos_id is not None else min(tok.eog_ids)
        self.bos_token_id = tok.bos_id
        self.special_token_ids = [i for i in range(tok.n_vocab) if tok.is_special(i)]
        special = set(self.special_token_ids)
        self.tokens = [b"\xff" + tok.id_to_token(i).encode("utf-8") if i in special else tok.token_to_bytes(i)
                       for i in range(tok.n_vocab)]

    def __call__(self, text) -> list:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tok.encode(text, add_bos=False, add_eos=False)


def llg_tokenizer(tok):
    """The llguidance tokenizer of a sharpi Tokenizer, built once per tokenizer (~10 ms per 3 k
    tokens; cached on it). Every end-of-generation id ends a grammar."""
    cached = getattr(tok, "_llg_tokenizer", None)
    if cached is None:
        llg = _llguidance()
        eos = sorted(tok.eog_ids) or None
        cached = llg.LLTokenizer(llg.TokenizerWrapper(_VocabView(tok)), eos_token=eos)
        tok._llg_tokenizer = cached
    return cached


# -- grammars: each returns llguidance's grammar text (pass it to GrammarMask) -------------------

def json_schema_grammar(schema, whitespace_flexible: bool = False) -> str:
    """A grammar for JSON matching `schema` (a dict or its JSON text). whitespace_flexible=False
    (the default) allows no whitespace outside strings: a model that wanders would otherwise fill
    the allowed whitespace until max_tokens."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise InvalidArgument(f"json schema is not JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidArgument(f"a json schema must be an object, got {type(schema).__name__}")
    llg = _llguidance()
    try:
        return llg.LLMatcher.grammar_from_json_schema(
            schema, overrides={"whitespace_flexible": bool(whitespace_flexible)})
    except ValueError as e:
        raise InvalidArgument(f"json schema: {e}") from None


def json_object_grammar() -> str:
    """Any JSON object (response_format {"type": "json_object"})."""
    return json_schema_grammar({"type": "object"})


def gbnf_grammar(text: str) -> str:
    """A grammar from llama.cpp's GBNF (llama-server's `grammar` parameter) or Lark text."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidArgument("grammar must be non-empty GBNF text")
    llg = _llguidance()
    try:
        return llg.grammar_from("gbnf", text)
    except ValueError as e:
        raise InvalidArgument(f"grammar: {e}") from None


def lark_grammar(text: str) -> str:
    """A grammar from Lark text in llguidance's dialect (%json {schema} embeds a JSON schema)."""
    return _llguidance().LLMatcher.grammar_from_lark(text)


def marker_spelling(tok):
    """marker(text) for tool_calls.tool_call_grammar: `<[id]>` where `text` is exactly one control
    token of this vocabulary (DeepSeek's tool markers, Mistral's [TOOL_CALLS]), else a quoted
    literal (a text token or several)."""
    ids = {}
    for i in range(tok.n_vocab):
        if tok.is_special(i):
            ids[tok.id_to_token(i)] = i

    def marker(text: str) -> str:
        return f"<[{ids[text]}]>" if text in ids else json.dumps(text, ensure_ascii=False)

    return marker


def check_grammar(tok, grammar: str) -> None:
    """InvalidArgument with llguidance's message when the grammar does not compile for this vocabulary."""
    llg = _llguidance()
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, llg_tokenizer(tok))
    if is_error:
        raise InvalidArgument(f"grammar does not compile: {messages[0] if messages else 'unknown error'}")


class GrammarMask:
    """The logits processor of one constrained generation (see the module docstring).

    __call__(generated_ids, logits) -> masked copy of logits. generated_ids must extend the list of
    the previous call by the token sampled from its result (Session.generate's contract); a token
    the grammar refuses (a sampler that ignored the mask) raises InvalidArgument."""

    def __init__(self, tok, grammar: str):
        llg = _llguidance()
        self._tok = tok
        self._llg_tok = llg_tokenizer(tok)
        self._matcher = llg.LLMatcher(self._llg_tok, grammar, log_level=0)
        if self._matcher.is_error():
            raise InvalidArgument(f"grammar does not compile: {self._matcher.get_error()}")
        self._n_vocab = self._llg_tok.vocab_size
        self._bitmask = np.zeros((self._n_vocab + 31) // 32, dtype=np.int32)
        self._seen = 0
        self.n_masks = 0  # masks computed, and the seconds spent in __call__ (the cost per token)
        self.seconds = 0.0

    def fresh_copy(self) -> GrammarMask:
        """A mask for another generation under the same grammar, at the grammar's start (a server
        request's n choices each need their own: a mask follows one generation's tokens)."""
        other = object.__new__(GrammarMask)
        other.__dict__.update(self.__dict__)
        other._matcher = self._matcher.deep_copy()
        other._matcher.reset()
        other._bitmask = np.zeros_like(self._bitmask)
        other._seen, other.n_masks, other.seconds = 0, 0, 0.0
        return other

    @property
    def accepting(self) -> bool:
        """The text so far is a complete sentence of the grammar."""
        return self._matcher.is_accepting()

    def _advance(self, generated_ids) -> None:
        for token in generated_ids[self._seen:]:
            if not self._matcher.consume_token(int(token)):
                raise InvalidArgument(f"token {token} ({self._tok.token_to_piece(int(token))!r}) breaks the grammar: "
                                      f"{self._matcher.get_error()}")
        self._seen = len(generated_ids)

    def allowed(self, generated_ids) -> np.ndarray:
        """bool [n_vocab]: the tokens the grammar allows next."""
        self._advance(generated_ids)
        self._matcher.unsafe_compute_mask_ptr(self._bitmask.ctypes.data, self._bitmask.nbytes)
        if self._matcher.is_error():
            raise InvalidArgument(f"constrained decoding failed: {self._matcher.get_error()}")
        self.n_masks += 1
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")
        return bits[: self._n_vocab].astype(bool)

    def __call__(self, generated_ids, logits: np.ndarray) -> np.ndarray:
        t0 = time.perf_counter()
        try:
            return self._masked(generated_ids, logits)
        finally:
            self.seconds += time.perf_counter() - t0

    def _masked(self, generated_ids, logits: np.ndarray) -> np.ndarray:
        allowed = self.allowed(generated_ids)
        if not allowed.any():
            raise InvalidArgument("constrained decoding: the grammar allows no token here")
        if len(logits) != len(allowed):  # a model whose logits row is padded past the vocabulary
            allowed = np.resize(allowed, len(logits))
            allowed[self._n_vocab:] = False
        return np.where(allowed, logits, np.float32(-np.inf)).astype(np.float32, copy=False)
