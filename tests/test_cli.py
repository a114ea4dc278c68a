"""The `sharpi` command line.

Two layers:
- In-process tests of sharpi.cli.main with a recording stand-in for sharpi.Session: they check
  that every flag reaches the engine API with the right value, the stdout/stderr split, the timing
  line (numbers worked out by hand from the stats), and that errors become one clean line and
  exit status 1 (usage errors: 2).
- End-to-end tests in a subprocess on a tiny model written by `sharpi make-model --preset tiny`:
  greedy output must equal a greedy loop written here with numpy argmax over Session.decode(),
  decoded by the tokenizer. They skip while sharpi.make_model / sharpi.Session are not installed.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import types
from typing import ClassVar

import numpy as np
import pytest
import sharpi
from sharpi import cli
from sharpi.tokenizer import Tokenizer
from subprocess_env import child_env

# ------------------------------------------------------------------------------------------ in-process


class RecordingSession:
    """Stands in for sharpi.Session: records the calls, streams fixed pieces."""

    instances: ClassVar[list] = []
    pieces: ClassVar[list] = ["Hel", "lo", " wörld ☃"]
    stats: ClassVar[dict] = {
        "n_prompt": 5,
        "n_generated": 3,
        "prefill_s": 0.5,
        "decode_s": 0.25,
        "ttft_s": 0.625,
    }
    fail_in_generate: Exception | None = None
    tokenizer: Tokenizer | None = None

    def __init__(self, path, threads=0, n_ctx=0, **streaming):
        self.path, self.threads, self.n_ctx = path, threads, n_ctx
        self.streaming = streaming  # ram_budget, slru_probation, reader, route_trace
        self.generate_calls = []
        self.last_stats = {}
        RecordingSession.instances.append(self)

    def expert_stats(self):
        return {"layers": []}  # all experts resident: no cache summary

    def close(self):
        return None

    def generate(self, prompt, **kwargs):
        self.generate_calls.append((prompt, kwargs))
        for i, piece in enumerate(self.pieces):
            if self.fail_in_generate is not None and i == 1:
                raise self.fail_in_generate
            yield piece
        self.last_stats = dict(self.stats)


@pytest.fixture
def fake_session(monkeypatch, tmp_path):
    RecordingSession.instances = []
    RecordingSession.fail_in_generate = None
    RecordingSession.tokenizer = None
    monkeypatch.setattr(sharpi, "Session", RecordingSession, raising=False)
    model = tmp_path / "model.gguf"
    model.write_bytes(b"not read by the stand-in")
    return str(model)


def run_main(argv, capsys):
    code = cli.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_run_streams_text_and_prints_timing(fake_session, capsys):
    code, out, err = run_main(["run", "-m", fake_session, "-p", "Hi there"], capsys)
    assert code == 0
    assert out == "Hello wörld ☃\n"
    # 5 prompt tokens in 0.5 s -> 10.0 tok/s; 2 decode steps in 0.25 s -> 8.0 tok/s, 125 ms each.
    assert err.strip() == (
        "sharpi: prompt 5 tokens, generated 3 tokens | prefill 10.0 tok/s | decode 8.0 tok/s | "
        "TTFT 625.0 ms | TPOT 125.0 ms"
    )
    (s,) = RecordingSession.instances
    assert (s.path, s.threads, s.n_ctx) == (fake_session, 0, 0)
    assert s.streaming == {"ram_budget": None, "vram_budget": None, "miss_route": "copy", "slru_probation": 0.25,
                           "reader": "auto",
                           "route_trace": None,
                           "predictor": "none", "lookahead": 1, "prefetch_sizing": "topk", "trace": None,
                           "cache_policy": None,
                           "cache_type_k": None, "cache_type_v": None, "allow_long_context": False,
                           "device": "cpu"}
    ((prompt, kwargs),) = s.generate_calls
    assert prompt == "Hi there"
    assert kwargs == {
        "max_tokens": 64,
        "temperature": 0.8,
        "top_k": 40,
        "top_p": 0.95,
        "min_p": 0.05,
        "repeat_penalty": 1.0,
        "seed": None,
        "stop_at_eos": True,
    }


def test_run_prefers_rates_the_session_reports(fake_session, capsys, monkeypatch):
    monkeypatch.setattr(
        RecordingSession,
        "stats",
        {**RecordingSession.stats, "prefill_tok_s": 123.0, "decode_tok_s": 45.6, "tpot_s": 0.0219},
    )
    _, _, err = run_main(["run", "-m", fake_session, "-p", "x"], capsys)
    assert "prefill 123.0 tok/s | decode 45.6 tok/s" in err and "TPOT 21.9 ms" in err


def test_run_flags_reach_the_session(fake_session, capsys):
    argv = [
        "run", "-m", fake_session, "-p", "p", "-n", "7", "-t", "2", "-c", "128", "--temp", "0",
        "--top-k", "5", "--top-p", "0.5", "--min-p", "0.1", "--repeat-penalty", "1.3",
        "--repeat-last-n", "16", "--seed", "42", "--ignore-eos",
    ]  # fmt: skip
    code, _, _ = run_main(argv, capsys)
    assert code == 0
    (s,) = RecordingSession.instances
    assert (s.threads, s.n_ctx) == (2, 128)
    ((_, kwargs),) = s.generate_calls
    assert kwargs == {
        "max_tokens": 7,
        "temperature": 0.0,
        "top_k": 5,
        "top_p": 0.5,
        "min_p": 0.1,
        "repeat_penalty": 1.3,
        "repeat_last_n": 16,
        "seed": 42,
        "stop_at_eos": False,
    }


def test_run_reads_prompt_file(fake_session, capsys, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("line one\nZürich ☃\n", encoding="utf-8")
    code, _, _ = run_main(["run", "-m", fake_session, "-f", str(prompt)], capsys)
    assert code == 0
    assert RecordingSession.instances[0].generate_calls[0][0] == "line one\nZürich ☃\n"


def test_run_chat_applies_the_template(fake_session, capsys):
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    chars = sorted(set("<|im_start|>user\nhiassant"))
    tokens = chars + ["<|im_start|>", "<|im_end|>"]
    RecordingSession.tokenizer = Tokenizer.from_metadata(
        {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": "gpt-2",
            "tokenizer.ggml.tokens": [c if c != "\n" else "Ċ" for c in chars] + tokens[len(chars) :],
            "tokenizer.ggml.token_type": [1] * len(chars) + [3, 3],
            "tokenizer.ggml.merges": [],
            "tokenizer.chat_template": template,
        }
    )
    code, _, err = run_main(["run", "-m", fake_session, "-p", "hi", "--chat"], capsys)
    assert code == 0, err
    prompt_ids = RecordingSession.instances[0].generate_calls[0][0]
    start, end = len(chars), len(chars) + 1
    ids = {c: i for i, c in enumerate(chars)}
    expected = (
        [start] + [ids[c] for c in "user\nhi"] + [end, ids["\n"], start] + [ids[c] for c in "assistant\n"]
    )
    assert prompt_ids == expected


def test_engine_errors_become_one_line(fake_session, capsys, monkeypatch):
    def broken(*args, **kwargs):
        raise sharpi.FormatError("[gguf] model.gguf: bad magic 0x00000000")

    monkeypatch.setattr(sharpi, "Session", broken)
    code, out, err = run_main(["run", "-m", fake_session, "-p", "x"], capsys)
    assert code == 1 and out == ""
    assert err == "sharpi: error: [gguf] model.gguf: bad magic 0x00000000\n"


def test_error_mid_stream_keeps_the_text_already_written(fake_session, capsys):
    RecordingSession.fail_in_generate = sharpi.ContextOverflowError("context full: 4096 tokens")
    code, out, err = run_main(["run", "-m", fake_session, "-p", "x"], capsys)
    assert code == 1
    assert out == "Hel"
    assert err == "sharpi: error: context full: 4096 tokens\n"


def test_missing_files_are_clean_errors(fake_session, capsys, tmp_path):
    missing = str(tmp_path / "nope.gguf")
    code, _, err = run_main(["run", "-m", missing, "-p", "x"], capsys)
    assert (code, err) == (1, f"sharpi: error: {missing}: no such file\n")
    code, _, err = run_main(["run", "-m", fake_session, "-f", missing], capsys)
    assert (code, err) == (1, f"sharpi: error: {missing}: no such file\n")
    code, _, err = run_main(["run", "-m", str(tmp_path), "-p", "x"], capsys)
    assert code == 1 and "is a directory" in err
    code, _, err = run_main(["inspect", missing], capsys)
    assert (code, err) == (1, f"sharpi: error: {missing}: no such file\n")
    assert RecordingSession.instances == []


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["frobnicate"],
        ["run", "-m", "m.gguf", "--temp", "warm"],
        ["run", "-m", "m.gguf", "-n", "-5"],
        ["run", "-m", "m.gguf", "--no-such-flag"],
        ["run", "-m", "m.gguf", "-p", "x", "-f", "y"],  # one prompt source
        ["make-model", "--preset", "tiny"],  # OUT is required
        ["inspect", "a.gguf", "-hf", "org/repo"],  # one model source
    ],
)
def test_usage_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert "usage: sharpi" in capsys.readouterr().err


def test_help_and_version(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0 and sharpi.__version__ in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        cli.main(["run", "--help"])
    help_text = capsys.readouterr().out
    assert exc.value.code == 0
    for flag in ("--model", "--n-predict", "--threads", "--ctx-size", "--temp", "--top-k", "--top-p", "--min-p",
                 "--repeat-penalty", "--seed", "--ignore-eos"):  # fmt: skip
        assert flag in help_text


def test_inspect_and_make_model_call_their_modules(monkeypatch, capsys, tmp_path):
    calls = {}
    inspect_mod = types.ModuleType("sharpi.inspect_model")

    def inspect_report(path):
        calls["inspect"] = path
        return f"report for {path}"

    inspect_mod.inspect_report = inspect_report
    make_mod = types.ModuleType("sharpi.make_model")

    def write_model(out, **kwargs):
        calls["make"] = (out, kwargs)
        with open(out, "wb") as f:
            f.write(b"\0" * 3 * 2**20)

    make_mod.write_model = write_model
    from sharpi.make_model import parse_overrides

    make_mod.parse_overrides = parse_overrides  # the real parser: --set is typed by HParams
    monkeypatch.setitem(sys.modules, "sharpi.inspect_model", inspect_mod)
    monkeypatch.setitem(sys.modules, "sharpi.make_model", make_mod)

    model = tmp_path / "m.gguf"
    model.write_bytes(b"x")
    code, out, _ = run_main(["inspect", str(model)], capsys)
    assert (code, out, calls["inspect"]) == (0, f"report for {model}\n", str(model))
    # No FILE: the shipped model, as run, chat and serve default to.
    shipped = os.path.join(os.path.dirname(sharpi.__file__), "models", "stdlib-moe-q8_0.gguf")
    code, out, _ = run_main(["inspect"], capsys)
    assert (code, out, calls["inspect"]) == (0, f"report for {shipped}\n", shipped)

    out_path = str(tmp_path / "out.gguf")
    code, out, _ = run_main(["make-model", "--preset", "tiny", out_path], capsys)
    # Only what the user gave, and the bar of the bytes written (drawn on a terminal only).
    assert code == 0 and calls["make"] == (out_path, {"preset": "tiny", "progress_bar": True})
    assert out == f"sharpi: wrote {out_path} (3.0 MiB)\n"
    argv = ["make-model", "--arch", "olmoe", "--preset", "tiny", "--quant", "q4_0", "--seed", "3", out_path]
    run_main(argv, capsys)
    assert calls["make"] == (out_path, {"arch": "olmoe", "preset": "tiny", "quant": "q4_0", "seed": 3,
                                        "progress_bar": True})
    # --set overrides a preset's hyper-parameters (typed by the field), --pure keeps one base type.
    run_main(["make-model", "--preset", "glm-4.5-air", "--set", "n_layer=4", "--set", "expert_weights_scale=2.5",
              "--pure", out_path], capsys)
    assert calls["make"] == (out_path, {"preset": "glm-4.5-air", "pure": True, "progress_bar": True, "n_layer": 4,
                                        "expert_weights_scale": 2.5})
    code, _, err = run_main(["make-model", "--set", "n_layers=4", out_path], capsys)
    assert code != 0 and "--set expects FIELD=VALUE" in err and "n_layer" in err


def test_missing_optional_module_is_a_clean_error(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "sharpi.make_model", None)  # makes the import fail
    code, _, err = run_main(["make-model", "--preset", "tiny", str(tmp_path / "o.gguf")], capsys)
    assert code == 1 and err.startswith("sharpi: error: 'make-model' is not available")


# ------------------------------------------------------------------------------------------ end to end

HAVE_ENGINE = importlib.util.find_spec("sharpi.make_model") is not None and hasattr(sharpi, "Session")
needs_engine = pytest.mark.skipif(
    not HAVE_ENGINE, reason="sharpi.make_model / sharpi.Session not installed yet"
)


def sharpi_cli(*args, timeout=300):
    """Run `python -m sharpi.cli ARGS` against the same sharpi package this test imported."""
    env = child_env()
    return subprocess.run(
        [sys.executable, "-m", "sharpi.cli", *args],
        check=False,
        capture_output=True,
        text=True,
        encoding="utf-8",
        env=env,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    if not HAVE_ENGINE:
        pytest.skip("sharpi.make_model / sharpi.Session not installed yet")
    path = str(tmp_path_factory.mktemp("cli") / "tiny.gguf")
    r = sharpi_cli("make-model", "--preset", "tiny", "--seed", "5", path)
    assert r.returncode == 0, r.stderr
    assert os.path.getsize(path) > 0
    return path


def greedy_reference(path, prompt, n):
    """Greedy generation written against Session.decode and numpy argmax (not the C++ sampler)."""
    s = sharpi.Session(path, threads=1)
    tok = s.tokenizer
    ids = tok.encode(prompt)
    logits = s.decode(ids)
    generated = []
    for _ in range(n):
        t = int(np.argmax(logits))
        if tok.is_eog(t):
            break
        generated.append(t)
        if len(generated) == n:
            break
        logits = s.decode([t])
    return tok.decode(generated)


TIMING = re.compile(
    r"^sharpi: prompt (\d+) tokens, generated (\d+) tokens \| prefill [\d.]+ tok/s \| decode [\d.]+ tok/s \| "
    r"TTFT [\d.]+ ms \| TPOT [\d.]+ ms$",
    re.MULTILINE,
)


@needs_engine
def test_run_greedy_matches_reference_loop(tiny_model):
    r = sharpi_cli("run", "-m", tiny_model, "-p", "Hello world", "-n", "12", "--temp", "0", "-t", "1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.endswith("\n")
    assert r.stdout[:-1] == greedy_reference(tiny_model, "Hello world", 12)
    m = TIMING.search(r.stderr)
    assert m, r.stderr
    assert int(m.group(1)) == len(sharpi.Session(tiny_model).tokenize("Hello world"))
    assert "Traceback" not in r.stderr


@needs_engine
def test_run_same_seed_same_text(tiny_model):
    args = (
        "run",
        "-m",
        tiny_model,
        "-p",
        "Once",
        "-n",
        "10",
        "--temp",
        "1.5",
        "--top-k",
        "0",
        "--ignore-eos",
    )
    a = sharpi_cli(*args, "--seed", "7")
    b = sharpi_cli(*args, "--seed", "7")
    assert a.returncode == b.returncode == 0, a.stderr + b.stderr
    assert a.stdout == b.stdout
    assert int(TIMING.search(a.stderr).group(2)) == 10  # --ignore-eos: exactly -n tokens


@needs_engine
@pytest.mark.skipif(
    importlib.util.find_spec("sharpi.inspect_model") is None, reason="sharpi.inspect_model not installed yet"
)
def test_inspect_tiny_model(tiny_model):
    r = sharpi_cli("inspect", tiny_model)
    assert r.returncode == 0, r.stderr
    arch = sharpi.Session(tiny_model).info["arch"]
    assert arch in r.stdout


@needs_engine
def test_bad_files_and_values_exit_1_without_traceback(tiny_model, tmp_path):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    cases = [
        ("run", "-m", str(tmp_path / "missing.gguf"), "-p", "x"),
        ("run", "-m", str(garbage), "-p", "x"),
        *([("inspect", str(garbage))] if importlib.util.find_spec("sharpi.inspect_model") else []),
        ("run", "-m", tiny_model, "-p", "x", "--top-p", "0"),  # InvalidArgument from the sampler
        ("run", "-m", tiny_model, "-p", "a b c d e f g h i j k l m n o p", "-c", "4"),  # context overflow
    ]
    for args in cases:
        r = sharpi_cli(*args)
        assert r.returncode == 1, (args, r.stdout, r.stderr)
        assert r.stderr.startswith("sharpi: error: "), (args, r.stderr)
        assert "Traceback" not in r.stderr, (args, r.stderr)
    r = sharpi_cli("run", "-m", tiny_model, "--bogus")
    assert r.returncode == 2 and "usage: sharpi" in r.stderr


def test_run_passes_streaming_options(fake_session, capsys):
    code, _, _ = run_main(
        ["run", "-m", fake_session, "-p", "x", "--ram-budget", "6GiB", "--reader", "pread",
         "--slru-probation", "0.4", "--route-trace", "t.npz", "--predictor", "cooc:p.gguf", "--lookahead", "3",
         "--prefetch-sizing", "bytes",
         "--trace", "out", "--cache-policy", "prior:prior.gguf", "-ctk", "q8_0", "--cache-type-v", "f16",
         "--allow-long-context", "--device", "cuda", "--vram-budget", "12GiB", "--miss-route", "auto"],
        capsys,
    )
    assert code == 0
    (s,) = RecordingSession.instances
    assert s.streaming == {"ram_budget": "6GiB", "vram_budget": "12GiB", "miss_route": "auto", "slru_probation": 0.4,
                           "reader": "pread",
                           "route_trace": "t.npz",
                           "predictor": "cooc:p.gguf", "lookahead": 3, "prefetch_sizing": "bytes", "trace": "out",
                           "cache_policy": "prior:prior.gguf", "cache_type_k": "q8_0", "cache_type_v": "f16",
                           "allow_long_context": True, "device": "cuda"}


def test_run_without_model_uses_the_shipped_model():
    # The README's first command after `pip install .`: no -m, the shipped trained model answers.
    from sharpi.models import default_model_path

    cmd = [sys.executable, "-m", "sharpi.cli", "run", "-p", "def ", "-n", "24", "--temp", "0", "-t", "2"]
    default = subprocess.run(cmd, check=True, capture_output=True, text=True)
    explicit = subprocess.run(cmd + ["-m", default_model_path()], check=True, capture_output=True, text=True)
    assert default.stdout == explicit.stdout
    assert len(default.stdout.strip()) > 10
    assert "decode" in default.stderr


def test_make_model_help_lists_every_arch_preset_and_quant(capsys):
    from sharpi import presets
    from sharpi.tensor_plan import QUANTS

    with pytest.raises(SystemExit) as exc:
        cli.main(["make-model", "--help"])
    assert exc.value.code == 0
    # argparse wraps at hyphens ("mixtral-\n   trace"): join those back, then collapse whitespace.
    text = " ".join(re.sub(r"-\n\s*", "-", capsys.readouterr().out).split())
    listed = {flag: set(m.split(", ")) for flag, m in re.findall(r"--(arch|preset|quant) [A-Z]+ .*? one of: (.*?) \(", text)}
    assert listed == {"arch": set(presets.ARCHES), "preset": set(presets.PRESETS), "quant": set(QUANTS)}
    # and an unknown name is a usage error naming the flag
    with pytest.raises(SystemExit) as exc:
        cli.main(["make-model", "--quant", "q9_9", "out.gguf"])
    assert exc.value.code == 2 and "--quant" in capsys.readouterr().err
