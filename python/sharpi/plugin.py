"""sharpi.Predictor: the base class of Python predictor plug-ins (docs/predictors.md).

A plug-in guesses which experts the next layers will select, so the expert cache can start those
reads early. It can only change what is read when, never which experts compute: a wrong or failing
predictor costs bandwidth, never a token.

    class Mine(sharpi.Predictor):
        def observe(self, layer, hidden, router_logits, history, prev):
            return [(layer + 1, int(router_logits.argmax()), 1.0)]

    s = sharpi.Session("model.gguf", ram_budget="6GiB", predictor=Mine(), lookahead=2)

observe() runs on the decode thread once per MoE layer of every decoded token, holding the GIL
only for the call. A step of a few rows (2..31: several sequences decoding together, a speculative
verify step) calls it for each row at each MoE layer, rows in step order; longer prompt batches are
not observed. Its arguments are read-only numpy views valid during
the call: hidden float32 [n_embd] (the residual entering the layer's MoE block, before ffn_norm),
router_logits float32 [n_expert], history and prev int32 [n_layer, top_k] (this token's selections
of layers 0..layer, later rows -1; the previous token's, all -1 when there is none). It returns an
iterable of (target_layer, expert, score) or an array [n, 3]; targets must lie in
(layer, layer + lookahead]. Out-of-range hints are dropped and counted (`hints_dropped` in
Session.expert_stats()); an exception drops the call's hints and is kept in
Session.predictor_errors(). KeyboardInterrupt or SystemExit cancels the decode instead (nothing of
it is appended) and reaches the caller. It must not call back into the Session.

An observe() that takes a `step` keyword (or **kwargs) also gets the row's place as a StepRow:
sequence (the Session's sequence id), row and n_rows (its row among the step's rows), and
updates_state. In a multi-row step a row after its sequence's first has for `prev` the step's
earlier row of that sequence, whose rows after `layer` are still -1. updates_state is True when the
token continues the sequence whose history observe_context() and earlier `prev`s built, and `prev` is
that sequence's last completed token (always for single-token decoding; in a multi-row step only for
the first row of the sequence the plug-in follows): a plug-in folding `prev` into its history may do
so then, and otherwise predicts from the call's arguments and leaves its history alone. Another
sequence's history is handed over as a new sequence (observe_context) before the plug-in follows it.
echo is the row's echo guess: the selections of its token's latest earlier occurrence, or None.

A plug-in that keeps per-sequence history overrides observe_context(selections, new_sequence): after
a prompt batch it gets the selections int32 [n_tokens, n_layer, top_k] (read-only, valid during the
call) of the batch's tokens that observe() never saw, oldest first, so the prompt reaches its
history exactly as if each token had been decoded alone: every batch token but the last (which
arrives as the next observe()'s `prev`), led by the token decoded just before the batch when there
is one. new_sequence is True when the tokens start the sequence: a new session or reset(), or after
truncate(n_keep), when the kept tokens are handed over again (the history rewinds); the same after a
single-token decode that failed or was cancelled once observe() had seen its gates (nothing of it was
appended, so the history rewinds to the kept tokens). Exceptions are counted and kept as observe()'s are.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np


class StepRow(NamedTuple):
    """Where observe()'s token sits in its step (the `step` keyword; see the module docstring)."""

    sequence: int
    row: int
    n_rows: int
    updates_state: bool
    # int32 [n_layer, top_k] (read-only, valid during the call): the experts this token chose at its
    # latest earlier occurrence in the sequence, after the same previous token when there is one
    # (-1 where unknown); None when the token never occurred. The built-in "echo" predictor hints
    # exactly this (docs/speculative.md).
    echo: object = None


def observe_takes_step(predictor: object) -> bool:
    """Whether predictor.observe accepts the `step` keyword (a parameter of that name or **kwargs)."""
    try:
        params = inspect.signature(predictor.observe).parameters  # type: ignore[attr-defined]
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    return "step" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


class Predictor:
    """Subclass and implement observe(); see the module docstring for the contract."""

    def observe(
        self,
        layer: int,
        hidden: np.ndarray,
        router_logits: np.ndarray,
        history: np.ndarray,
        prev: np.ndarray,
    ) -> Iterable[tuple[int, int, float]]:
        raise NotImplementedError("subclasses of sharpi.Predictor implement observe()")

    def observe_context(self, selections: np.ndarray, new_sequence: bool) -> None:
        """A prompt batch's tokens that observe() never saw (see the module docstring); default: ignored."""
