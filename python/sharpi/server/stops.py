"""Stop strings: stream_until_stop() is a Job's stream of (text, logprob entries) cut at the first
one (stop_text.StopText finds it). Runs on the event loop."""

from __future__ import annotations

from ..stop_text import StopText
from .scheduler import END, Engine, Job


async def stream_until_stop(engine: Engine, job: Job, stops: list):
    """(text, logprob entries) of a Job as it streams, cut at the first stop string; cancels the
    Job when the caller stops early (a stop string, a disconnect: asyncio cancels us at an await).
    An entry goes out with the text its token's text begins in; entries of tokens that begin at or
    after a stop string are dropped with their text."""
    scan = StopText(stops)
    waiting: list = []  # (offset, entry) whose text the scanner has not let out yet
    emitted = 0  # characters let out

    def release(everything: bool = False) -> list:
        nonlocal waiting
        out = [w for w in waiting if everything or w[0] < emitted]
        waiting = waiting[len(out) :]
        return out

    finished = False
    try:
        while True:
            item = await job.queue.get()
            if item is END:
                finished = True
                break
            text, entries, n_tokens = item
            waiting += entries
            text, hit = scan.push(text)
            emitted += len(text)
            out = release()
            if text or out:
                yield text, out
            if hit:
                engine.cancel(job)
                job.finish_reason = "stop"
                job.stop_sequence = scan.matched
                while await job.queue.get() is not END:
                    pass
                finished = True
                # The worker may have sampled more tokens before the cancel reached it.
                engine.trim(job, n_tokens)
                return
        tail = scan.flush()
        out = release(everything=True)
        if tail or out:
            yield tail, out
    finally:
        if not finished:
            engine.cancel(job)
    if job.error is not None:
        raise job.error

