"""Routing traces: loading, validation, the split by sequences, and per-token views.

What it owns: reading one trace `.npz` (the format of the shared traces README: `experts` int
[tokens, moe_layers, top_k] with -1 for a missing cell, `seq_start` int [sequences], `num_experts`,
`top_k`, optional `moe_layer_ids`; harvested traces may add `hidden` float16
[tokens, moe_layers, n_embd] = the residual stream entering each MoE block, `router_logits` float16
[tokens, moe_layers, n_expert] and `tokens`) into a `RoutingTrace`, checking it once so that every
consumer can trust its invariants:
  - ids are in [0, n_expert) or -1 (missing), and a row never names the same expert twice;
  - `seq_start` starts at 0 and strictly increases inside [0, tokens);
  - optional arrays have the matching leading shape.
It never modifies the file and never keeps it open: arrays are loaded eagerly (`hidden` stays float16
to halve the memory; consumers convert the rows they use).

Token indices are always indices into the whole trace. The previous token of token i is i-1 when both
lie in the same sequence, else none (-1): a sequence's first token has no previous token, whatever
precedes it in the file.
"""

from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass

import numpy as np


def _invalid(message: str) -> Exception:
    # Lazy import: the package's pure-numpy parts stay importable for tooling without the extension.
    from sharpi._core import InvalidArgument

    return InvalidArgument(message)


@dataclass
class RoutingTrace:
    """One validated routing trace. Arrays are indexed by global token index."""

    path: str
    experts: np.ndarray  # int16 [tokens, n_layer, top_k], -1 = missing
    seq_start: np.ndarray  # int64 [n_seq], seq_start[0] == 0, strictly increasing
    n_expert: int
    top_k: int
    moe_layer_ids: np.ndarray  # int64 [n_layer]: decoder block index of each MoE layer
    hidden: np.ndarray | None = None  # float16 [tokens, n_layer, n_embd]
    router_logits: np.ndarray | None = None  # float16 [tokens, n_layer, n_expert]
    tokens: np.ndarray | None = None  # int [tokens]

    @property
    def n_tokens(self) -> int:
        return int(self.experts.shape[0])

    @property
    def n_layer(self) -> int:
        return int(self.experts.shape[1])

    @property
    def n_seq(self) -> int:
        return int(self.seq_start.shape[0])

    @property
    def n_embd(self) -> int | None:
        return None if self.hidden is None else int(self.hidden.shape[2])

    def seq_end(self) -> np.ndarray:
        """int64 [n_seq]: one past the last token of each sequence."""
        return np.append(self.seq_start[1:], self.n_tokens).astype(np.int64)

    def prev_index(self) -> np.ndarray:
        """int64 [tokens]: the previous token of the same sequence, -1 for a sequence's first token."""
        prev = np.arange(self.n_tokens, dtype=np.int64) - 1
        prev[self.seq_start] = -1
        return prev

    def selected(self, idx: np.ndarray, layer: int) -> np.ndarray:
        """int [len(idx), top_k]: the ids selected at `layer` by tokens idx (-1 = missing or idx < 0).

        A negative token index (no previous token) gives a row of -1, so callers can pass
        prev_index()[idx] directly."""
        idx = np.asarray(idx, dtype=np.int64)
        rows = self.experts[np.maximum(idx, 0), layer].astype(np.int64)
        rows[idx < 0] = -1
        return rows

    def multi_hot(self, idx: np.ndarray, layer: int, dtype=np.float64) -> np.ndarray:
        """[len(idx), n_expert]: 1 where the token selected the expert at `layer` (missing cells
        and negative token indices contribute nothing)."""
        return ids_to_multi_hot(self.selected(idx, layer), self.n_expert, dtype)

    def hidden_rows(self, idx: np.ndarray, layer: int) -> np.ndarray:
        """float64 [len(idx), n_embd]: the residual entering `layer`'s MoE block."""
        if self.hidden is None:
            raise _invalid(f"trace {self.path}: has no 'hidden' array (harvest it with hidden states)")
        return self.hidden[np.asarray(idx, dtype=np.int64), layer].astype(np.float64)


