"""sharpi.Session: the C++ engine plus tokenizer, sampling loop and streaming text."""

from __future__ import annotations

import os
import time
from collections import abc
from typing import Callable, Iterator, Mapping, Optional, Union

import numpy as np

from . import _core
from .generation import Generation
from .plugin import Predictor
from .speculative import SpecStats, Speculation


def _miss_bandwidths(given: Optional[dict]) -> dict:
    """Session's miss_bandwidths as the core's keywords (0 / -1: measure)."""
    out = {"miss_copy_bytes_per_s": 0.0, "miss_copy_latency_s": -1.0, "miss_cpu_bytes_per_s": 0.0}
    for key, value in (given or {}).items():
        if "miss_" + key not in out:
            raise _core.InvalidArgument(f"miss_bandwidths: unknown key {key!r} (known: copy_bytes_per_s, "
                                        "copy_latency_s, cpu_bytes_per_s)")
        out["miss_" + key] = float(value)
    return out


class Sequence:
    """A handle on one sequence of a Session (Session.add_sequence, Session.sequence): its own
    positions and KV cache, decoded with others in one step by Session.decode_batch. Ids are never
    reused, so a handle of a removed sequence raises InvalidArgument instead of reaching another."""

    def __init__(self, session: "Session", seq_id: int):
        self.session, self.id = session, seq_id

    def __repr__(self) -> str:
        return f"Sequence({self.id})"

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and other.session is self.session and other.id == self.id

    def __hash__(self) -> int:
        return hash((id(self.session), self.id))

    @property
    def n_past(self) -> int:
        return self.session._core.sequence_n_past(self.id)

    def fork(self, n_keep: Optional[int] = None) -> "Sequence":
        """A new sequence holding this one's first n_keep positions (None: all), its KV rows
        copied: requests sharing a prompt prefix decode it once. A model with recurrent state
        (qwen3next, qwen35moe) forks only whole (UnsupportedError otherwise)."""
        n = self.n_past if n_keep is None else int(n_keep)
        return Sequence(self.session, self.session._core.fork_sequence(self.id, n))

    def remove(self) -> None:
        """Free the sequence and its KV cache (InvalidArgument for sequence 0)."""
        self.session._core.remove_sequence(self.id)

    def reset(self) -> None:
        self.session._core.reset_sequence(self.id)

    def truncate(self, n_keep: int) -> None:
        """Keep the first n_keep positions (as Session.truncate)."""
        self.session._core.truncate_sequence(self.id, int(n_keep))

    def cancel(self) -> None:
        """This sequence's tokens in the running (or next) decode_batch are not appended; the other
        sequences of the step go on. Lock-free: any thread. A model with recurrent state then needs
        reset()."""
        self.session._core.cancel_sequence(self.id)


