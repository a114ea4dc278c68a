"""The `sharpi` command: run, inspect and make-model here; bench, trace, predictor, serve and chat
registered from their own modules (sharpi.bench, sharpi.harvest, sharpi.predict.cli, sharpi.server,
sharpi.chat).

What it owns: argument parsing, streaming generated text to stdout, the timing line on stderr,
and turning sharpi's typed errors into one clean line ("sharpi: error: ...") and exit status 1.
It never computes anything itself: generation goes through sharpi.Session, inspection through
sharpi.inspect_model.inspect_report, model writing through sharpi.make_model.write_model.

Flags follow llama.cpp's names and meanings where llama.cpp has the option (-m, -hf, -p, -f,
-n/--predict with -1 = until end of generation, -t, -c, -s, --temp, --top-k, --top-p, --min-p, the
repeat/presence/frequency penalties, -l/--logit-bias, -e/--no-escape, -r/--reverse-prompt, -sys,
--chat-template-file, -v). The llama.cpp flags sharpi cannot honour (-ngl N > 0, --no-mmap, --mlock,
--grammar, -cnv/-i in `run`) end with exit status 2 and a message that names the flag and says what
sharpi does instead; harmless ones (-fa, -b, -ub, --jinja, -no-cnv) are accepted and their --help
says so (sharpi.cli_args holds them, for every command that runs a model). No parser takes
abbreviations (build_parser turns them off everywhere), so --predict never means --predictor.
Option types shared with the other commands are sharpi.cli_args'; the cache counters and their
ratios are sharpi.metrics'. Imports point one way: this module imports the subcommand modules,
never the reverse.

Exit status: 0 on success, 1 for an error sharpi reports (bad file, bad value, I/O), 2 for bad
command-line usage (argparse's convention), 130 when interrupted.
"""

from __future__ import annotations

import argparse
import os
import string
import sys
from typing import TextIO

from . import metrics
from .cli_args import (
    Refused,
    add_compute_arguments,
    add_hf_argument,
    add_llama_compat_arguments,
    add_sampling_arguments,
    add_speculative_arguments,
    add_streaming_arguments,
    model_from_hub,
    non_negative_int,
    sampling_options,
    session_options,
    speculation_from_args,
    speculative_session_options,
)
from .stop_text import StopText


