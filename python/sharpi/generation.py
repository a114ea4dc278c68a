"""Generation: one sequence's sampling state machine, driven one decoded position at a time.

Session.generate drives one over Session.decode; Session.generate_batch and the server's slot
scheduler (server/scheduler.py) drive several, one per sequence, over Session.decode_batch. The
caller owns the decoding: it decodes the prompt, hands the logits of the last decoded position to
step(), decodes the token step() returns, and so on until `finished` is set. A Generation never
touches a Session, so a thread may hold many and step them in any order; it is not thread-safe
itself (one caller at a time).

What it holds: the sampler (the C++ Sampler, with presence/frequency penalties and a logit bias in
front of it: _penalized_sampler), the repetition window (history + prompt + generated ids), the
ids generated so far, the stream decoder that turns them into complete UTF-8, and the clock of
the request (prefill, first token, decode) for Session.last_stats.
"""

from __future__ import annotations

import math
import time
from collections import Counter, abc
from collections.abc import Mapping, Sequence
from typing import Callable

import numpy as np

from . import _core

# Why a Generation finished (Generation.finished): an end-of-generation token was sampled (not
# appended), max_tokens were generated, or the sequence's context is full.
EOS, LENGTH, CONTEXT = "eos", "length", "context"


def _penalized_sampler(sampler, n_vocab: int, repeat_penalty: float, repeat_last_n: int,
                       presence_penalty: float, frequency_penalty: float,
                       logit_bias: Mapping[int, float] | None) -> Callable[[np.ndarray, list], int]:
    """sampler.sample, or with presence/frequency penalties and a logit bias in front of it.

    Those three are applied here, in Python, on a float32 copy of the logits, in llama.cpp's order
    (llama_sampler_logit_bias, then llama_sampler_penalties): bias, then repeat_penalty over the
    distinct tokens of the window, then - (presence + count * frequency). repeat_penalty moves here
    too so the order holds (the C++ sampler gets no recent ids and so skips it); every step is the
    same float32 operation the C++ one does. With all three off the C++ sampler runs alone, so the
    output is what it was before these options existed, bit for bit."""
    def real(value) -> bool:
        return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)

    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if not (real(value) and -2.0 <= value <= 2.0):  # NaN fails the comparison
            raise _core.InvalidArgument(f"{name} must be a finite number in [-2, 2] (0 = off), got {value!r}")
    if logit_bias is not None and not isinstance(logit_bias, abc.Mapping):
        raise _core.InvalidArgument(f"logit_bias must map token ids to biases, got {type(logit_bias).__name__}")
    bias_ids, bias_values = [], []
    for key, value in (logit_bias or {}).items():
        if isinstance(key, bool) or not isinstance(key, (int, np.integer)) or not 0 <= key < n_vocab:
            raise _core.InvalidArgument(f"logit_bias: token id {key!r} is not in the vocabulary [0, {n_vocab})")
        if not (real(value) and (-100.0 <= value <= 100.0 or value == -math.inf)):
            raise _core.InvalidArgument(f"logit_bias: the bias of token {key} must be in [-100, 100] "
                                        f"(-100 bans it), got {value!r}")
        bias_ids.append(int(key))
        bias_values.append(-math.inf if value <= -100.0 else float(value))
    if presence_penalty == 0.0 and frequency_penalty == 0.0 and not bias_ids:
        return sampler.sample
    bias_ids_a = np.array(bias_ids, dtype=np.int64)
    bias_values_a = np.array(bias_values, dtype=np.float32)
    repeat = np.float32(repeat_penalty)
    presence, frequency = np.float32(presence_penalty), np.float32(frequency_penalty)

    def sample(logits: np.ndarray, window: list) -> int:
        work = np.array(logits, dtype=np.float32)  # a copy: on_token sees the logits untouched
        work[bias_ids_a] += bias_values_a
        if repeat_last_n != 0:
            for token, count in Counter(window).items():
                if not 0 <= token < n_vocab:
                    raise _core.InvalidArgument(f"recent token {token} is outside the vocabulary [0, {n_vocab})")
                logit = work[token]
                logit = logit * repeat if logit <= 0 else logit / repeat
                work[token] = logit - (np.float32(count) * frequency + presence)
        return sampler.sample(work, [])

    return sample