def ids_to_multi_hot(ids: np.ndarray, n_expert: int, dtype=np.float64) -> np.ndarray:
    """ids int [N, k] with -1 = none -> [N, n_expert] with 1 at each listed id."""
    out = np.zeros((ids.shape[0], n_expert), dtype=dtype)
    rows, cols = np.nonzero(ids >= 0)
    out[rows, ids[rows, cols]] = 1
    return out


def _scalar(z, name: str, path: str) -> int:
    value = np.asarray(z[name])
    if value.size != 1 or not np.issubdtype(value.dtype, np.integer):
        raise _invalid(
            f"trace {path}: '{name}' must be an integer scalar, got dtype {value.dtype} shape {value.shape}"
        )
    return int(value.reshape(()))


def load_trace(path: str | os.PathLike) -> RoutingTrace:
    """Loads and validates a trace .npz; raises InvalidArgument naming the file and the array."""
    path = str(path)
    if not os.path.isfile(path):
        raise _invalid(f"trace {path}: no such file")
    try:
        z = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise _invalid(f"trace {path}: not a readable .npz file ({e})") from None
    with z:
        for name in ("experts", "seq_start"):
            if name not in z.files:
                raise _invalid(f"trace {path}: missing array '{name}' (has: {', '.join(z.files)})")
        experts = z["experts"]
        if experts.ndim != 3 or not np.issubdtype(experts.dtype, np.integer):
            raise _invalid(
                f"trace {path}: 'experts' must be an integer array [tokens, layers, top_k], "
                f"got dtype {experts.dtype} shape {experts.shape}"
            )
        n_tokens, n_layer, k_cols = experts.shape
        if n_tokens == 0 or n_layer == 0 or k_cols == 0:
            raise _invalid(f"trace {path}: 'experts' is empty (shape {experts.shape})")
        n_expert = _scalar(z, "num_experts", path) if "num_experts" in z.files else None
        top_k = _scalar(z, "top_k", path) if "top_k" in z.files else k_cols
        if n_expert is None:
            raise _invalid(f"trace {path}: missing array 'num_experts'")
        if top_k != k_cols:
            raise _invalid(f"trace {path}: 'top_k' is {top_k} but 'experts' has {k_cols} columns")
        if not 1 <= top_k <= n_expert:
            raise _invalid(f"trace {path}: 'top_k' {top_k} outside [1, num_experts={n_expert}]")
        if n_expert > 32767:
            raise _invalid(f"trace {path}: 'num_experts' {n_expert} too large")
        bad = (experts < -1) | (experts >= n_expert)
        if bad.any():
            t, layer, c = (int(v) for v in np.argwhere(bad)[0])
            raise _invalid(
                f"trace {path}: 'experts' id {int(experts[t, layer, c])} at token {t} layer {layer} "
                f"outside [0, {n_expert}) (-1 marks a missing cell)"
            )
        experts = experts.astype(np.int16)
        srt = np.sort(experts, axis=2)
        dup = ((srt[:, :, 1:] == srt[:, :, :-1]) & (srt[:, :, 1:] >= 0)).any(axis=2)
        if dup.any():
            t, layer = (int(v) for v in np.argwhere(dup)[0])
            raise _invalid(
                f"trace {path}: 'experts' row at token {t} layer {layer} names an expert twice: "
                f"{experts[t, layer].tolist()}"
            )

        seq_start = z["seq_start"]
        if seq_start.ndim != 1 or seq_start.size == 0 or not np.issubdtype(seq_start.dtype, np.integer):
            raise _invalid(
                f"trace {path}: 'seq_start' must be a non-empty 1-D integer array, got dtype "
                f"{seq_start.dtype} shape {seq_start.shape}"
            )
        seq_start = seq_start.astype(np.int64)
        if seq_start[0] != 0 or (np.diff(seq_start) <= 0).any() or seq_start[-1] >= n_tokens:
            raise _invalid(
                f"trace {path}: 'seq_start' must start at 0 and strictly increase below {n_tokens} tokens"
            )

        if "moe_layer_ids" in z.files:
            moe_layer_ids = z["moe_layer_ids"]
            if moe_layer_ids.shape != (n_layer,) or not np.issubdtype(moe_layer_ids.dtype, np.integer):
                raise _invalid(
                    f"trace {path}: 'moe_layer_ids' must be integer [{n_layer}], got dtype "
                    f"{moe_layer_ids.dtype} shape {moe_layer_ids.shape}"
                )
            moe_layer_ids = moe_layer_ids.astype(np.int64)
        else:
            moe_layer_ids = np.arange(n_layer, dtype=np.int64)

        hidden = router_logits = tokens = None
        if "hidden" in z.files:
            hidden = z["hidden"]
            if hidden.ndim != 3 or hidden.shape[:2] != (n_tokens, n_layer) or hidden.dtype.kind != "f":
                raise _invalid(
                    f"trace {path}: 'hidden' must be float [{n_tokens}, {n_layer}, n_embd], got "
                    f"dtype {hidden.dtype} shape {hidden.shape}"
                )
            if not np.isfinite(hidden).all():
                raise _invalid(f"trace {path}: 'hidden' holds non-finite values")
        if "router_logits" in z.files:
            router_logits = z["router_logits"]
            if router_logits.shape != (n_tokens, n_layer, n_expert) or router_logits.dtype.kind != "f":
                raise _invalid(
                    f"trace {path}: 'router_logits' must be float [{n_tokens}, {n_layer}, "
                    f"{n_expert}], got dtype {router_logits.dtype} shape {router_logits.shape}"
                )
        if "tokens" in z.files:
            tokens = z["tokens"]
            if tokens.shape != (n_tokens,):
                raise _invalid(f"trace {path}: 'tokens' must be [{n_tokens}], got shape {tokens.shape}")
    return RoutingTrace(
        path, experts, seq_start, n_expert, top_k, moe_layer_ids, hidden, router_logits, tokens
    )


