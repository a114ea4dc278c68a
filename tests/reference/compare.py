"""Comparing an implementation's logits and greedy tokens with the float64 reference, and explaining
mismatches instead of hiding them behind looser tolerances.

Budgets are relative errors as numpy_forward.relative_error defines them (per position, max-abs
error over max-abs reference logit; the worst position counts).

Random routers can sit on near-ties: when the k-th and (k+1)-th router logits differ by less than
float32 rounding, an f32 implementation may pick a different top-k than the f64 reference, and from
that position on the logits legitimately differ by O(1). The checks here never widen the budget for
that. When logits disagree they find the first (position, layer) where the implementation's
selected experts differ from the reference's, and accept the mismatch only if
  - the reference's router margin there is below NEAR_TIE (a genuine rounding tie), and
  - every position before the flip still matches within budget,
issuing a warning that names the layer, position and margin. A flip at a clear margin, a mismatch
before any flip, or a mismatch with no routing information to explain it fails the test.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from .numpy_forward import ForwardResult, relative_error_per_position, router_margins, top2_logit_gap

# Router-logit gap (absolute; router logits here are O(1)) below which an f32 implementation may
# legitimately choose differently from f64. Measured f32-vs-f64 router-logit differences on the
# test models are ~1e-6, so 1e-4 leaves two orders of magnitude and still fails real routing bugs.
NEAR_TIE = 1e-4
# Same idea for greedy decoding: the gap between the two best output logits, relative to the
# largest |logit| at that position.
NEAR_TIE_OUTPUT = 1e-4


class NearTieWarning(UserWarning):
    """A mismatch fully explained by a rounding tie in the reference (see module docstring)."""


@dataclass
class RouterFlip:
    layer: int
    position: int
    reference_experts: tuple
    actual_experts: tuple
    margin: float  # the reference's k-th minus (k+1)-th router logit at (layer, position)

    def describe(self) -> str:
        return (
            f"layer {self.layer}, position {self.position}: reference experts {self.reference_experts}, "
            f"actual {self.actual_experts}, reference router margin {self.margin:.3e}"
        )


def first_router_flip(actual_scores: list, reference: ForwardResult, n_expert_used: int):
    """The earliest position (then lowest layer) where the top-n_expert_used set of actual_scores
    (per MoE layer, [n_tokens, n_expert] router logits or probabilities: the order is the same)
    differs from the reference's selection; None if they agree everywhere."""
    margins = router_margins(reference, n_expert_used)
    n_tokens = reference.logits.shape[0]
    for position in range(n_tokens):
        for layer, (scores, selected) in enumerate(zip(actual_scores, reference.selected_experts)):
            scores = np.asarray(scores, dtype=np.float64).reshape(n_tokens, -1)
            actual = tuple(sorted(np.argsort(-scores[position], kind="stable")[:n_expert_used].tolist()))
            expected = tuple(sorted(selected[position].tolist()))
            if actual != expected:
                return RouterFlip(layer, position, expected, actual, float(margins[layer, position]))
    return None


def _smallest_margins(
    reference: ForwardResult, n_expert_used: int, up_to_position: int, count: int = 3
) -> str:
    if not reference.router_logits:
        return "dense model (no router)"
    margins = router_margins(reference, n_expert_used)[:, : up_to_position + 1]
    order = np.argsort(margins, axis=None)[:count]
    layers, positions = np.unravel_index(order, margins.shape)
    return ", ".join(f"layer {la} pos {po}: {margins[la, po]:.2e}" for la, po in zip(layers, positions))


