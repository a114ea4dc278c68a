"""The Engine: the one Session and the one worker thread that calls it, and the Job each request
queues on it.

Who owns what: the Engine owns the Session and one worker thread; every request is a Job queued on
that thread (the thread pool of one is the request queue), so requests run one after the other.
The event loop never calls the Session except Session.cancel() (lock-free). Text flows one way:
worker thread -> Job.queue (asyncio, via call_soon_threadsafe) -> response; the end of a Job is
END on its queue, after the worker has written the Job's counts. A client that goes away, or a stop
string that matched, cancels its Job: a queued Job is skipped, a running one gets Session.cancel()
and stops within one layer. Engine._state guards which Job is running, so a cancel never reaches
the next request's decode. A prompt that extends the ids the cache holds decodes only its new
tokens (the next turn of a chat), one that shares a prefix with them cuts the cache back to that
prefix first (prompt.reuse_prefix). Nothing here knows about HTTP.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .live import LiveStats
from .logprobs import token_logprobs
from .prompt import fim_token_ids, reuse_prefix

# The last item on a Job's queue.
END = object()


class Job:
    """One request's generation: its pieces arrive on `queue` (the event loop's side) as (text,
    [(text offset, logprob entry)]) pairs, the entries of the tokens whose text begins the piece
    (none unless n_top is set); its counts are written by the worker before END is queued."""

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

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class Engine:
    """The one Session and the one thread that calls it (see the module docstring)."""

    def __init__(self, session):
        self.session = session
        # Read once here, so the event loop never calls the Session for them: the model's facts
        # and its Tokenizer (immutable; built on first use, so built now, before any thread runs).
        self.info = dict(session.info)
        self.n_ctx = self.info["n_ctx"]
        self.tokenizer = session.tokenizer
        # (prefix, suffix, middle) fill-in-the-middle token ids, None when the vocabulary has none.
        self.fim_ids = fim_token_ids(self.tokenizer, session.metadata)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sharpi-serve")
        self._state = threading.Lock()
        self._current: Job | None = None
        # Finished requests, those of them stopped early by cancel() (a client that left, a stop
        # string), their tokens, and the worker's seconds to the first text of each (prefill) and
        # after it (decode): GET /v1/sharpi/stats and /metrics. Written by the worker under _state.
        self.counts = {"requests": 0, "cancelled": 0, "completion_tokens": 0, "prompt_tokens_reused": 0,
                       "prompt_tokens_prefilled": 0, "prompt_seconds": 0.0, "decode_seconds": 0.0}
        self._n_waiting = 0  # Jobs submitted and not started yet (under _state)
        # The ids the KV cache holds, in order (worker thread only); [] after an error, so the
        # next request starts from reset().
        self._history: list = []
        # The expert-cache view the page at / plots: sampled by the worker between tokens.
        self.live = LiveStats(session.info["n_expert_used"])
        self._counted = 0  # session.n_past when positions were last counted into `live`

    def _sample(self, force: bool = False) -> None:
        """Counts the positions decoded since the last call into the live view and samples the
        expert cache when due (worker thread, between decodes)."""
        n_past = self.session.n_past
        self.live.add_tokens(n_past - self._counted)
        self._counted = n_past
        if force or self.live.due():
            self.live.observe(self.session.expert_stats())

    def snapshot(self) -> dict:
        """The counts, "busy" (whether a Job runs now) and "waiting" (Jobs queued behind it), read
        together."""
        with self._state:
            return {**self.counts, "busy": self._current is not None, "waiting": self._n_waiting}

    def submit(self, prompt_ids: list, options: dict, n_top: int | None = None, keep_special: bool = False,
               prompt_logprobs: bool = False) -> Job:
        job = Job(asyncio.get_running_loop(), prompt_ids, options, n_top, keep_special, prompt_logprobs)
        with self._state:
            self._n_waiting += 1
        self._pool.submit(self._run, job)
        return job

    def cancel(self, job: Job) -> None:
        with self._state:
            job.stopped.set()
            if self._current is job:
                self.session.cancel()

    # Prompt positions decoded per call when their logits are kept: [chunk, n_vocab] float32 at a time.
    PROMPT_LOGITS_CHUNK = 256

    def _prompt_entries(self, job: Job) -> list:
        """The prompt's logprob entries (Job.prompt_logprobs), decoding all of the prompt but its
        last token from a reset cache (worker thread). Token i's entry comes from the logits at
        position i - 1, as a generated token's from the logits it was sampled from."""
        s, ids = self.session, job.prompt_ids
        first = token_logprobs(s.tokenizer, ids[0], np.zeros(s.info["n_vocab"], dtype=np.float32), 0)
        entries = [{**first, "logprob": None, "top_logprobs": None}]
        for start in range(0, len(ids) - 1, self.PROMPT_LOGITS_CHUNK):
            chunk = ids[start : min(start + self.PROMPT_LOGITS_CHUNK, len(ids) - 1)]
            rows = s.decode(chunk, all_logits=True)
            for k, row in enumerate(rows):
                entries.append(token_logprobs(s.tokenizer, ids[start + k + 1], row, job.n_top or 0))
        return entries

    def _run(self, job: Job) -> None:
        from .. import _core

        s = self.session
        with self._state:
            self._n_waiting -= 1
            if job.stopped.is_set():
                job.put(END)
                return
            self._current = job
            s.clear_cancel()
        s.last_tokens = []
        try:
            job.t_start = time.perf_counter()
            ids = job.prompt_ids
            job.n_reused = reuse_prefix(s, [] if job.prompt_logprobs else self._history, ids)
            self._counted = job.n_reused
            self.live.begin_request(s.expert_stats())
            n_held = job.n_reused
            if job.prompt_logprobs:
                job.prompt_entries = self._prompt_entries(job)
                n_held = len(ids) - 1
            pending: list = []  # logprob entries of tokens whose text has not been put yet
            produced = 0  # characters put so far: the next piece's offset

            def on_token(token, logits):
                pending.append(token_logprobs(s.tokenizer, token, logits, job.n_top))

            gen = s.generate(ids[n_held:], history=ids[:n_held],
                             on_token=None if job.n_top is None else on_token, **job.options)
            # keep_special: each piece is the text, control tokens included, of the tokens sampled
            # since the last one (a control token's text goes out with the next piece or the tail).
            raw = s.tokenizer.stream(skip_special=False) if job.keep_special else None
            n_raw = 0
            try:
                for piece in gen:
                    if raw is not None:
                        piece = "".join(raw.push(t) for t in s.last_tokens[n_raw:])
                        n_raw = len(s.last_tokens)
                    job.t_first = job.t_first or time.perf_counter()
                    job.put((piece, [(produced, e) for e in pending]))
                    pending.clear()
                    produced += len(piece)
                    self._sample()
                    if job.stopped.is_set():
                        break
            finally:
                gen.close()
            if raw is not None:
                tail = "".join(raw.push(t) for t in s.last_tokens[n_raw:]) + raw.flush()
                if tail or pending:
                    job.put((tail, [(produced, e) for e in pending]))
                    pending.clear()
            if pending:  # tokens that wrote no text (a control token before the end)
                job.put(("", [(produced, e) for e in pending]))
            self._sample(force=True)
        except _core.CancelledError:
            # The client left or a stop string matched: nothing more to say. (A failure here
            # leaves through the finally below, which still ends the request.)
            self._sample(force=True)
        except BaseException as e:  # noqa: BLE001 - handed to the request, which answers it
            job.error = e
        finally:
            job.n_generated = len(s.last_tokens)
            job.tokens = list(s.last_tokens)
            # A cancelled decode appended nothing, so the cache holds a prefix of prompt + sampled.
            self._history = [] if job.error else (job.prompt_ids + s.last_tokens)[: s.n_past]
            job.t_end = time.perf_counter()
            with self._state:
                self._current = None
                s.clear_cancel()
                self.counts["requests"] += 1
                self.counts["cancelled"] += job.stopped.is_set()
                self.counts["completion_tokens"] += job.n_generated
                self.counts["prompt_tokens_reused"] += job.n_reused
                self.counts["prompt_tokens_prefilled"] += len(job.prompt_ids) - job.n_reused
                t_first = job.t_first or job.t_end
                self.counts["prompt_seconds"] += t_first - job.t_start
                self.counts["decode_seconds"] += job.t_end - t_first
            full = job.n_generated >= job.options["max_tokens"] or s.n_past >= self.n_ctx
            job.finish_reason = "length" if full and not job.stopped.is_set() else "stop"
            job.put(END)