def _user_errors() -> tuple:
    """Errors that come from the user's input or environment, not from a bug: one line, no traceback."""
    from . import _core
    from .hub import HubError

    return (_core.SharpiError, OSError, HubError)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="sharpi",
        description="Run Mixture-of-Experts LLMs from GGUF files.",
    )
    parser.add_argument("--version", action="version", version=f"sharpi {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    run = sub.add_parser(
        "run",
        help="generate text from a prompt",
        description="Generate text from a prompt, streaming it to stdout; timing goes to stderr.",
    )
    model_src = run.add_mutually_exclusive_group()
    model_src.add_argument(
        "-m",
        "--model",
        default=None,
        metavar="FILE",
        help="GGUF model file, or any shard of a split one (default: the shipped stdlib-moe model, see "
        "sharpi/models/MODEL_CARD.md)",
    )
    add_hf_argument(model_src)
    src = run.add_mutually_exclusive_group()
    src.add_argument("-p", "--prompt", default=None,
                     help="prompt text; escapes \\n \\r \\t \\' \\\" \\\\ \\xNN are processed, as in llama.cpp "
                     "(--no-escape: verbatim)")
    src.add_argument("-f", "--file", default=None, metavar="FILE",
                     help="read the prompt from FILE, verbatim unless -e is given (llama.cpp would process "
                     "escapes in it too, which rewrites \\n inside code)")
    run.add_argument("-e", "--escape", action="store_true", default=None,
                     help="process escapes in -p, -r and --stop (the default) and in the -f file")
    run.add_argument("--no-escape", dest="escape", action="store_false", help="take -p, -r and --stop verbatim")
    add_sampling_arguments(run, n_predict_default=64)
    run.add_argument("-r", "--reverse-prompt", action="append", default=[], metavar="TEXT",
                     help="stop once the generated text contains TEXT, which is printed (llama-cli's halt; "
                     "repeatable)")
    run.add_argument("--stop", action="append", default=[], metavar="TEXT",
                     help="stop before the generated text would contain TEXT, which is not printed (the API's "
                     "stop; repeatable)")
    add_compute_arguments(run)
    run.add_argument(
        "--chat",
        action="store_true",
        help="wrap the prompt as one user message in the model's chat template",
    )
    run.add_argument("-sys", "--system-prompt", default=None, metavar="TEXT",
                     help="system message before the prompt in the chat template (implies --chat)")
    run.add_argument("--chat-template-file", default=None, metavar="FILE",
                     help="Jinja chat template to render the prompt with (implies --chat; default: the model's own)")
    run.add_argument("-v", "--verbose", "--log-verbose", "--verbose-prompt", dest="verbose", action="store_true",
                     help="also print the model, the sampling settings and the prompt's token ids to stderr")
    llama = add_llama_compat_arguments(run)
    llama.add_argument("-no-cnv", "--no-conversation", "-st", "--single-turn", dest="no_conversation",
                       action="store_true", help="accepted: `sharpi run` always answers one prompt")
    llama.add_argument("--no-display-prompt", action="store_true",
                       help="accepted: `sharpi run` prints only the generated text")
    chat_instead = ("`sharpi run` answers one prompt and exits; for a conversation run `sharpi chat` "
                    "(the same -m, sampling flags and -sys)")
    llama.add_argument("-cnv", "--conversation", "-i", "--interactive", "-if", "--interactive-first",
                       action=Refused, why=chat_instead, help="refused: use `sharpi chat`")
    add_streaming_arguments(run)
    add_speculative_arguments(run)
    run.add_argument(
        "--expert-stats", default=None, metavar="FILE", help="write per-layer/per-expert cache stats as JSON"
    )

    inspect = sub.add_parser(
        "inspect",
        help="describe a GGUF file",
        description="Architecture, tensors, quant mix and expert vs dense bytes of a GGUF file, and the CUDA "
        "device here (or that there is none).",
    )
    inspect_src = inspect.add_mutually_exclusive_group()
    inspect_src.add_argument("model", metavar="FILE", nargs="?",
                             help="GGUF model file, or any shard of a split one (default: the shipped stdlib-moe "
                             "model, as in run, chat and serve)")
    add_hf_argument(inspect_src)
    inspect.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                         help="cuda: also report what the device forward pass would place in VRAM (the device "
                              "itself, its VRAM total, used and free, is always reported)")
    inspect.add_argument("--plan", action="store_true",
                         help="print the tier plan of a GPU session: what VRAM pins and slots, what RAM holds, "
                              "what stays on disk (needs --vram-budget, or a device for its default auto)")
    inspect.add_argument("--vram-budget", default=None, metavar="SIZE",
                         help="with --plan: VRAM for the session, e.g. 12GiB, or auto (free VRAM minus a margin; "
                              "the default)")
    inspect.add_argument("--ram-budget", default=None, metavar="SIZE",
                         help="with --plan: RAM for experts VRAM does not hold, e.g. 24GiB or auto (default: all)")
    inspect.add_argument("-c", "--ctx-size", type=non_negative_int("-c"), default=0, metavar="N",
                         help="with --plan: context length (default: the model's, at most 4096)")
    inspect.add_argument("--lookahead", type=int, choices=[0, 1, 2, 3], default=0,
                         help="with --plan: predictor lookahead; lookahead x top-k VRAM staging slots (default 0)")
    inspect.add_argument("--cache-prior", default=None, metavar="FILE",
                         help="with --plan: a cache prior (`sharpi cache-prior`); its hottest experts are pinned")

    make = sub.add_parser(
        "make-model",
        help="write a synthetic model",
        description="Write a synthetic GGUF model (random weights, working tokenizer).",
    )
    # The lists come from the tables make_model itself reads, so --help cannot miss one.
    from . import presets
    from .tensor_plan import QUANTS

    make.add_argument("--arch", default=None, choices=presets.ARCHES, metavar="ARCH",
                      help=f"architecture, one of: {', '.join(presets.ARCHES)} (default: the preset's)")
    make.add_argument("--preset", default=None, choices=list(presets.PRESETS), metavar="PRESET",
                      help=f"size preset, one of: {', '.join(presets.PRESETS)} (default: tiny)")
    make.add_argument("--quant", default=None, choices=list(QUANTS), metavar="QUANT",
                      help=f"quantization, one of: {', '.join(QUANTS)} (default: f32)")
    make.add_argument("--seed", type=int, default=None, help="weight seed")
    make.add_argument("--fim", action="store_true", default=None,
                      help="add fill-in-the-middle tokens (<|fim_prefix|> <|fim_suffix|> <|fim_middle|>) to the vocabulary")
    make.add_argument("--pure", action="store_true", default=None,
                      help="every weight matrix in the quant's base type (no per-tensor mix)")
    make.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                      help="override a preset hyper-parameter, e.g. --set n_layer=4 (repeatable; "
                           "tuples comma-separated: --set compress_ratios=0,4,4,128)")
    make.add_argument("out", metavar="OUT", help="output GGUF path")

    from . import bench

    bench.add_arguments(
        sub.add_parser(
            "bench",
            help="benchmark expert streaming under RAM budgets",
            description="Decode speed of expert streaming under RAM budgets vs Belady's IO lower bound.",
        )
    )
    from . import harvest

    harvest.add_trace_parser(sub)
    from .predict.cli import add_predictor_parser

    add_predictor_parser(sub)
    from . import cache_eval

    cache_eval.add_parsers(sub)
    from .server.cli import add_serve_parser

    add_serve_parser(sub)
    from .chat import add_chat_parser

    add_chat_parser(sub)
    _no_abbreviations(parser)
    return parser


