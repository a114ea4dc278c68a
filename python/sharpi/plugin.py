"""sharpi.Predictor: the base class of Python predictor plug-ins (docs/predictors.md).

A plug-in guesses which experts the next layers will select, so the expert cache can start those
reads early. It can only change what is read when, never which experts compute: a wrong or failing
predictor costs bandwidth, never a token.

    class Mine(sharpi.Predictor):
        def observe(self, layer, hidden, router_logits, history, prev):
            return [(layer + 1, int(router_logits.argmax()), 1.0)]

    s = sharpi.Session("model.gguf", ram_budget="6GiB", predictor=Mine(), lookahead=2)

observe() runs on the decode thread once per MoE layer of every decoded token (not for prompt
batches), holding the GIL only for the call. Its arguments are read-only numpy views valid during
the call: hidden float32 [n_embd] (the residual entering the layer's MoE block, before ffn_norm),
router_logits float32 [n_expert], history and prev int32 [n_layer, top_k] (this token's selections
of layers 0..layer, later rows -1; the previous token's, all -1 when there is none). It returns an
iterable of (target_layer, expert, score) or an array [n, 3]; targets must lie in
(layer, layer + lookahead]. Out-of-range hints are dropped and counted (`hints_dropped` in
Session.expert_stats()); an exception drops the call's hints and is kept in
Session.predictor_errors(). KeyboardInterrupt or SystemExit cancels the decode instead (nothing of
it is appended) and reaches the caller. It must not call back into the Session.

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

from collections.abc import Iterable

import numpy as np


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
