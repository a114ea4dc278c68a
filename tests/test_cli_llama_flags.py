"""llama.cpp's command-line habits in `sharpi run` and `sharpi chat` (issue 37).

Every llama-cli / llama-server flag a llama.cpp or Ollama user types first, typed as llama-cli
takes it, either works with llama.cpp's meaning, checked here for its effect on the shipped model
(prompt token ids, where the text stops, how many tokens were generated), or is refused with exit
status 2 and a message that names the flag and says what sharpi does instead. The escape rules are
checked against a table written from llama.cpp's string_process_escapes (common/common.cpp), and no
parser of the `sharpi` command takes abbreviations.
"""

from __future__ import annotations

import argparse
import re

import pytest
import sharpi
from sharpi import cli
from sharpi.cli_args import sampling_options
from sharpi.models import default_model_path
from sharpi.server.prompt import encode_chat
from sharpi.stop_text import StopText

TIMING = re.compile(r"^sharpi: prompt (\d+) tokens, generated (\d+) tokens", re.MULTILINE)
PROMPT_IDS = re.compile(r"^sharpi: prompt \d+ tokens: ([\d ]*)$", re.MULTILINE)


def run(capsys, *argv):
    """`sharpi run ARGV` in-process on the shipped model: (exit status, stdout, stderr)."""
    try:
        code = cli.main(["run", *argv])
    except SystemExit as e:  # argparse's usage errors
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def generated(err: str) -> int:
    m = TIMING.search(err)
    assert m, err
    return int(m.group(2))


def prompt_ids(err: str) -> list:
    m = PROMPT_IDS.search(err)
    assert m, err
    return [int(t) for t in m.group(1).split()]


@pytest.fixture(scope="module")
def tok():
    return sharpi.Session(default_model_path(), threads=1).tokenizer


GREEDY = ("-n", "24", "--temp", "0", "-t", "1", "--ignore-eos")

# ------------------------------------------------------------------ no abbreviations