def _no_abbreviations(parser: argparse.ArgumentParser) -> None:
    """allow_abbrev=False on `parser` and every subcommand parser below it: an abbreviation would
    turn llama.cpp's --predict into sharpi's --predictor, or any flag a later version adds into
    another one silently. Set here, once, so no subcommand module can forget it."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in set(action.choices.values()):
                _no_abbreviations(child)


def _require_file(path: str) -> None:
    # Checked here so a typo gets a one-line answer whatever the engine would have said.
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file")
    if os.path.isdir(path):
        raise IsADirectoryError(f"{path}: is a directory, not a GGUF file")


def _read_prompt(args) -> str:
    if args.file is not None:
        _require_file(args.file)
        with open(args.file, encoding="utf-8") as f:
            return f.read()
    return args.prompt if args.prompt is not None else ""


def format_timing(stats: dict) -> str:
    """One line from Session.last_stats: prompt size, prefill and decode speed, TTFT, TPOT.

    Uses the session's own rates when it reports them; otherwise derives them the usual way:
    decode runs n_generated - 1 steps (the first token comes from the prefill), TPOT is the time
    per decode step.
    """
    n_prompt = int(stats.get("n_prompt", 0))
    n_gen = int(stats.get("n_generated", 0))
    prefill_s = float(stats.get("prefill_s", 0.0))
    decode_s = float(stats.get("decode_s", 0.0))
    ttft_s = float(stats.get("ttft_s", prefill_s))
    steps = max(n_gen - 1, 0)
    prefill_rate = stats.get("prefill_tok_s", n_prompt / prefill_s if prefill_s > 0 else 0.0)
    decode_rate = stats.get("decode_tok_s", steps / decode_s if decode_s > 0 and steps else 0.0)
    tpot_s = stats.get("tpot_s", decode_s / steps if steps else 0.0)
    return (
        f"sharpi: prompt {n_prompt} tokens, generated {n_gen} tokens | "
        f"prefill {prefill_rate:.1f} tok/s | decode {decode_rate:.1f} tok/s | "
        f"TTFT {ttft_s * 1e3:.1f} ms | TPOT {tpot_s * 1e3:.1f} ms"
    ) + (f" | draft accepted {stats['spec_accepted']}/{stats['spec_drafted']} "
         f"({100 * stats['spec_acceptance']:.0f}%) in {stats['spec_steps']} verify steps"
         if stats.get("spec_steps") else "")


def process_escapes(text: str) -> str:
    """llama.cpp's string_process_escapes: \\n \\r \\t \\' \\" \\\\ and \\xNN (one byte: \\xc3\\xa9 is "é");
    a backslash before anything else, or at the end, stays as written. Works on the UTF-8 bytes, as
    llama.cpp does; bytes that end up not being UTF-8 become U+FFFD."""
    simple = {ord("n"): b"\n", ord("r"): b"\r", ord("t"): b"\t", ord("'"): b"'", ord('"'): b'"', ord("\\"): b"\\"}
    data = text.encode("utf-8", "surrogateescape")
    out = bytearray()
    i = 0
    while i < len(data):
        if data[i] != ord("\\") or i + 1 == len(data):
            out.append(data[i])
            i += 1
            continue
        code = data[i + 1]
        digits = data[i + 2 : i + 4]
        if code in simple:
            out += simple[code]
        elif code == ord("x") and len(digits) == 2 and all(chr(d) in string.hexdigits for d in digits):
            out.append(int(digits, 16))
            i += 2
        else:
            out += data[i : i + 2]
        i += 2
    return out.decode("utf-8", "replace")


def cmd_run(args, out: TextIO, err: TextIO) -> int:
    from .progress import open_session

    model_from_hub(args, err)
    if args.model is None:
        from .models import default_model_path

        args.model = default_model_path()
    _require_file(args.model)
    prompt = _read_prompt(args)
    # llama.cpp processes escapes by default; sharpi does too, except in a -f file (only with -e).
    escape = args.escape is not False
    if args.escape or (escape and args.file is None):
        prompt = process_escapes(prompt)
    stop_text = StopText([process_escapes(s) if escape else s for s in args.stop],
                         [process_escapes(r) if escape else r for r in args.reverse_prompt])
    template = None
    if args.chat_template_file is not None:
        _require_file(args.chat_template_file)
        with open(args.chat_template_file, encoding="utf-8") as f:
            template = f.read()
    session = open_session(args.model, **session_options(args), **speculative_session_options(args))
    auto_budget = getattr(session, "auto_budget", None)
    if auto_budget is not None:
        print(f"sharpi: {auto_budget.describe()}", file=err)
    if args.chat or args.system_prompt is not None or template is not None:
        from .server.prompt import encode_chat

        messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt is not None else []
        messages.append({"role": "user", "content": prompt})
        prompt_input = encode_chat(session.tokenizer, messages, template=template)
    else:
        prompt_input = prompt
    options = sampling_options(args)
    speculation = speculation_from_args(session, args)
    if speculation is not None:
        options["speculative"] = speculation
    if args.verbose:
        if isinstance(prompt_input, str):
            prompt_input = session.tokenize(prompt_input)  # what generate() would do; now shown
        _print_verbose(args.model, session.info, options, prompt_input, err)
    pieces = session.generate(prompt_input, **options)
    try:
        for piece in pieces:
            text, stop = stop_text.push(piece)
            out.write(text)
            out.flush()
            if stop:
                break
        else:
            out.write(stop_text.flush())
    finally:
        pieces.close()  # a cut: stop generating (the session's stats still count what was generated)
    out.write("\n")
    out.flush()
    err.write(format_timing(getattr(session, "last_stats", {}) or {}) + "\n")
    stats = session.expert_stats()
    if stats["layers"]:
        err.write(format_expert_stats(stats) + "\n")
    if args.expert_stats:
        write_expert_stats(args.expert_stats, stats)
    session.close()
    return 0


def _print_verbose(path: str, info: dict, options: dict, prompt_ids: list, err: TextIO) -> None:
    """-v: the model, the sampling settings and the prompt's token ids (for -l/--logit-bias)."""
    err.write(f"sharpi: model {path}: {info['arch']}, {info['n_layer']} layers, {info['n_expert']} experts "
              f"({info['n_expert_used']} used), n_ctx {info['n_ctx']}, n_vocab {info['n_vocab']}\n")
    err.write("sharpi: sampling: " + ", ".join(f"{k}={v}" for k, v in options.items()) + "\n")
    err.write(f"sharpi: prompt {len(prompt_ids)} tokens: {' '.join(str(int(t)) for t in prompt_ids)}\n")