def assert_logits_match(
    actual,
    reference: ForwardResult,
    budget: float,
    what: str,
    n_expert_used: int = 0,
    actual_router_scores=None,
    diagnose=None,
    positions=None,
    near_tie: float = NEAR_TIE,
):
    """Assert actual logits equal the reference's within budget, or that the difference starts
    exactly at a router near-tie flip (see module docstring).

    actual: [len(positions), n_vocab], row i holding the logits for reference position positions[i]
    (positions defaults to all of them, in order).
    actual_router_scores: per MoE layer [n_tokens, n_expert] over ALL reference positions, or a
    callable returning them (called only on a mismatch, so a diagnostic run costs nothing when
    everything matches).
    diagnose: optional callable returning extra text for the failure message (e.g. which named
    intermediate activation diverges first).
    near_tie: the router margin below which a flip is accepted; NEAR_TIE (f32 rounding) unless the
    two sides legitimately compute different router logits (a quantized file vs the float model).
    Returns the RouterFlip that was accepted, or None."""
    n_tokens = reference.logits.shape[0]
    positions = np.arange(n_tokens) if positions is None else np.asarray(positions, dtype=np.int64)
    expected = reference.logits[positions]
    actual = np.asarray(actual, dtype=np.float64)
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: logits shape {actual.shape}, expected {expected.shape}")
    if not np.all(np.isfinite(actual)):
        bad_rows = positions[~np.isfinite(actual).all(axis=1)]
        raise AssertionError(f"{what}: non-finite logits at positions {bad_rows.tolist()}")
    per_row = relative_error_per_position(actual, expected)
    bad = np.nonzero(per_row > budget)[0]
    if bad.size == 0:
        return None

    first_bad = int(positions[bad[0]])
    summary = (
        f"{what}: relative error {per_row.max():.3e} > budget {budget:.1e}; first bad position "
        f"{first_bad} (error {per_row[bad[0]]:.3e}); per position "
        + " ".join(f"{p}:{e:.1e}" for p, e in zip(positions, per_row))
    )
    extra = ""
    if diagnose is not None:
        try:
            extra = "\n" + diagnose()
        except Exception as error:  # noqa: BLE001 - a failing diagnosis must never mask the real failure
            extra = f"\n(diagnosis failed: {error!r})"

    if not reference.router_logits:
        raise AssertionError(summary + extra)
    scores = actual_router_scores() if callable(actual_router_scores) else actual_router_scores
    if scores is None:
        raise AssertionError(
            summary + f"\nsmallest reference router margins up to there: "
            f"{_smallest_margins(reference, n_expert_used, first_bad)}" + extra
        )
    flip = first_router_flip(scores, reference, n_expert_used)
    if flip is None:
        raise AssertionError(
            summary + "\nthe implementation's expert choice (as far as it reports it) agrees with the "
            "reference everywhere: the mismatch is not explained by a router near-tie" + extra
        )
    if flip.position > first_bad:
        raise AssertionError(
            summary + f"\nlogits diverge before the first routing difference ({flip.describe()})" + extra
        )
    if flip.margin >= near_tie:
        raise AssertionError(
            summary
            + f"\nrouting differs at a clear margin (>= {near_tie:.0e}), not a rounding tie: {flip.describe()}"
            + extra
        )
    before = per_row[positions < flip.position]
    if before.size and before.max() > budget:
        raise AssertionError(
            summary + f"\npositions before the near-tie flip ({flip.describe()}) already differ" + extra
        )
    warnings.warn(
        NearTieWarning(
            f"{what}: router near-tie flipped the top-k at {flip.describe()}; positions before "
            f"{flip.position} match within {budget:.0e}, later positions are not comparable"
        )
    )
    return flip


def assert_greedy_match(actual_tokens, reference_logits, n_prompt: int, what: str):
    """actual_tokens: the tokens an implementation generated greedily after an n_prompt-token
    prompt; reference_logits: the reference's logits over prompt + actual_tokens (one causal pass).

    Greedy decoding of the reference would produce exactly actual_tokens iff every actual token is
    the reference's argmax given the tokens before it, so this one pass decides "same greedy
    tokens". A divergence is accepted only at a near-tie of the reference's two best logits, and
    then nothing after it is compared (the sequences legitimately part there)."""
    actual_tokens = [int(t) for t in actual_tokens]
    logits = np.asarray(reference_logits, dtype=np.float64)
    for step, token in enumerate(actual_tokens):
        row = logits[n_prompt - 1 + step]
        expected = int(np.argmax(row))
        if token == expected:
            continue
        gap = float(top2_logit_gap(row))
        scale = float(np.max(np.abs(row)))
        detail = (
            f"{what}: greedy token {step} is {token}, reference argmax {expected} "
            f"(reference logits {row[expected]:.6f} vs {row[token]:.6f}, top-2 gap {gap:.3e}, "
            f"max |logit| {scale:.3f}); tokens so far {actual_tokens[: step + 1]}"
        )
        if gap >= NEAR_TIE_OUTPUT * scale:
            raise AssertionError(detail)
        warnings.warn(NearTieWarning(detail + ": an output-logit near-tie; later tokens not compared"))
        return step
    return None


def first_divergent_activation(actual: dict, reference: ForwardResult, budget: float, limit: int = 6) -> str:
    """Text naming the first named activations (in the reference's computation order) whose values
    differ from the reference by more than budget; both sides name them "<op>-<layer>"."""
    lines = []
    compared = 0
    for name, expected in reference.intermediates.items():
        if name not in actual:
            continue
        value = np.asarray(actual[name], dtype=np.float64)
        if value.size != expected.size:
            lines.append(f"  {name}: shape {value.shape} vs reference {expected.shape} (not compared)")
            continue
        compared += 1
        error = float(np.max(relative_error_per_position(value.reshape(expected.shape[0], -1), expected)))
        if error > budget:
            lines.append(f"  {name}: relative error {error:.3e}")
            if len(lines) >= limit:
                break
    if compared == 0 and not lines:
        return "no named activation is recorded on both sides"
    if not lines:
        return f"all {compared} named activations both sides record agree within {budget:.0e}"
    return "first diverging activations:\n" + "\n".join(lines)