def all_parsers(parser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield from all_parsers(child)


def test_no_parser_takes_abbreviations(capsys):
    parsers = list(all_parsers(cli.build_parser()))
    assert len(parsers) > 10  # run, chat, serve, predictor's own subcommands, ...
    assert [p.prog for p in parsers if p.allow_abbrev] == []
    # --predict is llama.cpp's -n, never an abbreviation of --predictor.
    args = cli.build_parser().parse_args(["run", "--predict", "8"])
    assert (args.n_predict, args.predictor) == (8, "none")
    for argv in (["run", "--predic", "8"], ["run", "--ignore"], ["chat", "--tem", "0"]):
        with pytest.raises(SystemExit) as e:
            cli.build_parser().parse_args(argv)
        assert e.value.code == 2
        assert "unrecognized arguments" in capsys.readouterr().err


# ------------------------------------------------------------------ refused flags


NO_CUDA = not sharpi.cuda_available()


@pytest.mark.parametrize("command", ["run", "chat"])
@pytest.mark.parametrize(
    ("argv", "names", "says"),
    [
        (["-ngl", "99"], "-ngl 99", "--device cuda"),
        (["--n-gpu-layers", "33"], "--n-gpu-layers 33", "--vram-budget"),
        (["--gpu-layers", "all"], "--gpu-layers all", "does not offload layers"),
        (["--no-mmap"], "--no-mmap", "maps the GGUF file"),
        (["--mlock"], "--mlock", "does not lock"),
        (["--grammar", "root ::= [a-z]+"], "--grammar root ::= [a-z]+", "constrained sampling"),
        (["--grammar-file", "g.gbnf"], "--grammar-file g.gbnf", "constrained sampling"),
        (["-j", "{}"], "-j {}", "constrained sampling"),
    ],
)
def test_refused_flags_name_themselves(capsys, command, argv, names, says):
    with pytest.raises(SystemExit) as e:
        cli.main([command, *argv, "-p", "x"] if command == "run" else [command, *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert f"error: {names}: " in err and says in err, err
    if argv[0] == "-ngl":
        assert ("no usable CUDA device" in err) == NO_CUDA


@pytest.mark.parametrize("flag", ["-cnv", "--conversation", "-i", "--interactive", "-if", "--interactive-first"])
def test_run_points_conversation_flags_at_chat(capsys, flag):
    code, out, err = run(capsys, "-p", "x", flag)
    assert code == 2 and out == ""
    assert f"error: {flag}: " in err and "`sharpi chat`" in err


def test_chat_refuses_no_conversation(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["chat", "-no-cnv"])
    assert e.value.code == 2 and "error: -no-cnv: " in capsys.readouterr().err


def test_n_below_minus_one_is_refused(capsys):
    code, _, err = run(capsys, "-p", "x", "-n", "-3")
    assert code == 2 and "-n must be >= 0, or -1" in err


# ------------------------------------------------------------------ accepted flags and their effects


def test_predict_is_n(capsys):
    code, out, err = run(capsys, "-p", "def ", "--predict", "8", "--temp", "0", "--ignore-eos")
    assert code == 0 and generated(err) == 8
    code, out2, err = run(capsys, "-p", "def ", "--n-predict", "8", "--temp", "0", "--ignore-eos")
    assert (code, out2) == (0, out)


def test_n_minus_one_runs_to_the_end_of_the_context(capsys, tok):
    n_prompt = len(tok.encode("import os"))
    for n in ("-1", "-2"):
        code, _, err = run(capsys, "-p", "import os", "-n", n, "-c", "32", "--temp", "0", "--ignore-eos")
        # The last token is sampled from the logits of position 31 and not decoded: n_past reaches n_ctx.
        assert code == 0 and generated(err) == 32 - n_prompt + 1


def test_harmless_flags_change_nothing(capsys):
    _, base, _ = run(capsys, "-p", "class ", *GREEDY)
    for extra in (["-ngl", "0"], ["-fa", "on"], ["-fa", "off"], ["--flash-attn", "auto"], ["-fa"], ["-fa", "1"],
                  ["-b", "512", "-ub", "128"], ["--batch-size", "64", "--ubatch-size", "32"], ["--jinja"],
                  ["-no-cnv"], ["--no-conversation"], ["-st"], ["--no-display-prompt"]):
        code, out, err = run(capsys, "-p", "class ", *GREEDY, *extra)
        assert (code, out) == (0, base), (extra, err)
    code, _, err = run(capsys, "-p", "x", "-fa", "maybe")
    assert code == 2 and "-fa/--flash-attn" in err
    code, _, err = run(capsys, "-p", "x", "-b", "0")
    assert code == 2 and "-b must be > 0" in err


def test_escapes_in_the_prompt(capsys, tok, tmp_path):
    # llama.cpp processes escapes in -p by default: the literal backslash-n becomes a newline.
    _, _, err = run(capsys, "-p", r"a\tb\nc", "-v", "-n", "1", "--temp", "0")
    assert prompt_ids(err) == tok.encode("a\tb\nc")
    _, _, err = run(capsys, "-p", r"a\tb\nc", "-e", "-v", "-n", "1", "--temp", "0")
    assert prompt_ids(err) == tok.encode("a\tb\nc")
    _, _, err = run(capsys, "-p", r"a\tb\nc", "--no-escape", "-v", "-n", "1", "--temp", "0")
    assert prompt_ids(err) == tok.encode(r"a\tb\nc")
    # A -f file is verbatim (code keeps its "\n" strings) unless -e asks for escapes.
    f = tmp_path / "p.py"
    f.write_text('print("a\\nb")\n', encoding="utf-8")
    _, _, err = run(capsys, "-f", str(f), "-v", "-n", "1", "--temp", "0")
    assert prompt_ids(err) == tok.encode('print("a\\nb")\n')
    _, _, err = run(capsys, "-f", str(f), "-e", "-v", "-n", "1", "--temp", "0")
    assert prompt_ids(err) == tok.encode('print("a\nb")\n')


# Written from llama.cpp's string_process_escapes (common/common.cpp), one case per branch.
ESCAPES = [
    (r"plain", "plain"),
    (r"a\nb\rc\td", "a\nb\rc\td"),
    (r"\'\"\\", "'\"\\"),
    (r"\\n", "\\n"),  # an escaped backslash, then a plain n
    (r"\x41\x62", "Ab"),
    (r"\xc3\xa9t\xc3\xa9", "été"),  # bytes: two of them make one UTF-8 character
    (r"\x4", "\\x4"),  # too few digits at the end: kept
    (r"\xzz", "\\xzz"),  # not hex: kept
    (r"\q", "\\q"),  # unknown escape: kept, backslash included
    ("end\\", "end\\"),  # a lone backslash at the end
    (r"\xff", "\ufffd"),  # a byte that is not UTF-8 on its own
    ("Zürich ☃", "Zürich ☃"),
]


@pytest.mark.parametrize(("text", "expected"), ESCAPES)
def test_process_escapes_as_llama_cpp(text, expected):
    assert cli.process_escapes(text) == expected


def test_reverse_prompt_and_stop(capsys):
    code, full, err = run(capsys, "-p", "def ", *GREEDY)
    assert code == 0 and generated(err) == 24
    text = full[:-1]
    at = next(i for i in range(3, len(text) - 3) if text[i : i + 3].strip() and text.find(text[i : i + 3]) == i)
    needle = text[at : at + 3]
    # -r: llama-cli halts at the reverse prompt, which stays on screen.
    code, out, err = run(capsys, "-p", "def ", *GREEDY, "-r", needle)
    assert code == 0 and out == text[: at + 3] + "\n"
    assert generated(err) < 24
    # --stop: the API's stop string, left out.
    code, out, err = run(capsys, "-p", "def ", *GREEDY, "--stop", needle)
    assert code == 0 and out == text[:at] + "\n"
    assert generated(err) < 24
    # Repeatable; the earliest cut wins; a text that never comes changes nothing.
    code, out, _ = run(capsys, "-p", "def ", *GREEDY, "-r", "never said", "--reverse-prompt", needle)
    assert out == text[: at + 3] + "\n"
    code, out, _ = run(capsys, "-p", "def ", *GREEDY, "--stop", "never said")
    assert out == full
    # Escapes apply to -r as to -p: r"\n" is a newline.
    if "\n" in text:
        code, out, _ = run(capsys, "-p", "def ", *GREEDY, "-r", r"\n")
        assert out == text[: text.index("\n") + 1] + "\n"


def test_stop_text_holds_back_what_may_begin_a_stop():
    scan = StopText(["STOP"], [])
    assert scan.push("abc ST") == ("abc ", False)
    assert scan.push("OR") == ("STOR", False)
    assert scan.push("x S") == ("x ", False)
    assert scan.push("TOP tail") == ("", True)
    scan = StopText([], ["<end>"])
    assert scan.push("a <en") == ("a ", False)
    assert scan.push("d> b") == ("<end>", True)


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_system_prompt_and_chat_template_file(capsys, tok, tmp_path):
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML, encoding="utf-8")
    _, _, err = run(capsys, "-p", "hi", "-sys", "be brief", "--chat-template-file", str(template), "-v",
                    "-n", "1", "--temp", "0")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert prompt_ids(err) == encode_chat(tok, messages, template=CHATML)
    # The shipped code model has no template of its own: -sys alone says so, in one line.
    code, _, err = run(capsys, "-p", "hi", "--system-prompt", "be brief")
    assert code == 1 and err.startswith("sharpi: error: ") and "no chat template" in err


def test_verbose_shows_model_sampling_and_prompt_ids(capsys, tok):
    code, _, err = run(capsys, "-p", "def main", "-v", "-n", "2", "--temp", "0", "--presence-penalty", "0.5")
    assert code == 0
    info = sharpi.Session(default_model_path(), threads=1).info
    assert f"{info['n_layer']} layers" in err and f"n_vocab {info['n_vocab']}" in err
    assert "presence_penalty=0.5" in err and "temperature=0.0" in err
    assert prompt_ids(err) == tok.encode("def main")
    _, _, also = run(capsys, "-p", "def main", "--verbose-prompt", "-n", "2", "--temp", "0")
    assert prompt_ids(also) == tok.encode("def main")
    _, _, quiet = run(capsys, "-p", "def main", "-n", "2", "--temp", "0")
    assert "sharpi: sampling" not in quiet


def test_logit_bias_flag_bans_a_token(capsys, tok):
    _, base, _ = run(capsys, "-p", "def ", *GREEDY)
    first = tok.encode("def " + base[:-1], add_bos=False)[len(tok.encode("def ", add_bos=False))]
    code, out, _ = run(capsys, "-p", "def ", *GREEDY, "-l", f"{first}-inf")
    assert code == 0 and out != base
    assert not out.startswith(tok.decode([first]))
    for bad in ("abc", "12", "12*3", "12+nan", "+5"):
        code, _, err = run(capsys, "-p", "x", "-l", bad)
        assert code == 2 and "-l/--logit-bias" in err, bad


# ------------------------------------------------------------------ sampling flags reach generate()


def parsed(command: str, *argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args([command, *argv])


@pytest.mark.parametrize("command", ["run", "chat"])
def test_sampling_flags_map_to_generate(command):
    args = parsed(command, "-n", "-1", "--temp", "0.5", "--top-k", "5", "--top-p", "0.9", "--min-p", "0.1",
                  "--repeat-penalty", "1.2", "--repeat-last-n", "-1", "--presence-penalty", "0.5",
                  "--frequency-penalty", "-0.25", "-l", "7+1.5", "--logit-bias", "9-inf", "-l", "7-2",
                  "-s", "3", "--ignore-eos")
    assert sampling_options(args) == {
        "max_tokens": -1, "temperature": 0.5, "top_k": 5, "top_p": 0.9, "min_p": 0.1, "repeat_penalty": 1.2,
        "repeat_last_n": -1, "presence_penalty": 0.5, "frequency_penalty": -0.25,
        "logit_bias": {7: -2.0, 9: float("-inf")}, "seed": 3, "stop_at_eos": False,
    }  # fmt: skip
    # Off by default: the call sharpi always made.
    assert set(sampling_options(parsed(command))) == {"max_tokens", "temperature", "top_k", "top_p", "min_p",
                                                      "repeat_penalty", "seed", "stop_at_eos"}


@pytest.mark.parametrize("flag", ["--presence-penalty", "--frequency-penalty"])
@pytest.mark.parametrize("value", ["2.5", "-3", "nan", "inf"])
def test_penalty_ranges(capsys, flag, value):
    code, _, err = run(capsys, "-p", "x", flag, value)
    assert code == 2 and flag in err


def test_chat_takes_llama_names(tmp_path):
    args = parsed("chat", "-sys", "be brief", "--predict", "16", "-cnv", "--jinja", "-fa", "on",
                  "--chat-template-file", "t.jinja")
    assert (args.system, args.n_predict, args.chat_template) == ("be brief", 16, "t.jinja")
    assert parsed("chat", "--system-prompt", "x").system == "x"
    assert parsed("chat").n_predict == 512


def test_run_penalties_change_the_text(capsys):
    _, base, _ = run(capsys, "-p", "def ", *GREEDY)
    for extra in (["--frequency-penalty", "2"], ["--presence-penalty", "2"], ["--repeat-penalty", "3"]):
        code, out, err = run(capsys, "-p", "def ", *GREEDY, *extra)
        assert code == 0 and out != base, (extra, err)


def test_run_help_lists_every_predictor_the_engine_knows(capsys):
    # The engine names its predictors when it refuses an unknown one; --help must list them all.
    with pytest.raises(sharpi.InvalidArgument) as e:
        sharpi.Session(default_model_path(), ram_budget="12MiB", predictor="no-such-predictor")
    known = re.search(r"\(([a-z_, ]+)\)", str(e.value)).group(1).split(", ")
    assert "depthtime" in known and len(known) >= 8
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    predictor_help = help_text[help_text.index("--predictor NAME[:FILE] predictive") :]
    for name in known:
        assert re.search(rf"\b{name}\b", predictor_help[:400]), name


@pytest.mark.parametrize("flag", ["-r", "--reverse-prompt", "--stop"])
def test_chat_refuses_stop_text(capsys, flag):
    with pytest.raises(SystemExit) as e:
        cli.main(["chat", flag, "User:"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"error: {flag} User:: " in err and "sharpi run -r/--stop" in err
