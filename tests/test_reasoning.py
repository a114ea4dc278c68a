"""sharpi.reasoning: reasoning text apart from the answer, whole and streamed in every split.

Oracle: the reasoning and answer written by hand around the markers; streaming is checked by
feeding every split of the text into two and many pieces and comparing the joined output with the
whole-text split (and each side's characters arrive once, in order).
"""

from __future__ import annotations

import pytest
from sharpi.reasoning import (
    HARMONY,
    THINK,
    ReasoningSplitter,
    markers_for_template,
    split_reasoning,
    starts_in_reasoning,
)

CASES = [
    # (text, start_in_reasoning, markers, reasoning, content)
    ("<think>\nTwo plus two.\n</think>\n\nIt is 4.", False, THINK, "Two plus two.", "It is 4."),
    ("Two plus two.\n</think>\n\nIt is 4.", True, THINK, "Two plus two.", "It is 4."),  # prompt opened it
    ("No reasoning here.", False, THINK, "", "No reasoning here."),
    ("<think></think>Answer", False, THINK, "", "Answer"),
    ("Still thinking when cut", True, THINK, "Still thinking when cut", ""),
    ("a < b and </thin", False, THINK, "", "a < b and </thin"),  # a marker's start that never completes
    ("<|channel|>analysis<|message|>User asks weather.<|end|><|start|>assistant<|channel|>final<|message|>Sunny.",
     False, HARMONY, "User asks weather.", "Sunny."),
]


@pytest.mark.parametrize("text,start,markers,reasoning,content", CASES)
def test_whole_text(text, start, markers, reasoning, content):
    assert split_reasoning(text, markers, start) == (reasoning, content)


def stream(text: str, cuts: list, markers, start: bool) -> tuple:
    splitter = ReasoningSplitter(markers, start)
    out_r, out_c, last = [], [], 0
    for cut in [*cuts, len(text)]:
        r, c = splitter.push(text[last:cut])
        out_r.append(r)
        out_c.append(c)
        last = cut
    r, c = splitter.flush()
    return "".join(out_r) + r, "".join(out_c) + c


@pytest.mark.parametrize("text,start,markers,reasoning,content", CASES)
def test_every_two_piece_split_streams_the_same(text, start, markers, reasoning, content):
    whole = stream(text, [], markers, start)
    for cut in range(len(text) + 1):
        assert stream(text, [cut], markers, start) == whole, cut


@pytest.mark.parametrize("text,start,markers,reasoning,content", CASES)
def test_character_by_character(text, start, markers, reasoning, content):
    assert stream(text, list(range(1, len(text))), markers, start) == stream(text, [], markers, start)


def test_nothing_is_held_longer_than_a_marker_prefix():
    splitter = ReasoningSplitter(THINK, True)
    assert splitter.push("thinking about </th") == ("thinking about ", "")
    assert splitter.push("ink>done") == ("", "done")
    assert splitter.push(" <thi") == ("", " ")
    assert splitter.push("s is text") == ("", "<this is text")


def test_templates():
    assert markers_for_template(None) is None
    assert markers_for_template("{{ '<think>\\n' }}") == THINK
    assert markers_for_template("<|start|>assistant<|channel|>final<|message|>") == HARMONY
    assert starts_in_reasoning("<|im_start|>assistant\n<think>\n", THINK)
    assert not starts_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n", THINK)
    assert not starts_in_reasoning("<|im_start|>assistant\n", THINK)
