"""Speculative decoding: draft a few tokens cheaply, verify them in one multi-token step.

A verify step decodes [next token, d_1 .. d_k] as one step (each expert read once for all k + 1
rows, the same grouped MoE FFN as prefill) with the logits of every row, and Generation.verify
samples from those rows in order, as plain decoding would from one row at a time: it stops at the
first row whose sampled token is not the next draft token, and the sequence is truncated to the
tokens whose logits were used. So:

- greedy output is token for token plain decoding's, and since the engine's multi-token step gives
  each row the logits a one-token decode gives it (prefill == token by token, bit for bit), the
  logits of every accepted token are plain decoding's bit for bit;
- with sampling, every draft here is one token, not a distribution (a point mass q = 1 on d_i),
  and "sample t from the target's p, accept iff t == d_i" is then exactly the standard rejection
  rule (accept with min(1, p(d_i) / q(d_i)) = p(d_i); on rejection the residual
  max(0, p - q) normalised is p without d_i, which is what t is, given t != d_i). The sampler also
  draws its random numbers in the same order as plain decoding, so with a seed the text is the
  same as without speculation.

Draft sources (llama.cpp's --spec-type names):
- "ngram-simple": prompt lookup: the continuation of the latest earlier occurrence of the last
  `size_n` tokens in the context (prompt and answer), no extra weights;
- "draft-simple": a separate small model with the same vocabulary (`-md`), decoded greedily on its
  own session, kept in step with the accepted tokens;
- "draft-mtp": the file's own multi-token-prediction block (model/mtp.h in the core; the session
  opened with mtp=True), or one from a separate file (Session(mtp=PATH), `-md PATH` with
  --spec-type draft-mtp: llama.cpp's `--mtp` export), chained for more than one draft token.

A model with recurrent state (qwen3next, qwen35moe) verifies with a rewindable step: its DeltaNet
layers take the step's tokens one at a time (as one-token decodes do, bit for bit) and keep the
state after each, so truncate() can cut a rejected tail back. The session holds max_draft_tokens
such copies per sequence (Session(max_draft_tokens=...)), and the draft may not be longer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from . import _core

SPEC_TYPES = ("none", "ngram-simple", "draft-simple", "draft-mtp")
DEFAULT_DRAFT_N_MAX = 4
DEFAULT_NGRAM_SIZE_N = 3


class NgramDraft:
    """Prompt lookup (llama.cpp's "ngram-simple"): the last `size_n` tokens of the context are
    searched for, latest earlier occurrence first; the tokens that followed it are the draft
    (at most size_m). Nothing found: no draft (the step decodes one token)."""

    name = "ngram-simple"

    def __init__(self, size_n: int = DEFAULT_NGRAM_SIZE_N, size_m: int = 48):
        for key, value in (("size_n", size_n), ("size_m", size_m)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1024:
                raise _core.InvalidArgument(f"ngram-simple: {key} must be an integer in [1, 1024], got {value!r}")
        self.size_n, self.size_m = size_n, size_m

    def draft(self, context: list, n_max: int, key: int = 0) -> list:
        n = self.size_n
        if n_max <= 0 or len(context) <= n:
            return []
        pattern = context[-n:]
        first = pattern[0]
        # Latest start j < len - n whose n tokens equal the pattern (the pattern itself excluded).
        for j in range(len(context) - n - 1, -1, -1):
            if context[j] == first and context[j:j + n] == pattern:
                start = j + n
                return list(context[start:start + min(n_max, self.size_m)])
        return []

    def close(self) -> None:
        pass


class ModelDraft:
    """A separate draft model (`-md`, llama.cpp's "draft-simple") with the target's vocabulary,
    decoded greedily on its own Session. Its cache follows the target's context: before each draft
    it keeps the longest common prefix of what it holds and the context, and decodes the rest. One
    draft sequence per `key` (a server slot), up to n_seq of them."""

    name = "draft-simple"

    def __init__(self, path: str | os.PathLike, target, threads: int = 0, n_ctx: int = 0, n_seq: int = 1):
        if not os.path.exists(path):
            raise _core.IoError(f"draft model {os.fspath(path)!r}: no such file")
        # The target's own class (a sharpi.Session): this module is below session.py, which imports it.
        self.session = type(target)(path, threads=threads, n_ctx=n_ctx or target.info["n_ctx"], n_seq=n_seq)
        try:
            check_same_vocabulary(target, self.session, os.fspath(path))
            if self.session.info["recurrent"]:
                raise _core.UnsupportedError(
                    f"draft model {os.fspath(path)!r}: a {self.session.info['arch']} model keeps recurrent state "
                    "and cannot rewind a rejected draft; use an attention-only draft model")
        except Exception:
            self.session.close()
            raise
        # Per key: (its draft Sequence, the ids that sequence's cache holds, in order); draft
        # sequences of forgotten keys wait in `free` for the next new key.
        self.sequences: dict = {0: (self.session.sequence(0), [])}
        self.free: list = []

    def forget(self, key: int) -> None:
        """The target sequence `key` is gone (a server slot took a fork of another): its draft
        sequence serves the next new key."""
        entry = self.sequences.pop(key, None)
        if entry is not None:
            entry[0].truncate(0)
            self.free.append(entry[0])

    def draft(self, context: list, n_max: int, key: int = 0) -> list:
        if n_max <= 0:
            return []
        n_ctx = self.session.info["n_ctx"]
        if len(context) + n_max > n_ctx:  # the draft model's context is full: no draft
            return []
        if key not in self.sequences:
            self.sequences[key] = (self.free.pop() if self.free else self.session.add_sequence(), [])
        seq, held = self.sequences[key]
        keep = 0
        limit = min(len(held), len(context) - 1)  # the last context token is decoded below
        while keep < limit and held[keep] == context[keep]:
            keep += 1
        seq.truncate(keep)
        del held[keep:]
        logits = self.session.decode_batch([(seq, context[keep:])])[0]
        held.extend(context[keep:])
        out = []
        for i in range(n_max):
            token = int(logits.argmax())
            out.append(token)
            if i + 1 < n_max:
                logits = self.session.decode_batch([(seq, [token])])[0]
                held.append(token)
        return out

    def close(self) -> None:
        self.session.close()


class MtpDraft:
    """The file's own multi-token-prediction block (llama.cpp's "draft-mtp"): the target session,
    opened with mtp=True, drafts greedily from it, chained on the block's own output."""

    name = "draft-mtp"

    def __init__(self, target):
        self.target = target

    def draft(self, context: list, n_max: int, key: int = 0) -> list:
        if n_max <= 0:
            return []
        return self.target.draft_mtp(context[-1], n_max, seq=key)

    def close(self) -> None:
        pass


def check_same_vocabulary(target, draft, draft_name: str) -> None:
    """A draft model's token ids must mean the target's tokens: the same vocabulary size and the
    same token strings (InvalidArgument naming the first difference)."""
    t_vocab, d_vocab = target.info["n_vocab"], draft.info["n_vocab"]
    if t_vocab != d_vocab:
        raise _core.InvalidArgument(f"draft model {draft_name!r} has a vocabulary of {d_vocab} tokens, the target "
                                    f"{t_vocab}: a draft model must share the target's vocabulary")
    t_tokens = target.metadata.get("tokenizer.ggml.tokens")
    d_tokens = draft.metadata.get("tokenizer.ggml.tokens")
    if t_tokens is not None and d_tokens is not None:
        for i, (a, b) in enumerate(zip(t_tokens, d_tokens)):
            if a != b:
                raise _core.InvalidArgument(f"draft model {draft_name!r}: token {i} is {b!r}, the target's is {a!r}: "
                                            "a draft model must share the target's vocabulary")


@dataclass
class SpecStats:
    """What speculation did for one generation: verify steps, tokens drafted and accepted, and per
    draft position how often a draft reached it and was accepted there."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    drafted_at: list = field(default_factory=list)
    accepted_at: list = field(default_factory=list)

    def record(self, n_drafted: int, n_accepted: int) -> None:
        self.steps += 1
        self.drafted += n_drafted
        self.accepted += n_accepted
        while len(self.drafted_at) < n_drafted:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for i in range(n_drafted):
            self.drafted_at[i] += 1
            if i < n_accepted:
                self.accepted_at[i] += 1

    def as_dict(self) -> dict:
        return {
            "spec_steps": self.steps,
            "spec_drafted": self.drafted,
            "spec_accepted": self.accepted,
            "spec_acceptance": self.accepted / self.drafted if self.drafted else 0.0,
            "spec_acceptance_at": [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)],
            "spec_drafted_at": list(self.drafted_at),  # verify steps whose draft reached position i
            "spec_accepted_at": list(self.accepted_at),  # ... and kept the token there
        }


class DraftLength:
    """The draft length chosen per step (--spec-draft-auto): the k in [0, n_max] with the most
    expected tokens per second of verify step.

    Model. With a_i the acceptance rate at draft position i (given every earlier one was kept:
    Generation.verify stops at the first miss), a verify step of k drafts yields
    E(k) = 1 + sum_{j=1..k} a_1 ... a_j tokens and costs c(k) = compute(k) + read(k) seconds;
    k = argmax E(k) / c(k), and k = 0 is plain decoding (E = 1, c(0)). a_i: kept / drafted at
    position i, counts decayed by `decay` per step, with one prior draft at 0.5.

    read(k): the expert bytes the step would read from the file at the reader's measured bandwidth,
    predicted before the step from the draft tokens themselves (Session.predict_step_reads: the
    experts each token chose at its latest earlier occurrence that the cache does not hold now).
    compute(k): what the steps of k drafts took (observe()) less their predicted reads, as a
    running mean; a k not measured yet is interpolated between measured ones, or, above the
    largest, extrapolated with the measured slope (at least the prior `slope` x c(0) per draft).
    Resident, read(k) = 0 and c(k) is the measured step time.

    Two decisions per step: choose() bounds the draft before it exists (the mean predicted read of
    a row so far stands in for read(k)); trim() then cuts the drafted tokens to the best prefix
    under their own predicted reads, so a draft whose tokens' experts are not resident shrinks and
    one whose experts are held (a repeated span) keeps its length. Every `explore`-th step tries a k
    around the choice, so costs stay measured.
    """

    def __init__(self, n_max: int, decay: float = 0.99, slope: float = 0.25, explore: int = 16):
        self.n_max, self.decay, self.slope, self.explore = n_max, decay, slope, explore
        self.drafted = [1.0] * n_max  # the prior: one draft at each position, half of it kept
        self.kept = [0.5] * n_max
        self.cost_sum = [0.0] * (n_max + 1)  # compute seconds (measured less predicted reads)
        self.cost_n = [0] * (n_max + 1)
        self.read_row_sum, self.read_n = 0.0, 0  # predicted read seconds per row of the steps seen
        self.steps = 0

    def record(self, n_drafted: int, n_accepted: int) -> None:
        self.drafted = [d * self.decay for d in self.drafted]
        self.kept = [k * self.decay for k in self.kept]
        # Positions after the first miss were never examined: they say nothing about a_i.
        for i in range(min(n_accepted + 1, n_drafted)):
            self.drafted[i] += 1.0
            self.kept[i] += 1.0 if i < n_accepted else 0.0

    def observe(self, n_drafted: int, seconds: float, read_seconds: float = 0.0) -> None:
        """A step of n_drafted drafts took `seconds`, of which `read_seconds` were its predicted reads."""
        self.cost_sum[n_drafted] += seconds - read_seconds
        self.cost_n[n_drafted] += 1
        self.read_row_sum += read_seconds / (n_drafted + 1)
        self.read_n += 1

    def compute(self, k: int) -> float | None:
        measured = [(j, self.cost_sum[j] / self.cost_n[j]) for j in range(self.n_max + 1) if self.cost_n[j]]
        if not measured:
            return None
        for j, c in measured:
            if j == k:
                return c
        below = [(j, c) for j, c in measured if j < k]
        above = [(j, c) for j, c in measured if j > k]
        if below and above:
            (j0, c0), (j1, c1) = below[-1], above[0]
            return c0 + (c1 - c0) * (k - j0) / (j1 - j0)
        base = measured[0][1] if measured[0][0] == 0 else None
        if len(measured) >= 2:
            (j0, c0), (j1, c1) = measured[-2], measured[-1]
            per_draft = (c1 - c0) / (j1 - j0)
        else:
            per_draft = 0.0
        j_last, c_last = (below or above)[-1 if below else 0]
        per_draft = max(per_draft, self.slope * (base if base is not None else c_last / (1 + self.slope * j_last)))
        return c_last + per_draft * (k - j_last)

    def cost(self, k: int, read_seconds: float | None = None) -> float | None:
        """c(k): compute(k) plus `read_seconds`, or the mean predicted read of k + 1 rows."""
        compute = self.compute(k)
        if compute is None:
            return None
        if read_seconds is None:
            read_seconds = (k + 1) * self.read_row_sum / self.read_n if self.read_n else 0.0
        return compute + read_seconds

    def expected_tokens(self, k: int) -> float:
        total, run = 1.0, 1.0
        for i in range(k):
            run *= self.kept[i] / self.drafted[i]
            total += run
        return total

    def choose(self, room: int) -> int:
        """The draft length of the next step, at most `room`."""
        self.steps += 1
        limit = min(self.n_max, room)
        if limit <= 0:
            return 0
        costs = [self.cost(k) for k in range(limit + 1)]
        if costs[0] is None:  # nothing measured yet: start at the longest draft
            return limit
        best = max(range(limit + 1), key=lambda k: self.expected_tokens(k) / costs[k])
        if self.explore and self.steps % self.explore == 0:
            best = min(limit, best + 1) if self.steps % (2 * self.explore) else max(0, best - 1)
        return best

    def trim(self, read_seconds: list) -> int:
        """The best number of drafts for a step whose prefix of j drafts would read
        read_seconds[j] (j = 0 .. len - 1, the drafted ones): at most len(read_seconds) - 1.
        An exploring step (choose()'s every `explore`-th) keeps its length."""
        n = len(read_seconds) - 1
        if n <= 0 or self.compute(0) is None or (self.explore and self.steps % self.explore == 0):
            return max(n, 0)
        return max(range(n + 1), key=lambda k: self.expected_tokens(k) / self.cost(k, read_seconds[k]))


class Speculation:
    """A draft source and the draft length for Session.generate(speculative=...), the CLI and the
    server: draft(context, room) returns at most n_max tokens (fewer when `room`, the tokens the
    answer and the context can still take after the next one, is smaller), or none when the
    source has nothing (plain one-token decoding then). n_min: a shorter draft is dropped.
    auto: each step's length is DraftLength's choice (the driver reports what steps cost through
    observe() and what they kept through record())."""

    def __init__(self, source, n_max: int = DEFAULT_DRAFT_N_MAX, n_min: int = 0, auto: bool = False,
                 target=None):
        if isinstance(n_max, bool) or not isinstance(n_max, int) or n_max < 1:
            raise _core.InvalidArgument(f"speculative draft length n_max must be an integer >= 1, got {n_max!r}")
        if isinstance(n_min, bool) or not isinstance(n_min, int) or not 0 <= n_min <= n_max:
            raise _core.InvalidArgument(f"speculative n_min must be an integer in [0, n_max = {n_max}], got {n_min!r}")
        self.source, self.n_max, self.n_min = source, n_max, n_min
        self.length = DraftLength(n_max) if auto else None
        # auto with a target session: each step's reads are predicted from its tokens
        # (Session.predict_step_reads); the prediction for the step about to run, per key.
        self.target = target if auto else None
        self.pending_read_s: dict = {}

    def observe(self, n_drafted: int, seconds: float, key: int = 0) -> None:
        """A decode step of sequence `key` with n_drafted draft tokens (0: a plain one) took `seconds`."""
        if self.length is not None:
            self.length.observe(n_drafted, seconds, self.pending_read_s.pop(key, 0.0))
        self.pending_read_s.clear()  # older steps' predictions (slots that ran together, not timed)

    def record(self, n_drafted: int, n_accepted: int) -> None:
        """A verify step kept n_accepted of its n_drafted draft tokens."""
        if self.length is not None:
            self.length.record(n_drafted, n_accepted)

    @property
    def name(self) -> str:
        return self.source.name

    def __repr__(self) -> str:
        return f"{self.name}(n_max={self.n_max}, n_min={self.n_min}{', auto' if self.length else ''})"

    def forget(self, key: int) -> None:
        """The target sequence `key` was removed: a source that keeps state per key drops it."""
        self.pending_read_s.pop(key, None)
        if hasattr(self.source, "forget"):
            self.source.forget(key)

    def draft(self, context: list, room: int, key: int = 0) -> list:
        """At most min(n_max, room) draft tokens after `context` (whose last id is the next token,
        not decoded yet); `key` is the id of the target sequence it drafts for (a server slot's)."""
        n = min(self.n_max, room) if self.length is None else self.length.choose(room)
        out = self.source.draft(context, n, key)[:n] if n >= max(self.n_min, 1) else []
        if len(out) < max(self.n_min, 1):
            out = []
        if self.target is not None and context:
            reads = self.read_seconds(context[-1], out, key)
            if reads is not None:
                j = self.length.trim(reads)
                out = out[:j] if j >= max(self.n_min, 1) else []
                self.pending_read_s[key] = reads[len(out)]
        return out

    def read_seconds(self, next_token: int, draft: list, key: int) -> list | None:
        """[predicted read seconds of a step of next_token and the first j drafts, j = 0 ..
        len(draft)], or None while the reader has no measured bandwidth (resident: all 0)."""
        estimate = self.target.predict_step_reads([next_token, *draft], seq=key)
        if estimate["bytes_per_ms"] <= 0.0:
            return None
        return [b / (estimate["bytes_per_ms"] * 1e3) for b in estimate["bytes"]]

    def close(self) -> None:
        self.source.close()


def open_speculation(target, spec_type: str | None, n_max: int = DEFAULT_DRAFT_N_MAX, n_min: int = 0,
                     draft_model: str | os.PathLike | None = None, ngram_size_n: int = DEFAULT_NGRAM_SIZE_N,
                     ngram_size_m: int = 48, threads: int = 0, n_seq: int = 1,
                     auto: bool = False) -> Speculation | None:
    """The Speculation that --spec-type / -md / --spec-draft-n-max ask for on `target` (a Session),
    or None for "none" (and for no type and no draft model). A draft model alone means
    draft-simple, as in llama.cpp. Bad combinations raise InvalidArgument / UnsupportedError."""
    if spec_type is None:
        spec_type = "draft-simple" if draft_model else "none"
    if spec_type not in SPEC_TYPES:
        raise _core.InvalidArgument(f"unknown speculative type {spec_type!r} (known: {', '.join(SPEC_TYPES)})")
    if spec_type == "none":
        if draft_model:
            raise _core.InvalidArgument("a draft model (-md) was given with --spec-type none")
        return None
    n_ctx = target.info["n_ctx"]
    if isinstance(n_max, int) and not isinstance(n_max, bool) and n_max >= n_ctx:
        raise _core.InvalidArgument(f"speculative draft length {n_max} does not fit the context ({n_ctx} positions)")
    if spec_type == "draft-mtp" and not target.info.get("mtp"):
        # The session runs the block (its file's own, or -md's: Session(mtp=PATH)) or cannot draft.
        if not target.info.get("n_layer_nextn"):
            raise _core.InvalidArgument(f"--spec-type draft-mtp: this {target.info['arch']} file has no MTP layers "
                                        "(nextn_predict_layers = 0); give a file holding its MTP block with -md "
                                        "(llama.cpp's --mtp export), or use ngram-simple or a draft model")
        raise _core.InvalidArgument("--spec-type draft-mtp: open the session with mtp=True (its MTP block "
                                    "runs beside every step)")
    if target.info.get("recurrent") and n_max > target.info.get("max_draft_tokens", 0):
        raise _core.InvalidArgument(
            f"speculative draft length {n_max}: {target.info['arch']} keeps recurrent (DeltaNet) state, and the "
            f"session holds {target.info.get('max_draft_tokens', 0)} copies of it to cut a rejected draft back; "
            f"open it with max_draft_tokens >= {n_max}")
    if spec_type == "draft-mtp":
        source = MtpDraft(target)
    elif spec_type == "ngram-simple":
        if draft_model:
            raise _core.InvalidArgument("a draft model (-md) was given with --spec-type ngram-simple")
        source = NgramDraft(ngram_size_n, ngram_size_m)
    else:
        if not draft_model:
            raise _core.InvalidArgument("--spec-type draft-simple needs a draft model (-md FILE)")
        source = ModelDraft(draft_model, target, threads=threads, n_seq=n_seq)
    try:
        return Speculation(source, n_max, n_min, auto=auto, target=target)
    except Exception:
        source.close()
        raise