def format_expert_stats(stats: dict) -> str:
    """One line summarising the expert cache of a streamed run."""
    total = metrics.sum_layers(stats["layers"], metrics.CACHE_COUNTERS)
    acc, hits = total["accesses"], total["hits"]
    rate = metrics.hit_rate(hits, acc) or 0.0
    return (
        f"sharpi: experts {stats['n_slots']} slots x {stats['slot_bytes'] / 2**20:.2f} MiB ({stats['reader_detail']}) | "
        f"hit rate {rate:.3f} ({hits}/{acc}) | read {total['bytes_read'] / 2**20:.1f} MiB | "
        f"evictions {total['evictions']} | stall {total['stall_ms']:.1f} ms"
    )


def write_expert_stats(path: str, stats: dict) -> None:
    """JSON with per-layer counters and, per layer, per-expert accesses and misses."""
    import json

    layers = stats["layers"]
    n_layer = len(layers)
    acc = stats["expert_accesses"].reshape(n_layer, -1) if n_layer else []
    mis = stats["expert_misses"].reshape(n_layer, -1) if n_layer else []
    doc = {k: stats[k] for k in metrics.CACHE_PLAN}
    doc["layers"] = []
    for il, lay in enumerate(layers):
        entry = dict(lay)
        entry["hit_rate"] = metrics.hit_rate(lay["hits"], lay["accesses"])
        entry["expert_accesses"] = [int(x) for x in acc[il]]
        entry["expert_misses"] = [int(x) for x in mis[il]]
        doc["layers"].append(entry)
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=1)