@dataclass
class TraceSplit:
    """Sequences [0, n_train_seq) train, [n_train_seq, n_seq) evaluate. Index arrays are global token
    indices in file order."""

    n_seq: int
    n_train_seq: int
    train: np.ndarray  # int64
    eval: np.ndarray  # int64

    def describe(self) -> str:
        return (
            f"train seqs [0, {self.n_train_seq}) tokens {len(self.train)} / "
            f"eval seqs [{self.n_train_seq}, {self.n_seq}) tokens {len(self.eval)}"
        )


def split_by_sequences(trace: RoutingTrace, train_fraction: float = 0.7) -> TraceSplit:
    """First floor(train_fraction * n_seq) sequences train, the rest evaluate (the shared README's
    baselines use this split). Both sides get at least one sequence."""
    if not 0.0 < train_fraction < 1.0:
        raise _invalid(f"split fraction must be in (0, 1), got {train_fraction}")
    if trace.n_seq < 2:
        raise _invalid(
            f"trace {trace.path}: a split by sequences needs at least 2 sequences, it has {trace.n_seq}"
        )
    n_train = min(max(int(np.floor(train_fraction * trace.n_seq)), 1), trace.n_seq - 1)
    cut = int(trace.seq_start[n_train])
    return TraceSplit(
        trace.n_seq, n_train, np.arange(cut, dtype=np.int64), np.arange(cut, trace.n_tokens, dtype=np.int64)
    )


def sequences_slice(trace: RoutingTrace, first_seq: int, end_seq: int) -> np.ndarray:
    """Global token indices of sequences [first_seq, end_seq)."""
    ends = trace.seq_end()
    return np.arange(int(trace.seq_start[first_seq]), int(ends[end_seq - 1]), dtype=np.int64)
