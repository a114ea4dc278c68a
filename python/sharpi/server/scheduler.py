"""The Engine: the one Session, its slots (one sequence each) and the one worker thread that runs
them in steps, and the Job each request queues on it.

Who owns what: the Engine owns the Session and one worker thread; the Session holds `n_slots`
sequences (Session(n_seq=...): `sharpi serve --parallel N`), each bound to one Slot. A request is a
Job: submit() puts it on a bounded FIFO queue (QueueFull beyond `queue_size` waiting Jobs, on top
of the free slots); the worker loops steps (continuous batching):

1. admission, at the step boundary: each waiting Job goes to a free slot, the one whose sequence
   holds the longest prefix of the Job's prompt (least recently used on a tie), which is cut back to
   that prefix (prompt.reuse_prefix), so the next turn of a chat decodes only its new tokens;
2. one Session.decode_batch over every busy slot: one token from each slot that is decoding, and
   prompt chunks of the slots that are prefilling, at most `batch_size` tokens in all (decoding
   slots first; a long prompt is prefilled over several steps while the others keep decoding);
3. each slot's Generation samples from its logits; its text goes to the Job; a finished Job's slot
   is free for the next step.

Requests with the same prompt (a request's n choices, clients sending one prompt at once) prefill it
once: a Job whose prompt equals the one another slot is still prefilling follows that slot (it takes
no part in the steps meanwhile); when the leader's prefill ends, the follower's slot takes a fork of
the leader's sequence (its KV rows copied, Sequence.fork) and samples its first token from the
leader's last prompt logits, which are what its own prefill would have given (bit for bit: the
logits of a sequence do not depend on the step). A leader that ends or fails first releases its
followers, which then prefill on their own.

The event loop never calls the Session except Sequence.cancel() (lock-free). Text flows one way:
worker thread -> Job.queue (asyncio, via call_soon_threadsafe) -> response; the end of a Job is END
on its queue, after the worker has written the Job's counts. A client that goes away, or a stop
string that matched, cancels its Job: a queued Job leaves the queue at once (counted as cancelled),
a running one is dropped at the next step boundary, and when its slot is in the step running now
its Sequence.cancel() keeps that step from appending its tokens (the others' are appended).
Engine._state guards the queue, the slots' Jobs and the step in flight, so a cancel never reaches
another Job's sequence. Sampling is each Job's own (generation.Generation), and a greedy Job's
answer is what Session.generate gives alone: decode_batch's logits do not depend on what else is in
the step. Nothing here knows about HTTP.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque

import numpy as np

from ..generation import CONTEXT, LENGTH, Generation
from .live import LiveStats
from .logprobs import token_logprobs
from .prompt import fim_token_ids, reuse_prefix

# The last item on a Job's queue.
END = object()

# Tokens one step decodes over all slots by default (-b/--batch-size; cli.py repeats it for --help).
DEFAULT_BATCH_SIZE = 512



def default_queue_size(n_slots: int) -> int:
    """Jobs that may wait for a slot: 4 per slot, and at least 16 (a request's n choices, up to
    openai_api.MAX_N, queue together)."""
    return max(4 * n_slots, 16)


# Upper bounds of /metrics' histograms of the tokens and the sequences one step decodes.
STEP_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
STEP_SEQUENCE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class StepHistogram:
    """Counts of observed values by upper bound (Prometheus' cumulative buckets) and their sum."""

    def __init__(self, bounds: tuple):
        self.bounds, self.counts, self.sum = bounds, [0] * (len(bounds) + 1), 0

    def observe(self, value: int) -> None:
        self.counts[next((i for i, b in enumerate(self.bounds) if value <= b), len(self.bounds))] += 1
        self.sum += value

    def values(self) -> tuple:
        """([(str upper bound, cumulative count)] ending with "+Inf", sum)."""
        out, total = [], 0
        for bound, count in zip([*(str(float(b)) for b in self.bounds), "+Inf"], self.counts):
            total += count
            out.append((bound, total))
        return out, self.sum


class QueueFull(Exception):
    """submit() found the queue full: the server answers 503."""


class Job:
    """One request's generation: its pieces arrive on `queue` (the event loop's side) as (text,
    [(text offset, logprob entry)], tokens so far) triples: the entries of the tokens whose text
    begins the piece (none unless n_top is set), and how many tokens had been sampled when the piece
    was put (so a stop string found in it knows how many tokens the answer used: Engine.trim). Its
    counts are written by the worker before END is queued."""

    def __init__(self, loop: asyncio.AbstractEventLoop, prompt_ids: list, options: dict,
                 n_top: int | None = None, keep_special: bool = False, prompt_logprobs: bool = False):
        self.loop, self.prompt_ids, self.options = loop, prompt_ids, options
        self.n_top = n_top  # alternatives per logprob entry; None: no entries
        # Pieces keep control tokens' text (a reply parsed for tool calls: DeepSeek's, Mistral's and
        # gpt-oss's markers are control tokens), else they are the text a plain decode gives.
        self.keep_special = keep_special
        # The prompt's own tokens' entries too (completions' echo with logprobs): the whole prompt is
        # decoded again for their logits (no cache reuse), and prompt_entries holds one entry per
        # prompt token, the first with logprob and top_logprobs None (nothing predicts it), by the
        # time the first piece is queued.
        self.prompt_logprobs = prompt_logprobs
        self.prompt_entries: list = []
        self.queue: asyncio.Queue = asyncio.Queue()
        self.stopped = threading.Event()
        self.n_generated = 0
        self.tokens: list = []  # the generated ids, set when the job ends
        self.n_reused = 0  # prompt tokens the KV cache already held (not decoded again)
        self.finish_reason = "stop"
        self.stop_sequence: str | None = None  # the stop string that ended it (stops.stream_until_stop)
        self.error: BaseException | None = None
        # Worker-side clock (time.perf_counter): start of the request's turn, first text, end.
        self.t_start = self.t_first = self.t_end = 0.0
        # The Slot running it (under Engine._state; None while queued or after it ended), and
        # whether that slot's tokens are in the decode_batch running now.
        self.slot: Slot | None = None
        self.in_step = False

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class Slot:
    """One sequence of the Session and the Job it runs (worker thread; `job` under Engine._state).

    `held` is what the sequence's KV cache holds, in order, as of the last Job's end (its prompt
    and answer up to the sequence's n_past); [] after an error or a cancel (the next Job starts from
    reset()). While a Job runs: `gen` samples it, `todo` is the part of its prompt not decoded
    yet (prefill), and the rest is how its text goes out (Engine._emit)."""

    def __init__(self, index: int, sequence):
        self.index, self.sequence = index, sequence
        self.held: list = []
        self.last_used = 0  # the step its last Job ended in: least recently used first on a tie
        self.job: Job | None = None
        self.gen: Generation | None = None
        self.todo: list = []
        self.n_prompt_done = 0  # prompt positions decoded for this Job (from n_reused)
        self.pending: list = []  # logprob entries of tokens whose text has not been put yet
        self.produced = 0  # characters put so far: the next piece's offset
        self.raw = None  # keep_special: a stream decoder that keeps control tokens' text
        self.n_raw = 0  # generated ids pushed to `raw`
        self.cancel_sent = False  # Sequence.cancel() was called for the step in flight
        self.draft: list = []  # speculative draft tokens after next_token in the step in flight
        self.leader: Slot | None = None  # the lower slot prefilling this Job's prompt (a follower)


def _shared_prefix(held: list, ids: list) -> int:
    """How many leading ids of `held` the prompt `ids` shares, its last id left out (reuse_prefix)."""
    n = 0
    for a, b in zip(held, ids[:-1]):
        if a != b:
            break
        n += 1
    return n


class Engine:
    """The one Session, its slots and the worker thread that steps them (see the module docstring)."""

    def __init__(self, session, batch_size: int = DEFAULT_BATCH_SIZE, queue_size: int | None = None,
                 speculation=None):
        self.session = session
        # sharpi.speculative.Speculation or None: a decoding slot's draft tokens join the step after
        # its next token (a rewindable verify entry); its Generation keeps what sampling accepts.
        self.speculation = speculation
        # Read once here, so the event loop never calls the Session for them: the model's facts
        # and its Tokenizer (immutable; built on first use, so built now, before any thread runs).
        self.info = dict(session.info)
        self.n_ctx = self.info["n_ctx"]  # per slot: each sequence has its own n_ctx positions
        self.n_slots = int(self.info.get("n_seq", 1))
        # A step takes at most info["max_step_tokens"] tokens (max(n_ctx, 256): what the engine's
        # buffers are planned for), so -b is capped there.
        self.batch_size = min(int(batch_size), int(self.info.get("max_step_tokens") or batch_size))
        self.queue_size = default_queue_size(self.n_slots) if queue_size is None else int(queue_size)
        self.tokenizer = session.tokenizer
        # (prefix, suffix, middle) fill-in-the-middle token ids, None when the vocabulary has none.
        self.fim_ids = fim_token_ids(self.tokenizer, session.metadata)
        self.slots = [Slot(0, session.sequence(0) if self.n_slots > 1 else None)]
        for i in range(1, self.n_slots):
            self.slots.append(Slot(i, session.add_sequence()))
        self._state = threading.Lock()
        self._wake = threading.Condition(self._state)  # new work or shutdown (worker waits on it)
        self._waiting: deque = deque()  # Jobs submitted and not on a slot yet (under _state)
        self._closing = False
        # Finished requests, those of them stopped early (a client that left, a stop string; queued
        # ones that never started among them), their tokens, the worker's seconds to the first text
        # of each (prefill) and after it (decode), the steps and what they decoded, and the expert
        # cache's totals (sampled by the worker): GET /v1/sharpi/stats and /metrics. Under _state.
        self.counts = {"requests": 0, "cancelled": 0, "cancelled_queued": 0, "rejected": 0, "completion_tokens": 0,
                       "prompt_tokens_reused": 0, "prompt_tokens_prefilled": 0, "prompt_seconds": 0.0,
                       "decode_seconds": 0.0, "steps": 0, "step_tokens": 0, "step_sequences": 0,
                       "expert_accesses": 0, "expert_hits": 0, "expert_bytes_read": 0,
                       "draft_tokens": 0, "draft_tokens_accepted": 0}
        # Steps by tokens and by sequences decoded, cumulative Prometheus buckets (/metrics; under _state).
        self.step_histograms = {"tokens": StepHistogram(STEP_TOKEN_BUCKETS),
                                "sequences": StepHistogram(STEP_SEQUENCE_BUCKETS)}
        self._step = 0  # steps run (worker thread)
        # The expert-cache view the page at / plots: sampled by the worker between steps.
        self.live = LiveStats(session.info["n_expert_used"])
        self._expert_base = self._expert_totals(session.expert_stats())
        self._worker = threading.Thread(target=self._loop, name="sharpi-serve", daemon=True)
        self._worker.start()

    # ---------------------------------------------------------------- event loop side

    def snapshot(self) -> dict:
        """The counts, "busy" (whether a Job runs now), "waiting" (Jobs queued for a slot), the
        slots, which of them run a Job ("active") and the queue's bound, read together."""
        with self._state:
            active = sum(slot.job is not None for slot in self.slots)
            return {**self.counts, "busy": active > 0, "waiting": len(self._waiting), "slots": self.n_slots,
                    "active": active, "queue_size": self.queue_size, "batch_size": self.batch_size,
                    "slot_jobs": [self._slot_view(s) for s in self.slots]}

    @staticmethod
    def _slot_view(slot: Slot) -> dict | None:
        """A slot's Job for snapshot() (under _state, which guards `job`; the worker swaps `gen` and
        `todo` outside it, so each is read once)."""
        job, gen, todo = slot.job, slot.gen, slot.todo
        if job is None:
            return None
        return {"prompt_tokens": len(job.prompt_ids), "prefilling": gen is None or bool(todo),
                "generated": len(gen.generated) if gen is not None else 0}

    def step_histogram_values(self) -> dict:
        """{"tokens"|"sequences": ([(upper bound, cumulative count)], sum)}, read together."""
        with self._state:
            return {k: h.values() for k, h in self.step_histograms.items()}

    def submit(self, prompt_ids: list, options: dict, n_top: int | None = None, keep_special: bool = False,
               prompt_logprobs: bool = False) -> Job:
        """Queues a Job for the next free slot; QueueFull when queue_size Jobs wait already on top
        of the slots that are free."""
        job = Job(asyncio.get_running_loop(), prompt_ids, options, n_top, keep_special, prompt_logprobs)
        with self._state:
            free = sum(slot.job is None for slot in self.slots)
            if len(self._waiting) >= self.queue_size + free:
                self.counts["rejected"] += 1
                raise QueueFull(f"the server is busy: {self.n_slots} slots run and {len(self._waiting)} requests "
                                f"wait (--queue-size {self.queue_size}); retry later")
            self._waiting.append(job)
            self._wake.notify()
        return job

    def trim(self, job: Job, n_tokens: int) -> None:
        """A stop string ended the answer at its first n_tokens tokens (event loop, after END): the
        tokens the worker sampled past it, before the cancel reached it, are not the answer's, so
        they leave its counts (usage, timings, /metrics) too."""
        with self._state:
            excess = job.n_generated - n_tokens
            if excess <= 0:
                return
            job.n_generated = n_tokens
            job.tokens = job.tokens[:n_tokens]
            self.counts["completion_tokens"] -= excess

    def cancel(self, job: Job) -> None:
        """Stops `job`: a queued one ends now (END, counted), a running one at the next step
        boundary, and the step in flight does not append its tokens."""
        with self._state:
            if job.stopped.is_set():
                return
            job.stopped.set()
            if job in self._waiting:
                self._waiting.remove(job)
                self.counts["requests"] += 1
                self.counts["cancelled"] += 1
                self.counts["cancelled_queued"] += 1
                job.put(END)
            elif job.in_step and job.slot is not None and job.slot.sequence is not None:
                job.slot.sequence.cancel()
                job.slot.cancel_sent = True
            elif job.in_step:
                self.session.cancel()  # one slot: the Session's own sequence, nothing else in the step

    def close(self) -> None:
        """Stops the worker (the server is shutting down): the step in flight is cancelled and no
        other runs; the Session stays open."""
        with self._state:
            self._closing = True
            if any(slot.job is not None and slot.job.in_step for slot in self.slots):
                self.session.cancel()  # the whole step: CancelledError, nothing appended
            self._wake.notify()
        self._worker.join(timeout=60)

    # ---------------------------------------------------------------- worker thread

    # Prompt positions whose logits a step keeps (prompt_logprobs): [chunk, n_vocab] float32 at a time.
    PROMPT_LOGITS_CHUNK = 256

    def _loop(self) -> None:
        while True:
            with self._state:
                while not self._closing and not self._waiting and all(s.job is None for s in self.slots):
                    self._wake.wait()
                if self._closing:
                    return
                admitted = self._admit()
            try:
                for slot in admitted:
                    self._start(slot)
                for slot in self.slots:
                    if slot.job is not None and slot.job.stopped.is_set():
                        self._finish(slot)
                self._run_step()
            except Exception as e:  # noqa: BLE001 - a fault of the scheduler itself
                # A request must never wait on a worker that died: every running Job is answered
                # with the error and its slot starts over; the worker goes on with the queue.
                self._fail_running(e)

    def _fail_running(self, error: Exception) -> None:
        for slot in self.slots:
            if slot.job is None:
                continue
            slot.job.error = error
            try:
                self._sequence(slot).reset()
            except Exception:  # noqa: BLE001, S110 - the slot is emptied below all the same
                pass
            slot.leader = None
            self._finish(slot, keep_cache=False)

    def _admit(self) -> list:
        """Binds waiting Jobs to free slots, first come first served (under _state), each to
        _choose_slot's slot."""
        admitted = []
        while self._waiting:
            free = [s for s in self.slots if s.job is None]
            if not free:
                break
            job = self._waiting.popleft()
            slot = self._choose_slot(free, job)
            slot.job, job.slot = job, slot
            admitted.append(slot)
        return admitted

    @staticmethod
    def _choose_slot(free: list, job: Job) -> Slot:
        """The free slot whose cache holds the longest prefix of the prompt, when that keeps at
        least half of what the slot holds (the next turn of its conversation, an edit of its
        prompt); else the least recently used one, so a new conversation does not take the cache of
        another that shares only a template's first tokens (llama-server's --slot-prompt-similarity
        0.5 in spirit). A Job that wants its prompt's logprobs decodes all of it: any slot."""
        if not job.prompt_logprobs:
            shared = [(_shared_prefix(s.held, job.prompt_ids), s) for s in free]
            n, slot = max(shared, key=lambda p: (p[0], -p[1].last_used))
            if n and 2 * n >= len(slot.held):
                return slot
        return min(free, key=lambda s: s.last_used)

    def _sequence(self, slot: Slot):
        """What prompt.reuse_prefix readies: the slot's Sequence, or the Session (one slot)."""
        return self.session if slot.sequence is None else slot.sequence

    def _n_past(self, slot: Slot) -> int:
        return self._sequence(slot).n_past

    def _start(self, slot: Slot) -> None:
        """Readies a slot for its new Job: the cache cut back to the prompt's longest held prefix,
        the Generation built from the Job's options (a bad option ends the Job with its error)."""
        job = slot.job
        job.t_start = time.perf_counter()
        ids = job.prompt_ids
        slot.gen, slot.pending, slot.produced, slot.n_raw, slot.cancel_sent = None, [], 0, 0, False
        slot.raw = self.tokenizer.stream(skip_special=False) if job.keep_special else None
        try:
            if self.n_slots == 1:
                self.session.clear_cancel()
            job.n_reused = reuse_prefix(self._sequence(slot), [] if job.prompt_logprobs else slot.held, ids)
            slot.held = slot.held[: job.n_reused]
            on_token = None
            if job.n_top is not None:
                def on_token(token, logits, slot=slot):
                    slot.pending.append(token_logprobs(self.tokenizer, token, logits, slot.job.n_top))
            slot.gen = Generation(self.tokenizer, self.info["n_vocab"], self.n_ctx, ids[job.n_reused:],
                                  history=ids[: job.n_reused], on_token=on_token, **job.options)
            if job.prompt_logprobs:
                first = token_logprobs(self.tokenizer, ids[0], np.zeros(self.info["n_vocab"], dtype=np.float32), 0)
                job.prompt_entries = [{**first, "logprob": None, "top_logprobs": None}]
            slot.todo = list(ids[job.n_reused:])
            slot.n_prompt_done = job.n_reused
            slot.leader = self._leader_for(slot)
            if not any(s.gen is not None for s in self.slots if s is not slot):
                # A busy period begins: the page's per-layer rates count from here.
                self.live.begin_request(self.session.expert_stats())
        except BaseException as e:  # noqa: BLE001 - handed to the request, which answers it
            job.error = e
            self._finish(slot)

    def _leader_for(self, slot: Slot):
        """Another slot still prefilling exactly this Job's prompt, whose fork would save this
        slot's prefill; None otherwise. Slot 0 never follows: its sequence (the Session's own) cannot
        be removed for the fork."""
        job = slot.job
        if slot.sequence is None or slot.index == 0 or job.prompt_logprobs or len(slot.todo) < 2:
            return None
        for other in self.slots:
            o = other.job
            if (other is not slot and o is not None and other.gen is not None and other.todo and other.leader is None
                    and not o.prompt_logprobs and o.prompt_ids == job.prompt_ids and not o.stopped.is_set()):
                return other
        return None

    def _adopt_followers(self, leader: Slot, out: np.ndarray) -> None:
        """The leader's prefill just ended with logits `out` (its last prompt row): each slot
        following it takes a fork of its sequence and samples from a copy of those logits (sampling
        may change its logits in place: a bias, a penalty, a grammar's mask)."""
        for slot in self.slots:
            if slot.leader is not leader:
                continue
            slot.leader = None
            if slot.job is None or slot.job.stopped.is_set():
                continue
            job = slot.job
            try:
                old = slot.sequence.id
                slot.sequence.remove()
                slot.sequence = leader.sequence.fork()
                if self.speculation is not None:
                    self.speculation.forget(old)  # a draft model's sequence for the old id is free
                slot.held = []
                job.n_reused = len(job.prompt_ids)  # not decoded again: the leader's KV rows
                slot.todo, slot.n_prompt_done = [], len(job.prompt_ids)
                slot.gen.prefilled()
                self._advance(slot, [], out.copy())
            except BaseException as e:  # noqa: BLE001 - handed to the request, which answers it
                job.error = e
                self._finish(slot, keep_cache=False)

    def _plan_step(self) -> list:
        """The step's (slot, tokens): one token from each decoding slot, then prompt chunks in the
        order the slots' Jobs started, within batch_size tokens; the oldest prefill gets at least
        one token even when the decoding slots fill batch_size, so no prompt waits forever."""
        running = [s for s in self.slots if s.job is not None and s.gen is not None and s.leader is None]
        decoding = [s for s in running if not s.todo]
        prefilling = sorted((s for s in running if s.todo), key=lambda s: s.job.t_start)
        entries = [(s, [s.gen.next_token]) for s in decoding]
        room = self.batch_size - len(entries)
        if self.speculation is not None:
            # Draft tokens ride along after each decoding slot's next token, within batch_size.
            for s, tokens in entries:
                s.draft = self.speculation.draft(s.gen.context, min(s.gen.room(self._n_past(s)), max(room, 0)),
                                                 key=0 if s.sequence is None else s.sequence.id)
                tokens.extend(s.draft)
                room -= len(s.draft)
        for i, s in enumerate(prefilling):
            if room <= 0 and i > 0:
                break
            limit = max(room, 1)
            if s.job.prompt_logprobs:
                limit = min(limit, self.PROMPT_LOGITS_CHUNK)
            chunk = s.todo[:limit]
            entries.append((s, chunk))
            room -= len(chunk)
        return entries

    def _run_step(self) -> None:
        from .. import _core

        entries = self._plan_step()
        if not entries:
            return
        # Per entry: every row's logits (a prompt whose logprobs are asked for, a verify step) and
        # whether the step may be cut back (a verify step).
        flags = [(bool(s.job.prompt_logprobs and s.todo) or bool(s.draft), bool(s.draft)) for s, _ in entries]
        with self._state:
            for s, _ in entries:
                s.job.in_step = True
        error = None
        t0 = time.perf_counter()
        try:
            if self.n_slots == 1:
                outputs = [self.session.decode(entries[0][1], all_logits=flags[0][0], rewindable=flags[0][1])]
            else:
                outputs = self.session.decode_batch([(s.sequence, tokens, *flag)
                                                     for (s, tokens), flag in zip(entries, flags)])
        except _core.CancelledError:  # one slot, its Job cancelled: nothing appended
            outputs = [None] * len(entries)
        except BaseException as e:  # noqa: BLE001 - every Job of the step is answered with it
            outputs, error = [None] * len(entries), e
        if self.speculation is not None and len(entries) == 1 and not entries[0][0].todo and error is None:
            # A step of one decoding slot: what a verify step of its draft length costs alone.
            slot = entries[0][0]
            self.speculation.observe(len(slot.draft), time.perf_counter() - t0,
                                     key=0 if slot.sequence is None else slot.sequence.id)
        self._step += 1
        n_tokens = sum(len(tokens) for _, tokens in entries)
        with self._state:
            for s, _ in entries:
                s.job.in_step = False
            self.counts["steps"] += 1
            self.counts["step_tokens"] += n_tokens
            self.counts["step_sequences"] += len(entries)
            self.step_histograms["tokens"].observe(n_tokens)
            self.step_histograms["sequences"].observe(len(entries))
        self.live.add_tokens(sum(len(tokens) for (_, tokens), out in zip(entries, outputs)
                                 if out is not None and out.size))
        for (slot, tokens), out in zip(entries, outputs):
            job = slot.job
            if error is not None:
                job.error = error
                self._finish(slot)
                continue
            if job.stopped.is_set() or out is None or out.size == 0:  # empty: its Sequence.cancel() hit
                if slot.cancel_sent:
                    # Either the cancel dropped this step's tokens (a recurrent state then needs a
                    # reset) or it came after the step and is still pending, to drop the sequence's
                    # next step: the sequence starts over (Sequence.reset consumes a pending cancel).
                    self._sequence(slot).reset()
                    self._finish(slot, keep_cache=False)
                else:
                    self._finish(slot)
                continue
            try:
                self._advance(slot, tokens, out)
            except BaseException as e:  # noqa: BLE001 - a logits processor, a sampler error
                job.error = e
                self._finish(slot)
        if self.live.due():
            self._observe(self.session.expert_stats())

    def _advance(self, slot: Slot, tokens: list, out: np.ndarray) -> None:
        """A slot's step is decoded: `out` is its logits ([n_vocab], or [len(tokens), n_vocab] when
        the step kept every row). Prefill moves on; a finished prompt or a decoded token samples."""
        job, gen = slot.job, slot.gen
        if slot.todo:
            if out.ndim == 2 and job.prompt_logprobs:
                ids = job.prompt_ids
                for k, row in enumerate(out):
                    i = slot.n_prompt_done + k + 1  # the prompt position this row predicts
                    if i < len(ids):
                        job.prompt_entries.append(token_logprobs(self.tokenizer, ids[i], row, job.n_top or 0))
            slot.todo = slot.todo[len(tokens):]
            slot.n_prompt_done += len(tokens)
            if slot.todo:
                return
            gen.prefilled()
            self._adopt_followers(slot, out[-1] if out.ndim == 2 else out)
        if gen.finished is None and slot.draft:  # a verify step: keep what sampling accepts
            draft, slot.draft = slot.draft, []
            n_past = self._n_past(slot)
            piece, n_keep = gen.verify(out, draft, n_past)
            self.speculation.record(len(draft), n_keep - (n_past - len(draft)))
            if n_keep < n_past:
                self._sequence(slot).truncate(n_keep)
            with self._state:
                self.counts["draft_tokens"] += len(draft)
                self.counts["draft_tokens_accepted"] += n_keep - (n_past - len(draft))
            if piece:
                self._emit(slot, piece)
        elif gen.finished is None:  # max_tokens 0: finished before its first sample
            piece = gen.step(out[-1] if out.ndim == 2 else out, self._n_past(slot))
            if piece:
                self._emit(slot, piece)
        if gen.finished is not None:
            tail = gen.flush()
            if tail:
                self._emit(slot, tail)
            n = len(gen.generated)
            if slot.raw is not None:
                tail = "".join(slot.raw.push(t) for t in gen.generated[slot.n_raw:]) + slot.raw.flush()
                slot.n_raw = n
                if tail or slot.pending:
                    job.put((tail, [(slot.produced, e) for e in slot.pending], n))
                    slot.pending.clear()
            if slot.pending:  # tokens that wrote no text (a control token before the end)
                job.put(("", [(slot.produced, e) for e in slot.pending], n))
                slot.pending.clear()
            self._finish(slot)

    def _emit(self, slot: Slot, piece: str) -> None:
        """Puts a piece of the Job's text (with keep_special: the text, control tokens included, of
        the tokens sampled since the last piece) with the logprob entries of its tokens."""
        job, generated = slot.job, slot.gen.generated
        if slot.raw is not None:
            piece = "".join(slot.raw.push(t) for t in generated[slot.n_raw:])
            slot.n_raw = len(generated)
        job.t_first = job.t_first or time.perf_counter()
        job.put((piece, [(slot.produced, e) for e in slot.pending], len(generated)))
        slot.pending.clear()
        slot.produced += len(piece)

    def _finish(self, slot: Slot, keep_cache: bool = True) -> None:
        """Ends the slot's Job (its counts, its finish reason, END) and frees the slot. The cache
        holds a prefix of prompt + sampled (a cancelled step appended nothing), kept for the next
        Job unless `keep_cache` is False or the Job failed ([] held: the next Job resets it)."""
        job, gen = slot.job, slot.gen
        generated = list(gen.generated) if gen is not None else []
        keep_cache = keep_cache and job.error is None
        slot.held = (job.prompt_ids + generated)[: self._n_past(slot)] if keep_cache else []
        job.n_generated, job.tokens = len(generated), generated
        job.t_end = time.perf_counter()
        full = gen is not None and gen.finished in (LENGTH, CONTEXT)
        job.finish_reason = "length" if full and not job.stopped.is_set() else "stop"
        slot.gen, slot.todo, slot.raw, slot.pending, slot.cancel_sent = None, [], None, [], False
        slot.draft, slot.leader = [], None
        for other in self.slots:  # its followers prefill on their own
            if other.leader is slot:
                other.leader = None
        slot.last_used = self._step
        with self._state:
            slot.job, job.slot = None, None
            self.counts["requests"] += 1
            self.counts["cancelled"] += job.stopped.is_set()
            self.counts["completion_tokens"] += job.n_generated
            self.counts["prompt_tokens_reused"] += job.n_reused
            self.counts["prompt_tokens_prefilled"] += len(job.prompt_ids) - job.n_reused
            t_first = job.t_first or job.t_end
            self.counts["prompt_seconds"] += t_first - job.t_start
            self.counts["decode_seconds"] += job.t_end - t_first
        if all(s.gen is None for s in self.slots):
            self._observe(self.session.expert_stats())  # the end of a busy period always samples
        job.put(END)

    @staticmethod
    def _expert_totals(stats: dict) -> tuple:
        layers = stats["layers"]
        return (sum(int(la["accesses"]) for la in layers), sum(int(la["hits"]) for la in layers),
                sum(int(la["bytes_read"]) for la in layers))

    def _observe(self, stats: dict) -> None:
        """A sample of the expert cache: the page's view and the totals /metrics reports."""
        self.live.observe(stats)
        accesses, hits, bytes_read = (a - b for a, b in zip(self._expert_totals(stats), self._expert_base))
        with self._state:
            self.counts["expert_accesses"] = accesses
            self.counts["expert_hits"] = hits
            self.counts["expert_bytes_read"] = bytes_read
