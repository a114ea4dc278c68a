"""StopText: streamed text cut at the first stop string or reverse prompt, for `sharpi run` (--stop,
-r) and the server (a request's `stop`, server/stops.py). One scanner, so both cut the same way.
held_prefix_len: the tail of streamed text that may begin a marker, which every scanner of streamed
text (this one, reasoning.ReasoningSplitter, tool_calls.ToolCallStream) holds back."""

from __future__ import annotations


def held_prefix_len(text: str, markers) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `markers`: what a
    scanner of streamed text must hold back until the next piece tells whether a marker begins."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


class StopText:
    """Cuts streamed text at the first stop string (left out: OpenAI's `stop`, run's --stop) or
    reverse prompt (kept, as llama-cli shows run's -r), whichever cut comes first. It holds back a tail that may begin one of them,
    so nothing after a cut is ever printed; with neither given it passes text straight through.
    `matched`: the stop string or reverse prompt that cut, once one has."""

    def __init__(self, stops: list, reverse_prompts: list = ()):
        self.cuts = [(s, 0) for s in stops] + [(r, len(r)) for r in reverse_prompts]
        self.pending = ""
        self.matched: str | None = None

    def push(self, text: str) -> tuple:
        """(text safe to print, whether a cut was found: then generation should stop)."""
        self.pending += text
        cuts = [(at + keep, s) for at, keep, s in ((self.pending.find(s), keep, s) for s, keep in self.cuts) if at >= 0]
        if cuts:
            cut, self.matched = min(cuts, key=lambda c: c[0])
            out, self.pending = self.pending[:cut], ""
            return out, True
        hold = held_prefix_len(self.pending, [s for s, _ in self.cuts])
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(out) :]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out
