"""Stop strings: StopScanner finds the first one in streamed text, and stream_until_stop() is a
Job's stream of (text, logprob entries) cut there. Runs on the event loop."""

from __future__ import annotations

from .scheduler import END, Engine, Job


class StopScanner:
    """Finds the first stop string in streamed text; holds back a tail that may begin one."""

    def __init__(self, stops: list):
        self.stops, self.pending = stops, ""

    def push(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string matched: then nothing after it is emitted)."""
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        keep = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.pending)), keep, -1):
                if self.pending.endswith(s[:n]):
                    keep = n
                    break
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(out) :]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


async def stream_until_stop(engine: Engine, job: Job, stops: list):
    """(text, logprob entries) of a Job as it streams, cut at the first stop string; cancels the
    Job when the caller stops early (a stop string, a disconnect: asyncio cancels us at an await).
    An entry goes out with the text its token's text begins in; entries of tokens that begin at or
    after a stop string are dropped with their text."""
    scan = StopScanner(stops)
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
            text, entries = item
            waiting += entries
            text, hit = scan.push(text)
            emitted += len(text)
            out = release()
            if text or out:
                yield text, out
            if hit:
                engine.cancel(job)
                job.finish_reason = "stop"
                while await job.queue.get() is not END:
                    pass
                finished = True
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