def cmd_inspect(args, out: TextIO, err: TextIO) -> int:
    model_from_hub(args, err)
    if args.model is None:
        from .models import default_model_path

        args.model = default_model_path()
    _require_file(args.model)
    from .inspect_model import inspect_report

    report = inspect_report(args.model)
    out.write(report if report.endswith("\n") else report + "\n")
    if args.device == "cuda":  # the report's "device:" line already names the device, or says there is none
        out.write(f"device plan: {_device_plan_line(args.model)}\n")
    if args.plan:
        from .tier_plan import plan, plan_report

        out.write(plan_report(plan(args.model, args.vram_budget or "auto", args.ram_budget, n_ctx=args.ctx_size,
                                   lookahead=args.lookahead, cache_prior=args.cache_prior)))
    return 0


def _device_plan_line(path: str) -> str:
    """What Session(path, device="cuda") would put in VRAM at the default n_ctx, or why it refuses
    (the planner runs on the host: no device needed)."""
    from ._core import UnsupportedError
    from ._internal import cuda_device_plan

    try:
        p = cuda_device_plan(path)
    except UnsupportedError as e:
        return f"refused: {e}"
    mib = 1 << 20
    return (f"dense weights {p['dense_bytes'] / mib:.1f} MiB + experts {p['expert_bytes'] / mib:.1f} MiB"
            f" + KV cache {p['kv_bytes'] / mib:.1f} MiB (n_ctx {p['n_ctx']}, f32)"
            f" + buffers {p['buffer_bytes'] / mib:.1f} MiB = {p['total_bytes'] / mib:.1f} MiB")


def cmd_make_model(args, out: TextIO, err: TextIO) -> int:
    from .make_model import parse_overrides, write_model

    # Only what the user gave: write_model's own defaults apply to the rest.
    options = {
        k: getattr(args, k)
        for k in ("arch", "preset", "quant", "seed", "fim", "pure")
        if getattr(args, k) is not None
    }
    write_model(args.out, progress_bar=True, **options, **parse_overrides(args.set))
    size = os.path.getsize(args.out)
    out.write(f"sharpi: wrote {args.out} ({size / 2**20:.1f} MiB)\n")
    return 0


def cmd_bench(args, out: TextIO, err: TextIO) -> int:
    from . import bench

    return bench.run(args)


def cmd_trace(args, out: TextIO, err: TextIO) -> int:
    from . import harvest

    return harvest.run_trace_command(args)


def cmd_predictor(args, out: TextIO, err: TextIO) -> int:
    from .predict.cli import run_predictor_command

    return run_predictor_command(args, out)


def cmd_cache_eval(args, out: TextIO, err: TextIO) -> int:
    from .cache_eval import cmd_cache_eval

    return cmd_cache_eval(args, out)


def cmd_serve(args, out: TextIO, err: TextIO) -> int:
    from .server.cli import cmd_serve as serve

    return serve(args, out, err)


def cmd_chat(args, out: TextIO, err: TextIO) -> int:
    from .chat import cmd_chat as chat

    return chat(args, sys.stdin, out, err)


def cmd_cache_prior(args, out: TextIO, err: TextIO) -> int:
    from .cache_eval import cmd_cache_prior

    return cmd_cache_prior(args, out)


_COMMANDS = {"run": cmd_run, "inspect": cmd_inspect, "make-model": cmd_make_model, "bench": cmd_bench,
             "trace": cmd_trace, "predictor": cmd_predictor, "cache-eval": cmd_cache_eval,
             "cache-prior": cmd_cache_prior, "serve": cmd_serve,
             "chat": cmd_chat}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `sharpi` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)  # exits with status 2 on bad usage
    out, err = sys.stdout, sys.stderr
    # Generated text can be any Unicode; a non-UTF-8 terminal gets replacement characters, not a crash.
    for stream in (out, err):
        if hasattr(stream, "reconfigure"):
            try:
                stream.reconfigure(errors="replace")
            except (AttributeError, ValueError, OSError):
                pass
    try:
        return _COMMANDS[args.command](args, out, err)
    except BrokenPipeError:
        # The reader went away (`sharpi run ... | head`): stop quietly; point stdout at /dev/null so
        # the interpreter's final flush does not raise again. (Before OSError: it is one.)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except _user_errors() as e:
        out.flush()
        err.write(f"sharpi: error: {e}\n")
        return 1
    except ImportError as e:
        # inspect / make-model live in optional modules; a build without them answers cleanly.
        err.write(f"sharpi: error: '{args.command}' is not available in this installation ({e})\n")
        return 1
    except KeyboardInterrupt:
        err.write("\nsharpi: interrupted\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