class Session:
    """A loaded GGUF model with its KV cache.

    decode() appends tokens and returns logits; generate() tokenizes a prompt, decodes it and samples
    up to max_tokens new tokens, yielding text as soon as it is complete UTF-8. Not thread-safe
    for concurrent generate() calls on one session (decode() itself is serialised in C++).

    Every method may be called from another thread while a decode() runs: cancel() at once (it
    takes no lock), the others wait for the decode to finish. cancel() makes that decode raise
    CancelledError within one layer with nothing appended; Ctrl-C during a decode() on the main
    thread cancels it the same way and then raises KeyboardInterrupt.
    """

    def __init__(
        self,
        path: Union[str, os.PathLike],
        threads: int = 0,
        n_ctx: int = 0,
        n_seq: int = 1,
        max_draft_tokens: int = 0,
        mtp: Union[bool, str, os.PathLike] = False,
        exact: bool = False,
        dump_activations: bool = False,
        ram_budget: Union[int, str, None] = None,
        slru_probation: float = 0.25,
        reader: str = "auto",
        route_trace: Union[str, os.PathLike, np.ndarray, None] = None,
        timeline: bool = False,
        predictor: Union[str, "Predictor", None] = "none",
        predictor_file: Union[str, os.PathLike, None] = None,
        lookahead: int = 1,
        skip_late_prefetch: bool = True,
        prefetch_sizing: str = "topk",
        trace: Union[str, os.PathLike, bool, None] = None,
        cache_policy: Optional[str] = None,
        cache_type_k: Optional[str] = None,
        cache_type_v: Optional[str] = None,
        allow_long_context: bool = False,
        device: str = "cpu",
        vram_budget: Union[int, str, None] = None,
        miss_route: str = "copy",
        miss_bandwidths: Optional[dict] = None,
    ):
        """exact: every matmul in f32 on dequantized weights (docs/design.md §8; also env SHARPI_EXACT=1).
        The default fast mode quantizes each activation row once per matmul (q8_K for K-quant
        weights, q8_0 / q8_1 for the 32-element types, as llama.cpp does) and dots in integers:
        ~1e-2 relative from exact mode on the logits, bit for bit the same between prefill and
        token-by-token decode and between streamed and resident runs.

        ram_budget: bytes (int) or a size with units ("6GiB"); None or 0 keeps every expert
        resident; "auto": the memory the machine or its cgroup has available minus a margin
        (resolved by the C++ planner; the choice is in self.auto_budget). With a budget, dense weights, KV cache and buffers are charged first and the rest
        becomes expert slots streamed from the file (reader: "auto", "io_uring" (or "uring"), "pread", or "cufile",
        an UnsupportedError saying why where it cannot run).

        predictor (streaming only, docs/predictors.md): "none", "prev_token", "echo", "next_gate", "pregate",
        "cooc", "depthtime", "learned", "trajectory" (these read predictor_file; "cooc:FILE" also works),
        or a sharpi.Predictor instance. lookahead: predict layers L+1..L+lookahead (1..3).
        skip_late_prefetch=False issues predictions even when the measured bandwidth says they
        cannot start before their layer's gate. prefetch_sizing: "topk" reads the best top_k
        predicted experts of each layer; "bytes" those whose probability (min(1, k * softmax of the
        hint scores)) times the stall they save beats the reader time a wasted read costs, best
        expected saving first, within the lookahead * top_k staging slots.

        cache_policy (streaming only, docs/cache_policies.md): the expert cache's replacement policy,
        one of sharpi.cache_policies() ("lru", "slru", "lfu", "arc", "s3fifo", "predictive", or
        "prior:FILE" with a prior fitted by `sharpi cache-prior`); None: the default
        (sharpi.default_cache_policy()).

        cache_type_k, cache_type_v: the KV cache's stored types, llama.cpp's names "f32", "f16",
        "q8_0", "q4_0"; None: f32 in exact mode, f16 otherwise. The budget charges their real size.
        deepseek2 (MLA) caches one latent row per position in cache_type_k that also serves as V
        (as in llama.cpp), so cache_type_v must resolve to the same type (InvalidArgument otherwise).
        allow_long_context: accept an n_ctx beyond the model's trained context (refused otherwise).
        n_seq: the most sequences the session holds at once (1..256; add_sequence, decode_batch), each
        with its own KV cache of n_ctx positions; a ram_budget charges all n_seq caches.
        max_draft_tokens: the longest speculative draft (0..64) a model with recurrent state
        (qwen3next, qwen35moe) can verify and cut back: it keeps that many extra copies of its
        DeltaNet state per sequence (charged to ram_budget). Attention-only models need none.
        mtp: run the file's multi-token-prediction block beside every step so draft_mtp() (and
        speculative "draft-mtp") can draft from it; its weights, KV cache and the trunk's hidden
        rows are charged to ram_budget. InvalidArgument for a file without the block. A path instead
        of True: the block from that file (llama.cpp's `convert_hf_to_gguf.py --mtp` export,
        "mtp-<name>.gguf", or a trained head), which must describe the same model.
        device: "cpu", or "cuda": the whole forward pass on CUDA device 0 (qwen3moe, qwen2moe,
        olmoe, Mixtral; every weight resident in VRAM, an f32 KV cache). A typed error names why it
        cannot run, before anything is allocated: a build without CUDA, another arch or a type
        without device kernels, a quantized KV cache or ram_budget (UnsupportedError), no device
        (DeviceError), not enough free VRAM (InvalidArgument, with the sizes).
        vram_budget (device "cuda"): bytes (int), a size with units ("12GiB") or "auto" (free VRAM
        minus a margin); None or 0: every weight resident. The tier planner (`sharpi inspect --plan`)
        charges dense weights, KV cache and buffers first; when the rest does not hold every expert,
        the experts stream into VRAM slots from pinned RAM (the same logits bit for bit; a predictor
        prefetches into staging slots), or with reader="cufile" by cuFile reads from the file
        ("auto" takes cuFile only where the nvidia-fs driver gives GPUDirect Storage). Below the minimum: InvalidArgument naming it; "auto" without a
        device: DeviceError; with device "cpu": InvalidArgument.
        miss_route (streamed experts): how a decode step serves an expert missing from VRAM: "copy" (default;
        logits equal the resident ones bit for bit), "cpu" (computed by the CPU kernels from RAM, one row
        down and up; env SHARPI_CPU_MOE=1), "auto" (the cheaper by the miss cost model). miss_bandwidths:
        the cost model's inputs {"copy_bytes_per_s", "copy_latency_s", "cpu_bytes_per_s"}; a missing one is
        measured when the session opens (expert_stats() reports the values used and cpu_experts).

        trace: a directory (True, or env SHARPI_TRACE_MOE=1: ./sharpi-moe-trace; SHARPI_TRACE_MOE=DIR)
        to record the MoE tracing report (docs/design.md §7): close() prints the table and writes
        moe_trace.json and moe_trace_timeline.json (Perfetto) there."""
        self.path = os.fspath(path)
        plugin = None
        if isinstance(predictor, Predictor):
            plugin, predictor = predictor, "custom"
        elif predictor is None:
            predictor = "none"
        elif not isinstance(predictor, str):
            raise _core.InvalidArgument(
                f"predictor must be a name or a sharpi.Predictor instance, got {type(predictor).__name__}")
        # "NAME:FILE" (predictor, cache_policy) is resolved and checked in C++ (resolve_session_options).
        env_trace = os.environ.get("SHARPI_TRACE_MOE", "")
        if trace is None and env_trace not in ("", "0"):
            trace = True if env_trace == "1" else env_trace
        if trace:
            timeline = True
        # Budgets ("auto" included) are parsed, checked and resolved in C++ (placement.h).
        self._core = _core.Session(
            self.path,
            vram_budget=vram_budget,
            miss_route=miss_route,
            **_miss_bandwidths(miss_bandwidths),
            threads=threads,
            n_ctx=n_ctx,
            n_seq=n_seq,
            max_draft_tokens=max_draft_tokens,
            mtp=bool(mtp),
            mtp_file="" if isinstance(mtp, bool) else os.fspath(mtp),
            exact=exact,
            dump_activations=dump_activations,
            ram_budget=ram_budget,
            slru_probation=slru_probation,
            reader=reader,
            timeline=timeline,
            predictor=predictor,
            predictor_file=os.fspath(predictor_file) if predictor_file is not None else "",
            lookahead=lookahead,
            skip_late_prefetch=skip_late_prefetch,
            prefetch_sizing=prefetch_sizing,
            cache_policy=cache_policy or "",
            cache_type_k=cache_type_k or "",
            cache_type_v=cache_type_v or "",
            allow_long_context=allow_long_context,
            device=device,
        )
        self.auto_budget = None  # ram_budget.AutoBudget when ram_budget="auto"
        if self._core.auto_ram_budget is not None:
            from .ram_budget import AutoBudget

            self.auto_budget = AutoBudget.from_dict(self._core.auto_ram_budget)
        if plugin is not None:
            self._core.set_predictor(plugin)
        self._tracer = None
        if trace:
            from .moe_trace import MoeTracer

            out_dir = "sharpi-moe-trace" if trace is True else os.fspath(trace)
            self._tracer = MoeTracer(out_dir, top_k=self.info["n_expert_used"])
        if route_trace is not None:
            self.set_route_trace(route_trace)
        self._metadata: Optional[dict] = None
        self._tokenizer = None
        self.last_stats: dict = {}

    # -- model -------------------------------------------------------------------------------
    @property
    def info(self) -> dict:
        return self._core.info

    @property
    def metadata(self) -> dict:
        if self._metadata is None:
            self._metadata = _core.GgufFile(self.path).metadata()
        return self._metadata

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from .tokenizer import Tokenizer

            fallback = os.environ.get("SHARPI_PRE_TOKENIZER_FALLBACK") or None
            self._tokenizer = Tokenizer.from_metadata(self.metadata, pre_fallback=fallback)
        return self._tokenizer

    # -- tokens ------------------------------------------------------------------------------
    def tokenize(self, text: str, add_bos: Optional[bool] = None, special: bool = False) -> list:
        return self.tokenizer.encode(text, add_bos=add_bos, special=special)

    def detokenize(self, tokens: abc.Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens))

    # -- compute -----------------------------------------------------------------------------
    @property
    def n_past(self) -> int:
        return self._core.n_past

    def decode(self, tokens: abc.Sequence[int], all_logits: bool = False, rewindable: bool = False) -> np.ndarray:
        """Append tokens at n_past; f32 logits [n_vocab] (last token) or [n_tokens, n_vocab].
        rewindable: truncate() may afterwards cut the sequence back to any position inside these
        tokens (a speculative verify step); a model with recurrent state (qwen3next, qwen35moe)
        then keeps its state after each token, for at most max_draft_tokens + 1 tokens."""
        return self._core.decode([int(t) for t in tokens], all_logits, rewindable)

    def draft_mtp(self, next_token: int, n: int, seq: Union[int, "Sequence"] = 0, with_logits: bool = False):
        """Up to n greedy draft tokens to follow next_token (the token `seq` decodes next) from the
        file's MTP block (Session(mtp=True)), chained on its own output: a list of ids, or (ids,
        logits [n, n_vocab]) with_logits. The sequence is unchanged."""
        seq_id = seq.id if isinstance(seq, Sequence) else int(seq)
        tokens, logits = self._core.draft_mtp(seq_id, int(next_token), int(n), bool(with_logits))
        return (tokens, logits) if with_logits else tokens

    def predict_step_reads(self, tokens: list, seq: Union[int, "Sequence"] = 0) -> dict:
        """What a step decoding `tokens` on `seq` next would read from the file, reading and
        changing nothing: {"bytes": [bytes of a step of the first j + 1 tokens, for each j],
        "bytes_per_ms": the reader's measured bandwidth (0 until measured)}. The experts each token
        chose at its latest earlier occurrence in the sequence (after the same previous token when
        there is one) count when the cache does not hold them; a token never seen counts top_k
        experts per MoE layer, each missing as often as that layer's experts are now. All 0 when
        every expert is resident; the history exists only with a predictor (else every token is
        unseen). The residency-aware draft length (speculative.DraftLength) prices drafts with it."""
        seq_id = seq.id if isinstance(seq, Sequence) else int(seq)
        return self._core.predict_step_reads(seq_id, [int(t) for t in tokens])

    # -- several sequences (continuous batching) ----------------------------------------------
    def sequence(self, seq_id: int = 0) -> "Sequence":
        """The handle of a sequence the session holds (0: the one decode() and generate() use)."""
        if isinstance(seq_id, bool) or not isinstance(seq_id, (int, np.integer)):
            raise _core.InvalidArgument(f"a sequence id is an int, got {type(seq_id).__name__}")
        self._core.sequence_n_past(int(seq_id))  # InvalidArgument for an id the session does not hold
        return Sequence(self, int(seq_id))

    def add_sequence(self) -> "Sequence":
        """A new empty sequence with its own KV cache (InvalidArgument when n_seq sequences exist)."""
        return Sequence(self, self._core.add_sequence())

    def sequences(self) -> list:
        """Handles of every sequence the session holds, sequence 0 first."""
        return [Sequence(self, i) for i in self._core.sequences()]

    def decode_batch(self, entries, all_logits: bool = False) -> list:
        """One forward step over several sequences: entries are (sequence or id, tokens) pairs, or
        (sequence or id, tokens, all_logits, rewindable) to set those per entry (see decode()), each
        sequence at most once. The dense matmuls and every selected expert run once for all the
        step's tokens; attention per sequence. Returns per entry f32 logits [n_vocab] (its last
        token) or [n_tokens, n_vocab] (all_logits), bit for bit what decoding that sequence alone
        with the same tokens gives; an entry whose sequence was cancel()ed during the step gets an
        empty [0, n_vocab] array and appends nothing. Errors come before anything is appended;
        Session.cancel() stops the whole step (CancelledError)."""
        step = []
        for entry in entries:
            if not isinstance(entry, (tuple, list)) or len(entry) not in (2, 4):
                raise _core.InvalidArgument("decode_batch: each entry is a (sequence, tokens) pair or a "
                                            "(sequence, tokens, all_logits, rewindable) tuple")
            seq, tokens = entry[0], entry[1]
            entry_all, rewindable = (all_logits, False) if len(entry) == 2 else (entry[2], entry[3])
            seq_id = seq.id if isinstance(seq, Sequence) else seq
            if isinstance(seq, Sequence) and seq.session is not self:
                raise _core.InvalidArgument("decode_batch: a sequence of another session")
            if isinstance(seq_id, bool) or not isinstance(seq_id, (int, np.integer)):
                raise _core.InvalidArgument(f"decode_batch: a sequence is a Sequence or an id, got "
                                            f"{type(seq_id).__name__}")
            step.append((int(seq_id), [int(t) for t in tokens], bool(entry_all), bool(rewindable)))
        return self._core.decode_batch(step)

    def reset(self) -> None:
        """Forget the KV cache (n_past = 0) and any cancel() no decode has seen yet."""
        self._core.reset()

    def truncate(self, n_keep: int) -> None:
        """Keep the first n_keep positions and forget the rest, so a prompt that shares them
        decodes only what follows (sharpi.server.prompt.reuse_prefix). InvalidArgument unless
        0 <= n_keep <= n_past; UnsupportedError for a hybrid arch (qwen3next, qwen35moe) when
        n_keep < n_past: its recurrent state cannot be rewound (reset() and decode again), except
        to a position inside the last decode when that was rewindable."""
        self._core.truncate(int(n_keep))

    def cancel(self) -> None:
        """Stop the running decode(), or the next one if none runs, within one layer: it raises
        CancelledError and appends nothing (n_past and the KV cache stay as before that call).
        Lock-free: call it from any thread (a UI, a server noticing its client left)."""
        self._core.cancel()

    def clear_cancel(self) -> None:
        """Drop a cancel() that no decode() has seen yet (before starting a new request)."""
        self._core.clear_cancel()

    def set_route_trace(self, trace: Union[str, os.PathLike, np.ndarray, None]) -> None:
        """Make the router follow recorded expert choices (trace replay for benchmarks).

        trace: an .npz in the format of shared/traces (its `experts` array, int16 [tokens, layers,
        top_k], -1 = missing), such an array, or None to turn replay off. The token at position p
        uses row p % tokens. A shape that does not match the model is an InvalidArgument."""
        if trace is None:
            self._core.set_route_trace(np.zeros((0, 0, 0), dtype=np.int32))
            return
        if not isinstance(trace, np.ndarray):
            with np.load(os.fspath(trace)) as z:
                if "experts" not in z:
                    raise _core.InvalidArgument(f"route trace {os.fspath(trace)}: no 'experts' array")
                trace = z["experts"]
        self._core.set_route_trace(np.ascontiguousarray(trace, dtype=np.int32))

    def last_routing(self) -> list:
        """Experts each layer chose for the tokens of the last decode(): [n_layer] of int32 [n_tokens, top_k]."""
        return self._core.last_routing()

    def timeline_events(self) -> list:
        """Spans {track, name, start_us, dur_us} recorded when the session was made with timeline=True:
        "compute" (attention and whole layer), "stall" (waits on expert reads), "reader" (reads); a device
        session adds "compute stream" (each layer on the device) and "copy stream" (each expert fill into
        VRAM), in device times placed on the host clock."""
        return self._core.timeline_events()

    def clear_timeline(self) -> None:
        self._core.clear_timeline()

    def expert_stats(self) -> dict:
        """Expert-cache counters per layer and per expert (empty "layers" when all resident)."""
        return self._core.expert_stats()

    def reset_stats(self) -> None:
        self._core.reset_stats()

    def predictor_errors(self) -> list:
        """Messages of the last predictor calls that raised (their hints were dropped)."""
        return self._core.predictor_errors()

    def close(self) -> Optional[dict]:
        """Ends MoE tracing (trace=...): prints the table, writes the JSON and the timeline, and
        returns the summary. A no-op without tracing. The session stays usable."""
        if self._tracer is None:
            return None
        tracer, self._tracer = self._tracer, None
        return tracer.finish(self.expert_stats(), self.timeline_events())

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def dump(self) -> dict:
        """Named activations of the last decode() ("attn_norm-0", ...) when dump_activations=True."""
        return self._core.dump()

    def generate(
        self,
        prompt: Union[str, abc.Sequence[int]],
        max_tokens: int = 64,
        temperature: float = 0.8,
        top_k: int = 40,
        top_p: float = 0.95,
        min_p: float = 0.05,
        repeat_penalty: float = 1.0,
        repeat_last_n: int = 64,
        seed: Optional[int] = None,
        stop_at_eos: bool = True,
        history: abc.Sequence[int] = (),
        on_token: Optional[Callable[[int, np.ndarray], None]] = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        logit_bias: Optional[Mapping[int, float]] = None,
        logits_processor: Optional[Callable[[list, np.ndarray], np.ndarray]] = None,
        speculative: Optional[Speculation] = None,
    ) -> Iterator[str]:
        """Decode `prompt` after what the session already holds and stream sampled text.

        Stops after max_tokens (-1: no limit), at an end-of-generation token (unless stop_at_eos is
        False), or when the context is full. Timing lands in self.last_stats when the iterator ends,
        exhausted or closed early (a stop string).
        history: the ids the session already holds before `prompt` (a reused prompt prefix), so
        the repetition penalty looks back into them as it would had the whole prompt been decoded.
        on_token(token, logits): called with each generated token and the logits it was sampled
        from (before its text is yielded, before any penalty or bias), e.g. for log-probabilities.

        presence_penalty, frequency_penalty (OpenAI's and llama.cpp's, each in [-2, 2]): a token that
        occurs c > 0 times among the last repeat_last_n ids (the window of repeat_penalty) loses
        presence_penalty + c * frequency_penalty from its logit. logit_bias: token id -> a value in
        [-100, 100] added to its logit; -100 (or -inf) bans the token (logit -inf), as OpenAI
        documents. The order is llama.cpp's: bias, then repeat_penalty, then presence and frequency,
        all in float32 on a copy of the logits; with all three off, sampling is the C++ sampler's alone.

        logits_processor(generated_ids, logits) -> logits: called before each sample with the ids
        generated so far (a list that grows by the sampled id between calls) and the step's logits,
        before the bias and penalties; it returns the logits to sample from and must not change
        its argument (on_token sees the model's own). A constrained-decoding mask
        (sharpi.constrained.GrammarMask) sets disallowed tokens to -inf here.

        speculative: a sharpi.speculative.Speculation (open_speculation: prompt lookup or a draft
        model). Each step then decodes the next token with the draft after it in one multi-token
        step and keeps what sampling accepts; the output is the same as without it (token for
        token, and with a seed under sampling too). last_stats gains the spec_* counts.
        """
        prompt_ids = list(prompt) if not isinstance(prompt, str) else self.tokenize(prompt)
        gen = Generation(self.tokenizer, self.info["n_vocab"], self.info["n_ctx"], prompt_ids,
                         max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                         repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n, seed=seed,
                         stop_at_eos=stop_at_eos, history=history, on_token=on_token,
                         presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                         logit_bias=logit_bias, logits_processor=logits_processor)
        logits = self.decode(prompt_ids)
        gen.prefilled()
        # The ids sampled so far, live while the iterator runs: a caller that closes it early (a
        # server's stop string, a cancel()) still knows how many tokens it produced.
        self.last_tokens = gen.generated
        if speculative is not None:
            gen.spec_stats = SpecStats()
        try:
            piece = gen.step(logits, self.n_past)
            if piece:
                yield piece
            while gen.finished is None:
                n_past = self.n_past
                draft = speculative.draft(gen.context, gen.room(n_past)) if speculative is not None else []
                t0 = time.perf_counter()
                if draft:
                    rows = self.decode([gen.next_token, *draft], all_logits=True, rewindable=True)
                    speculative.observe(len(draft), time.perf_counter() - t0)
                    piece, n_keep = gen.verify(rows.reshape(len(draft) + 1, -1), draft, self.n_past)
                    speculative.record(len(draft), n_keep - n_past - 1)
                    if n_keep < self.n_past:
                        self.truncate(n_keep)
                else:
                    logits = self.decode([gen.next_token])
                    if speculative is not None:
                        speculative.observe(0, time.perf_counter() - t0)
                    piece = gen.step(logits, n_past + 1)
                if piece:
                    yield piece
            tail = gen.flush()
            if tail:
                yield tail
        except GeneratorExit:  # closed early: the stats still describe what was generated
            self._record_stats(gen.stats())
            raise
        self._record_stats(gen.stats())

    def generate_batch(self, prompts: list, **generate_kwargs) -> list:
        """The answers to several prompts, decoded together: each prompt on its own sequence
        (sequence 0, reset first, and sequences added for the others, removed at the end), one
        decode_batch per step over every sequence still generating (all prompts in the first step,
        then one token each). generate_kwargs are generate()'s, each prompt sampled on its own
        (with the same seed when one is given); a callable among them (on_token,
        logits_processor) is shared by all prompts. Since decode_batch's logits do not depend on
        the rest of the step, each answer is the text generate() gives for its prompt alone from
        an empty cache. At most info["n_seq"] prompts (InvalidArgument)."""
        if "history" in generate_kwargs:
            raise _core.InvalidArgument("generate_batch: every prompt starts from an empty cache (no history)")
        prompt_ids = [list(p) if not isinstance(p, str) else self.tokenize(p) for p in prompts]
        if len(prompt_ids) > self.info.get("n_seq", 1):
            raise _core.InvalidArgument(f"generate_batch: {len(prompt_ids)} prompts, but the session holds at most "
                                        f"n_seq = {self.info.get('n_seq', 1)} sequences")
        if not prompt_ids:
            return []
        gens = [Generation(self.tokenizer, self.info["n_vocab"], self.info["n_ctx"], ids, **generate_kwargs)
                for ids in prompt_ids]
        sequences = [self.sequence(0)]
        try:
            sequences[0].reset()
            for _ in prompt_ids[1:]:
                sequences.append(self.add_sequence())
            texts = [""] * len(gens)
            entries = list(zip(sequences, prompt_ids))
            live = list(range(len(gens)))
            first = True
            while live:
                outputs = self.decode_batch([entries[i] for i in live])
                for i, logits in zip(list(live), outputs):
                    gen = gens[i]
                    if first:
                        gen.prefilled()
                    if gen.finished is None:
                        texts[i] += gen.step(logits, sequences[i].n_past)
                    if gen.finished is not None:
                        texts[i] += gen.flush()
                        live.remove(i)
                    else:
                        entries[i] = (sequences[i], [gen.next_token])
                first = False
            return texts
        finally:
            for seq in sequences[1:]:
                seq.remove()

    def _record_stats(self, stats: dict) -> None:
        """self.last_stats of a generate() call (Generation.stats) and the tracer's request record."""
        self.last_stats = stats
        if self._tracer is not None:
            self._tracer.add_request(self.last_stats)