class Generation:
    """The sampling of one sequence's answer (see the module docstring).

    Arguments are Session.generate's (its docstring says what each does), with the prompt as ids,
    the tokenizer (its eog_ids and stream decoder) and the model's n_vocab and the sequence's
    n_ctx. Bad values raise InvalidArgument here, in generate's order: max_tokens, then the
    sampler's own, then an empty prompt, then the penalties and logit_bias.

    Protocol: decode prompt_ids (after `history`, which the sequence already holds), call
    prefilled(), then step(logits of the last position, the sequence's n_past) until `finished`;
    after each step that did not finish, decode [next_token]. max_tokens == 0 is finished at once.
    """

    def __init__(
        self,
        tokenizer,
        n_vocab: int,
        n_ctx: int,
        prompt_ids: Sequence[int],
        max_tokens: int = 64,
        temperature: float = 0.8,
        top_k: int = 40,
        top_p: float = 0.95,
        min_p: float = 0.05,
        repeat_penalty: float = 1.0,
        repeat_last_n: int = 64,
        seed: int | None = None,
        stop_at_eos: bool = True,
        history: Sequence[int] = (),
        on_token: Callable[[int, np.ndarray], None] | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        logit_bias: Mapping[int, float] | None = None,
        logits_processor: Callable[[list, np.ndarray], np.ndarray] | None = None,
    ):
        if max_tokens < -1:
            raise _core.InvalidArgument(f"max_tokens must be >= 0, or -1 for no limit, got {max_tokens}")
        sampler = _core.Sampler(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repeat_penalty=repeat_penalty,
            repeat_last_n=repeat_last_n,
            seed=int(time.time_ns() & 0xFFFFFFFF) if seed is None else int(seed),
        )
        self.prompt_ids = list(prompt_ids)
        if not self.prompt_ids:
            raise _core.InvalidArgument("generate: empty prompt")
        self._sample = _penalized_sampler(sampler, n_vocab, repeat_penalty, repeat_last_n,
                                          presence_penalty, frequency_penalty, logit_bias)
        self.max_tokens, self.n_ctx = max_tokens, n_ctx
        self.repeat_last_n = repeat_last_n
        self.stop_ids = set(tokenizer.eog_ids) if stop_at_eos else set()
        self.on_token, self.logits_processor = on_token, logits_processor
        self._recent = [*history, *self.prompt_ids]
        # The ids sampled so far (end-of-generation ids are not appended); the list object stays
        # the same for the Generation's life, so a caller may hold it (Session.last_tokens).
        self.generated: list = []
        # The stream decoder emits text only once it is complete UTF-8 (a byte-level token can end
        # inside a character) and keeps SentencePiece's leading space of the first piece.
        self._stream = tokenizer.stream()
        self.finished: str | None = LENGTH if max_tokens == 0 else None
        # perf_counter clock: the request's start (construction), the end of its prefill, the
        # first sample, the last step.
        self.t_start = time.perf_counter()
        self.t_prefilled: float | None = None
        self.t_first: float | None = None
        self.t_last: float | None = None
        # sharpi.speculative.SpecStats when the generation speculates (the driver sets it).
        self.spec_stats = None

    @property
    def context(self) -> list:
        """The ids of the sequence so far: history, prompt, then the generated ids (the last one,
        next_token, not decoded yet). A draft source reads it; do not change it."""
        return self._recent

    def room(self, n_past: int) -> int:
        """How many draft tokens may follow next_token in one verify step: the answer's remaining
        tokens after it (max_tokens) and the context's free positions after it (n_ctx)."""
        room = self.n_ctx - n_past - 1
        if self.max_tokens >= 0:
            room = min(room, self.max_tokens - len(self.generated) - 1)
        return max(room, 0)

    @property
    def next_token(self) -> int:
        """The id to decode next: the last one sampled (only while not finished)."""
        return self.generated[-1]

    def prefilled(self) -> None:
        """The prompt is decoded: the clock's prefill ends and decode begins here."""
        self.t_prefilled = self.t_last = time.perf_counter()

    def step(self, logits: np.ndarray, n_past: int) -> str:
        """Samples the next token from `logits` (f32 [n_vocab], of the last decoded position) with
        the sequence holding n_past positions; returns the text it completes ("" while a character
        is incomplete, or when it finished on an end-of-generation token). Sets `finished` when
        this token ends the answer (it is then not to be decoded)."""
        if self.finished is not None:
            raise _core.InvalidArgument(f"Generation.step: already finished ({self.finished})")
        generated = self.generated
        shaped = logits if self.logits_processor is None else self.logits_processor(generated, logits)
        n = self.repeat_last_n
        token = self._sample(shaped, self._recent[-n:] if n > 0 else self._recent)
        now = time.perf_counter()
        if self.t_first is None:
            self.t_first = now
        self.t_last = now
        if token in self.stop_ids:
            self.finished = EOS
            return ""
        generated.append(token)
        self._recent.append(token)
        if self.on_token is not None:
            self.on_token(token, logits)
        if len(generated) == self.max_tokens:
            self.finished = LENGTH
        elif n_past >= self.n_ctx:
            self.finished = CONTEXT
        return self._stream.push(token)

    def verify(self, rows: np.ndarray, draft: Sequence[int], n_past: int) -> tuple:
        """One speculative verify step (sharpi.speculative): `rows` are the logits of the k + 1
        tokens [next_token, *draft] decoded in one step ([k + 1, n_vocab]) and n_past the positions
        the sequence holds after it. Samples from the rows in order, as step() would from one-token
        decodes, until a sampled token is not the next draft token (or the answer finishes).
        Returns (text, n_keep): the text step() produced and the positions to keep, those whose
        logits were used (the caller truncates the sequence to n_keep when it holds more)."""
        k = len(draft)
        if rows.shape[0] != k + 1:
            raise _core.InvalidArgument(f"Generation.verify: {rows.shape[0]} logit rows for {k} draft tokens")
        n0 = n_past - (k + 1)  # positions before the verify step
        text = []
        i = 0
        while True:
            text.append(self.step(rows[i], n0 + i + 1))
            if self.finished is not None or i == k or self.next_token != draft[i]:
                break
            i += 1
        if self.spec_stats is not None:
            self.spec_stats.record(k, i)
        return "".join(text), n0 + i + 1

    def flush(self) -> str:
        """The text of an incomplete trailing character (as U+FFFD), at the end."""
        return self._stream.flush()

    def stats(self, t_end: float | None = None) -> dict:
        """Session.last_stats of this generation: prompt and generated counts, prefill and decode
        seconds, time to the first token (from the start, prefill included), rates."""
        t_end = time.perf_counter() if t_end is None else t_end
        t_prefilled = self.t_prefilled if self.t_prefilled is not None else t_end
        t_prefill, t_decode = t_prefilled - self.t_start, t_end - t_prefilled
        n_prompt, n_generated = len(self.prompt_ids), len(self.generated)
        n_steps = max(n_generated - 1, 0)
        out = {
            "n_prompt": n_prompt,
            "n_generated": n_generated,
            "prefill_s": t_prefill,
            "decode_s": t_decode,
            "ttft_s": self.t_first - self.t_start if self.t_first is not None else t_prefill,
            "prefill_tok_s": n_prompt / t_prefill if t_prefill > 0 else 0.0,
            "decode_tok_s": n_steps / t_decode if t_decode > 0 and n_steps else 0.0,
            "tpot_s": t_decode / n_steps if n_steps else 0.0,
        }
        if self.spec_stats is not None:
            out.update(self.spec_stats.as_dict())
        return out
