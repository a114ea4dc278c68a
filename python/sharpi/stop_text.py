"""StopText: streamed text cut at the first stop string or reverse prompt, for `sharpi run` (--stop,
-r) and the server (a request's `stop`, server/stops.py). One scanner, so both cut the same way."""

from __future__ import annotations


class StopText:
    """Cuts streamed text at the first stop string (left out: OpenAI's `stop`, run's --stop) or
    reverse prompt (kept, as llama-cli shows run's -r), whichever cut comes first. It holds back a tail that may begin one of them,
    so nothing after a cut is ever printed; with neither given it passes text straight through."""

    def __init__(self, stops: list, reverse_prompts: list = ()):
        self.cuts = [(s, 0) for s in stops] + [(r, len(r)) for r in reverse_prompts]
        self.pending = ""

    def push(self, text: str) -> tuple:
        """(text safe to print, whether a cut was found: then generation should stop)."""
        self.pending += text
        cuts = [at + keep for at, keep in ((self.pending.find(s), keep) for s, keep in self.cuts) if at >= 0]
        if cuts:
            out, self.pending = self.pending[: min(cuts)], ""
            return out, True
        hold = 0
        for s, _ in self.cuts:
            for n in range(min(len(s) - 1, len(self.pending)), hold, -1):
                if self.pending.endswith(s[:n]):
                    hold = n
                    break
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(out) :]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out
