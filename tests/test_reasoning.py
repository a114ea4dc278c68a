"""sharpi.reasoning: reasoning text apart from the answer, whole and streamed in every split.

Oracle: the reasoning and answer written by hand around the markers; streaming is checked by
feeding every split of the text into two and many pieces and comparing the joined output with the
whole-text split (and each side's characters arrive once, in order). Real templates (llama.cpp's
fixtures, as test_chat_templates.py finds them): the generation prompt each renders with thinking
on and off, written out by hand.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from reference import hf_export
from sharpi.reasoning import (
    DSML_THINK,
    HARMONY,
    THINK,
    ReasoningSplitter,
    markers_for_template,
    split_reasoning,
    starts_in_reasoning,
)

DSML_CALL = ('<｜DSML｜function_calls>\n<｜DSML｜invoke name="f">\n'
             '<｜DSML｜parameter name="x" string="true">1</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>')

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
    # DeepSeek-V3.2 / V4: a tool-call section begun inside the think block ends the reasoning and is
    # the answer (llama.cpp reads it so); a closed block, and a section after it, as usual.
    ("Let me check.\n\n" + DSML_CALL, True, DSML_THINK, "Let me check.", DSML_CALL),
    ("Let me check." + DSML_CALL.replace("function_calls", "tool_calls"), True, DSML_THINK, "Let me check.",
     DSML_CALL.replace("function_calls", "tool_calls")),
    ("Let me check.</think>\n\n" + DSML_CALL, True, DSML_THINK, "Let me check.", DSML_CALL),
    ("<think>a</think>b <｜DSML｜function_calls", False, DSML_THINK, "a", "b <｜DSML｜function_calls"),
    ("Let me check <｜DSML｜function_call", True, DSML_THINK, "Let me check <｜DSML｜function_call", ""),
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
    assert markers_for_template("{%- set dsml_token = '｜DSML｜' -%}{{ '<think>' }}") == DSML_THINK
    assert starts_in_reasoning("<|im_start|>assistant\n<think>\n", THINK)
    assert not starts_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n", THINK)
    assert not starts_in_reasoning("<|im_start|>assistant\n", THINK)


# template -> (its markers, how its generation prompt ends with thinking off, and on).
REAL_TEMPLATES = {
    "deepseek-ai-DeepSeek-V3.2": (DSML_THINK, "<｜Assistant｜><think></think>", "<｜Assistant｜><think>"),
    "deepseek-ai-DeepSeek-V4": (DSML_THINK, "<｜Assistant｜></think>", "<｜Assistant｜><think>"),
    "deepseek-ai-DeepSeek-V4-Flash-0731": (DSML_THINK, "<｜Assistant｜></think>", "<｜Assistant｜><think>"),
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": (THINK, "<|im_start|>assistant\n<think></think>",
                                            "<|im_start|>assistant\n<think>\n"),
    "NVIDIA-Nemotron-Nano-v2": (THINK, "<SPECIAL_11>Assistant\n<think></think>", "<SPECIAL_11>Assistant\n<think>\n"),
}
TOOLS = [{"type": "function", "function": {"name": "f", "description": "a tool",
                                           "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def tokenizer():
    import sharpi
    from sharpi.models import default_model_path

    return sharpi.Session(default_model_path(), threads=1, n_ctx=64).tokenizer


@pytest.mark.parametrize("name", sorted(REAL_TEMPLATES))
def test_real_templates_think_blocks(tokenizer, name):
    """Each template's markers, and whether its prompt leaves the think block open: thinking off
    (enable_thinking false; Nemotron-Nano v2 reads /no_think in the system message) and on, with
    and without tools (DeepSeek's tool prompts mention <think> and </think>)."""
    try:
        source = (Path(hf_export.converter_dir()) / "models" / "templates" / f"{name}.jinja").read_text("utf-8")
    except hf_export.ConverterUnavailable as error:
        pytest.skip(f"llama.cpp source unavailable: {error}")
    markers, off, on = REAL_TEMPLATES[name]
    assert markers_for_template(source) == markers
    user = [{"role": "user", "content": "Hi"}]
    for tools in (None, TOOLS):
        prompt = tokenizer.apply_chat_template([{"role": "system", "content": "/no_think"}, *user], template=source,
                                               tools=tools, enable_thinking=False)
        assert prompt.endswith(off) and not starts_in_reasoning(prompt, markers), prompt[-200:]
        prompt = tokenizer.apply_chat_template(user, template=source, tools=tools, enable_thinking=True)
        assert prompt.endswith(on) and starts_in_reasoning(prompt, markers), prompt[-200:]
