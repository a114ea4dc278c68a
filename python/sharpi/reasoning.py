"""Reasoning text apart from the answer: `<think>...</think>` (Qwen3, DeepSeek-R1, QwQ) and gpt-oss's
analysis channel, returned as `reasoning_content` beside `content` (llama-server's
`--reasoning-format deepseek`).

ReasoningSplitter works on streamed text: push(piece) returns the (reasoning, content) it can
already tell apart and holds back only a tail that may be the start of a marker split across
pieces (a marker is several tokens), so a client sees each character once, in order, on the right
side. Templates that open the think block in the generation prompt (Qwen3 with thinking on,
DeepSeek-R1) make the model start inside it: start_in_reasoning=True. DeepSeek-V3.2 and V4 may
also end their reasoning by beginning a tool-call section without closing the think block (as
llama.cpp reads them): the section's start ends the reasoning and stays in the answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._core import InvalidArgument
from .stop_text import held_prefix_len
from .tool_calls import DSML_SECTION_STARTS


@dataclass(frozen=True)
class ReasoningMarkers:
    """open/close: the markers around reasoning; drop: markers removed from the answer's side
    (gpt-oss's header of its final channel); answer_starts: texts that end the reasoning as close
    does but belong to the answer (DeepSeek-V3.2's and V4's tool-call sections)."""

    open: str
    close: str
    drop: tuple = ()
    answer_starts: tuple = ()


THINK = ReasoningMarkers("<think>", "</think>")
DSML_THINK = ReasoningMarkers("<think>", "</think>", answer_starts=DSML_SECTION_STARTS)
# gpt-oss (harmony): <|channel|>analysis<|message|>REASONING<|end|><|start|>assistant<|channel|>final<|message|>ANSWER
HARMONY = ReasoningMarkers("<|channel|>analysis<|message|>", "<|end|>",
                           ("<|start|>assistant<|channel|>final<|message|>", "<|channel|>final<|message|>",
                            "<|return|>"))


def markers_for_template(template: str | None) -> ReasoningMarkers | None:
    """The reasoning markers a chat template uses, None when it shows none."""
    if not template:
        return None
    if "<|channel|>" in template:
        return HARMONY
    if "｜DSML｜" in template:
        return DSML_THINK
    if "<think>" in template or "</think>" in template:
        return THINK
    return None


def starts_in_reasoning(prompt_text: str, markers: ReasoningMarkers) -> bool:
    """True when the rendered prompt ends inside an open reasoning block (its generation prompt
    wrote the opening marker), so the reply begins with reasoning."""
    head = prompt_text.rstrip()
    return head.endswith(markers.open) or head.rfind(markers.open) > head.rfind(markers.close)


class ReasoningSplitter:
    def __init__(self, markers: ReasoningMarkers = THINK, start_in_reasoning: bool = False):
        if not markers.open or not markers.close:
            raise InvalidArgument("reasoning markers must be non-empty")
        self._m = markers
        self._in_reasoning = start_in_reasoning
        self._held = ""

    def push(self, piece: str) -> tuple[str, str]:
        """(reasoning, content) now certain; either may be ""."""
        text = self._held + piece
        self._held = ""
        reasoning, content = [], []
        while text:
            if self._in_reasoning:
                ends = (self._m.close, *self._m.answer_starts)
                hits = [(at, m) for m in ends if (at := text.find(m)) >= 0]
                if hits:
                    at, marker = min(hits)
                    reasoning.append(text[:at])
                    text = text[at + len(marker):] if marker == self._m.close else text[at:]
                    self._in_reasoning = False
                    continue
                keep = held_prefix_len(text, ends)
                reasoning.append(text[: len(text) - keep])
                self._held = text[len(text) - keep:]
                break
            markers = (self._m.open, *self._m.drop)
            hits = [(text.find(m), m) for m in markers if text.find(m) >= 0]
            if hits:
                at, marker = min(hits, key=lambda h: (h[0], -len(h[1])))
                content.append(text[:at])
                text = text[at + len(marker):]
                self._in_reasoning = marker == self._m.open
                continue
            keep = held_prefix_len(text, markers)
            content.append(text[: len(text) - keep])
            self._held = text[len(text) - keep:]
            break
        return "".join(reasoning), "".join(content)

    def flush(self) -> tuple[str, str]:
        """What was held back at the end of the stream: a marker's start that never completed is text."""
        held, self._held = self._held, ""
        return (held, "") if self._in_reasoning else ("", held)


def split_reasoning(text: str, markers: ReasoningMarkers = THINK, start_in_reasoning: bool = False) -> tuple[str, str]:
    """(reasoning_content, content) of a whole reply; content loses the whitespace that separated it
    from the reasoning block."""
    splitter = ReasoningSplitter(markers, start_in_reasoning)
    r1, c1 = splitter.push(text)
    r2, c2 = splitter.flush()
    reasoning, content = r1 + r2, c1 + c2
    return reasoning.strip(), content.lstrip() if reasoning else content
