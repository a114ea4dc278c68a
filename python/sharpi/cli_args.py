"""Argparse helpers shared by the `sharpi` subcommands: typed integer options, the compute options,
the sampling options and llama.cpp's flags.

What it owns: argparse `type=` callables whose error messages name the option, -hf and its
resolution to a local file, the -t/-c pair every command that runs a Session takes, the sampling flags of `run` and `chat` (and `serve`'s
defaults) with sampling_options() turning them into Session.generate keywords, and the llama-cli /
llama-server flags sharpi either takes with llama.cpp's meaning or refuses with exit status 2 and
a message that names the flag and says what sharpi does instead (add_llama_compat_arguments).
It imports nothing from sharpi at import time, so any command module (sharpi.cli, sharpi.harvest,
sharpi.predict.cli, sharpi.bench) can use it without an import loop: sharpi.cli registers the
subcommands, the subcommand modules never import sharpi.cli.
"""

from __future__ import annotations

import argparse
import math
import os


def int_at_least(name: str, minimum: int):
    """An argparse type: an integer >= minimum, with a message naming the option."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{name} must be >= {minimum}, got {value}")
        return value

    return parse


def non_negative_int(name: str):
    """An argparse type: an integer >= 0 (0 usually means "the default")."""
    return int_at_least(name, 0)


def positive_int(name: str):
    """An argparse type: an integer > 0 ("{name} must be > 0" when it is not)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{name} must be > 0, got {value}")
        return value

    return parse


KV_CACHE_TYPES = ("f32", "f16", "q8_0", "q4_0")


def add_compute_arguments(p: argparse.ArgumentParser) -> None:
    """-t/--threads, -c/--ctx-size, --allow-long-context, --device and --cache-type-k/-v, shared by the commands
    that run a Session (pass them on with session_kv_options(args))."""
    p.add_argument(
        "-t",
        "--threads",
        type=non_negative_int("-t"),
        default=0,
        metavar="N",
        help="compute threads (default: 0 = one per core)",
    )
    p.add_argument(
        "-c",
        "--ctx-size",
        type=non_negative_int("-c"),
        default=0,
        metavar="N",
        help="context size in tokens (default: 0 = the model's, at most 4096)",
    )
    p.add_argument(
        "--allow-long-context",
        action="store_true",
        help="accept -c beyond the model's trained context (refused otherwise; llama.cpp only warns)",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the forward pass runs (cuda: the CUDA backend; a typed error when it cannot)",
    )
    for which in ("k", "v"):
        p.add_argument(
            f"-ct{which}",
            f"--cache-type-{which}",
            choices=KV_CACHE_TYPES,
            default=None,
            help=f"KV cache type for {which.upper()} (default: f16; f32 in exact mode; the MLA latent of "
            "deepseek2 / deepseek32 is both K and V: give -ctk and -ctv the same type)",
        )


def session_kv_options(args) -> dict:
    """The Session keywords of add_compute_arguments' KV and context options."""
    return {
        "cache_type_k": getattr(args, "cache_type_k", None),
        "cache_type_v": getattr(args, "cache_type_v", None),
        "allow_long_context": getattr(args, "allow_long_context", False),
        "device": getattr(args, "device", "cpu"),
    }


def add_streaming_arguments(p: argparse.ArgumentParser) -> None:
    """The expert streaming, cache, predictor and tracing options of `run` and `serve`."""
    p.add_argument(
        "--ram-budget",
        default=None,
        metavar="SIZE",
        help="stream experts from the file within this much RAM, e.g. 6GiB, or auto (what the machine or its "
        "cgroup has available minus max(256 MiB, 10%%)) (default: all resident)",
    )
    p.add_argument(
        "--vram-budget",
        default=None,
        metavar="SIZE",
        help="with --device cuda: VRAM for the session, e.g. 12GiB, or auto (free VRAM minus a margin); dense "
        "weights, KV cache and buffers first, then every expert if they fit, else expert slots the experts "
        "stream into from pinned RAM (same output; `sharpi inspect --plan` shows the plan) (default: all "
        "resident)",
    )
    p.add_argument(
        "--miss-route",
        choices=["copy", "cpu", "auto"],
        default="copy",
        help="with --vram-budget, an expert missing from VRAM: copy it (default; the resident output bit for "
        "bit), compute it on the CPU, or auto (the cheaper by the miss cost model on measured bandwidths)",
    )
    p.add_argument(
        "--reader",
        choices=["auto", "cufile", "io_uring", "uring", "pread"],
        default="auto",
        help="expert reader when streaming (default: auto = io_uring where it works, else pread; with "
        "--device cuda --vram-budget: cufile = cuFile reads into the VRAM slots (GPUDirect Storage where "
        "nvidia-fs is loaded, else cuFile's POSIX path), auto = cuFile only with nvidia-fs, else copies from "
        "the pinned mapping; cufile is an error saying why where it cannot run)",
    )
    p.add_argument(
        "--slru-probation",
        type=float,
        default=0.25,
        metavar="F",
        help="share of expert slots in the SLRU probation segment (default: 0.25)",
    )
    p.add_argument(
        "--cache-policy",
        default=None,
        metavar="NAME[:FILE]",
        help="expert-cache replacement policy when streaming: lru, slru, lfu, arc, s3fifo, predictive, or "
        "prior:FILE (fitted by `sharpi cache-prior`) (default: the best on real routing, "
        "docs/cache_policies.md)",
    )
    p.add_argument(
        "--predictor",
        default="none",
        metavar="NAME[:FILE]",
        help="predictive expert prefetch while streaming: none (reactive, default), prev_token, echo, next_gate, "
        "pregate, or cooc/depthtime/learned/trajectory with a predictor file (NAME:FILE; docs/predictors.md)",
    )
    p.add_argument(
        "--lookahead",
        type=int,
        choices=[1, 2, 3],
        default=1,
        help="layers ahead the predictor prefetches for (default: 1)",
    )
    p.add_argument(
        "--prefetch-sizing",
        choices=["topk", "bytes"],
        default="topk",
        help="predicted experts read per layer: the best top_k (topk, default) or those whose expected "
        "stall saved beats a wasted read's cost (bytes; docs/predictors.md)",
    )
    p.add_argument(
        "--trace",
        default=None,
        metavar="DIR",
        help="MoE tracing (also SHARPI_TRACE_MOE=1): print per-layer hit/recall/prefetch/stall table, "
        "write DIR/moe_trace.json and a Perfetto timeline",
    )
    p.add_argument(
        "--route-trace",
        default=None,
        metavar="NPZ",
        help="make the router follow a recorded routing trace (shared/traces format; benchmarks)",
    )


def session_options(args: argparse.Namespace) -> dict:
    """sharpi.Session keyword arguments from add_compute_arguments' and add_streaming_arguments' options."""
    return {
        "threads": args.threads,
        "n_ctx": args.ctx_size,
        "ram_budget": args.ram_budget,
        "vram_budget": args.vram_budget,
        "miss_route": args.miss_route,
        "slru_probation": args.slru_probation,
        "cache_policy": args.cache_policy,
        "reader": args.reader,
        "route_trace": args.route_trace,
        "predictor": args.predictor,
        "lookahead": args.lookahead,
        "prefetch_sizing": args.prefetch_sizing,
        "trace": args.trace,
        **session_kv_options(args),
    }


def add_hf_argument(p) -> None:
    """-hf/--hf-repo (llama.cpp's name), on a parser or on a mutually exclusive group beside -m;
    model_from_hub(args, err) turns it into args.model."""
    p.add_argument(
        "-hf",
        "--hf-repo",
        default=None,
        metavar="REPO[:QUANT]",
        help="download the model from the Hugging Face Hub (cached; e.g. unsloth/Qwen3-30B-A3B-GGUF:Q4_K_M); "
        "honours HF_ENDPOINT, HF_HOME, HF_HUB_OFFLINE",
    )


def model_from_hub(args, err) -> None:
    """-hf: resolve (download or find in the cache) and put the local path in args.model."""
    if getattr(args, "hf_repo", None) is None:
        return
    from .hub import resolve

    args.model = resolve(args.hf_repo, log=lambda msg: err.write(msg + "\n"))


# ------------------------------------------------------------------ sampling


def n_predict_int(name: str):
    """An argparse type for -n: N >= 0 tokens, or llama.cpp's -1 ("infinity") and -2 ("until the
    context is filled"), both -1 here: sharpi never shifts the context, so both end at an
    end-of-generation token or a full context."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if value < -2:
            raise argparse.ArgumentTypeError(
                f"{name} must be >= 0, or -1 (until end of generation or a full context), got {value}")
        return max(value, -1)

    return parse


def finite_float(name: str, low: float = -math.inf, high: float = math.inf):
    """An argparse type: a finite float in [low, high], with a message naming the option."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
        if not (math.isfinite(value) and low <= value <= high):
            raise argparse.ArgumentTypeError(f"{name} must be a finite number in [{low:g}, {high:g}], got {text}")
        return value

    return parse


def logit_bias_pair(text: str) -> tuple:
    """-l/--logit-bias TOKEN_ID(+/-)BIAS as llama.cpp writes it: 15043+1, 15043-1, 15043-inf (a ban)."""
    for i, ch in enumerate(text):
        if i > 0 and ch in "+-":
            token, sign, bias = text[:i], ch, text[i + 1 :]
            break
    else:
        token = sign = bias = ""
    try:
        token_id, value = int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"-l/--logit-bias takes TOKEN_ID+BIAS or TOKEN_ID-BIAS (e.g. 15043+1, 15043-inf), got {text!r}"
        ) from None
    value = -value if sign == "-" else value
    if math.isnan(value) or value == math.inf:
        raise argparse.ArgumentTypeError(f"-l/--logit-bias: the bias must be a number or -inf, got {text!r}")
    return token_id, value


def add_sampling_arguments(p: argparse.ArgumentParser, n_predict_default: int) -> None:
    """-n, --temp, --top-k, --top-p, --min-p, the penalties, -l, -s and --ignore-eos with llama.cpp's
    names and defaults (pass them on with sampling_options(args)); --grammar and --json-schema are
    refused: sharpi has no constrained sampling."""
    p.add_argument("-n", "--predict", "--n-predict", dest="n_predict", type=n_predict_int("-n"),
                   default=n_predict_default, metavar="N",
                   help=f"tokens to generate (default: {n_predict_default}; -1 = until an end-of-generation "
                   "token or a full context, as llama.cpp's -1 and -2)")
    p.add_argument("--temp", type=float, default=0.8, metavar="T",
                   help="temperature, 0 = greedy (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=40, metavar="K",
                   help="top-k, <= 0 = off (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=0.95, metavar="P", help="top-p, 1 = off (default: %(default)s)")
    p.add_argument("--min-p", type=float, default=0.05, metavar="P", help="min-p, 0 = off (default: %(default)s)")
    p.add_argument("--repeat-penalty", type=float, default=1.0, metavar="R",
                   help="repetition penalty, 1 = off (default: %(default)s)")
    p.add_argument("--repeat-last-n", type=int_at_least("--repeat-last-n", -1), default=None, metavar="N",
                   help="tokens the penalties look back over, prompt included (default: 64; -1 = all, 0 = no "
                   "penalties)")
    p.add_argument("--presence-penalty", type=finite_float("--presence-penalty", -2.0, 2.0), default=0.0,
                   metavar="P", help="subtracted once from the logit of every token in the penalty window "
                   "(OpenAI/llama.cpp; default: 0.0 = off)")
    p.add_argument("--frequency-penalty", type=finite_float("--frequency-penalty", -2.0, 2.0), default=0.0,
                   metavar="F", help="subtracted from a token's logit per occurrence in the penalty window "
                   "(default: 0.0 = off)")
    p.add_argument("-l", "--logit-bias", type=logit_bias_pair, action="append", default=None,
                   metavar="TOKEN_ID(+/-)BIAS",
                   help="add BIAS to a token's logit, e.g. 15043+1 or 15043-inf (-100 or -inf bans it); "
                   "repeatable; `sharpi run -v` prints the prompt's token ids")
    p.add_argument("-s", "--seed", type=int, default=-1, metavar="S",
                   help="sampling seed, -1 = random (default: -1)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-generation tokens")
    refuse = ("sharpi has no grammar- or schema-constrained sampling; -l TOKEN_ID-inf bans tokens, and "
              "`sharpi run` stops at -r/--stop text")
    for flags in (("--grammar",), ("--grammar-file",), ("-j", "--json-schema"), ("-jf", "--json-schema-file")):
        p.add_argument(*flags, action=Refused, nargs=None, why=refuse, help=argparse.SUPPRESS)


def sampling_options(args: argparse.Namespace) -> dict:
    """Session.generate keywords from add_sampling_arguments' options. The penalties and the bias
    appear only when set, so a call without them is the call sharpi always made."""
    options = {
        "max_tokens": args.n_predict,
        "temperature": args.temp,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "min_p": args.min_p,
        "repeat_penalty": args.repeat_penalty,
        "seed": None if args.seed < 0 else args.seed,
        "stop_at_eos": not args.ignore_eos,
    }
    if args.repeat_last_n is not None:
        options["repeat_last_n"] = args.repeat_last_n
    if args.presence_penalty:
        options["presence_penalty"] = args.presence_penalty
    if args.frequency_penalty:
        options["frequency_penalty"] = args.frequency_penalty
    if args.logit_bias:
        options["logit_bias"] = dict(args.logit_bias)  # a token given twice: the last value, as llama.cpp
    return options


# ------------------------------------------------------------------ llama.cpp's flags


class Refused(argparse.Action):
    """A llama.cpp flag sharpi cannot honour: parsing stops with exit status 2 and
    "FLAG: why, and what sharpi does instead". `why` is the message, or a function of the value
    that returns it, or None to accept that value (e.g. -ngl 0, which means "CPU only")."""

    def __init__(self, option_strings, dest, why, nargs=0, **kwargs):
        self.why = why
        super().__init__(option_strings, dest=argparse.SUPPRESS, nargs=nargs, default=argparse.SUPPRESS,
                         **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        why = self.why(values) if callable(self.why) else self.why
        if why is not None:
            shown = f"{option_string} {values}" if isinstance(values, str) else option_string
            parser.error(f"{shown}: {why}")


def _gpu_layers_refusal(value: str):
    """-ngl N: None (accepted) for 0 = CPU only, else why sharpi refuses it."""
    try:
        if int(value) == 0:
            return None
    except ValueError:
        pass
    try:
        from . import _internal
    except ImportError:  # no built extension: nothing runs anywhere, but the advice still holds
        has_cuda = False
    else:
        has_cuda = bool(_internal.cuda_available())  # False, never an error, without a build or a device
    advice = ("sharpi does not offload layers: --device cuda runs the whole forward pass on the GPU, and "
              "--vram-budget SIZE keeps the dense weights there and streams the experts that do not fit "
              "(`sharpi inspect --plan` shows the split)")
    if not has_cuda:
        advice += "; this machine has no usable CUDA device (or this build has no CUDA), so sharpi runs on the CPU"
    return advice


def _on_off_auto(text: str) -> str:
    """llama.cpp's is_truthy / is_falsey / is_autoy spellings of -fa's value."""
    for value, spellings in (("on", ("on", "enabled", "true", "1")), ("off", ("off", "disabled", "false", "0")),
                             ("auto", ("auto", "-1"))):
        if text in spellings:
            return value
    raise argparse.ArgumentTypeError(f"-fa/--flash-attn takes on, off or auto, got {text!r}")


def add_llama_compat_arguments(parser: argparse.ArgumentParser, batch_size_help: str | None = None):
    """The llama-cli / llama-server loader and hardware flags, in their own --help section (returned,
    for a command's own llama.cpp flags): accepted where they change nothing in sharpi (said so in
    --help), refused (exit 2, a message naming the flag) where sharpi cannot do what they ask.
    batch_size_help: -b's help for a command where it does something (serve's tokens per step)."""
    p = parser.add_argument_group("llama.cpp flags", "what llama-cli / llama-server flags do in sharpi")
    p.add_argument("-ngl", "--gpu-layers", "--n-gpu-layers", action=Refused, nargs=None, metavar="N",
                   why=_gpu_layers_refusal,
                   help="llama.cpp's layer offload: only 0 (CPU) is accepted; sharpi uses --device cuda and "
                   "--vram-budget instead")
    p.add_argument("-fa", "--flash-attn", nargs="?", const="on", type=_on_off_auto, default="auto",
                   metavar="on|off|auto",
                   help="accepted for llama.cpp compatibility; sharpi chooses its attention kernels itself "
                   "(the same output either way)")
    p.add_argument("-b", "--batch-size", type=positive_int("-b"), default=None, metavar="N",
                   help=batch_size_help or "accepted for llama.cpp compatibility; sharpi prefills the whole "
                   "prompt in one pass")
    p.add_argument("-ub", "--ubatch-size", type=positive_int("-ub"), default=None, metavar="N",
                   help="accepted for llama.cpp compatibility; sharpi prefills the whole prompt in one pass")
    p.add_argument("--jinja", action="store_true",
                   help="accepted for llama.cpp compatibility: sharpi always renders chat templates with Jinja")
    p.add_argument("--no-mmap", action=Refused,
                   why="sharpi always maps the GGUF file (dense weights and resident experts are read from "
                   "the mapping); --ram-budget SIZE reads experts with explicit I/O into a bounded cache instead",
                   help="refused: sharpi always maps the model file")
    p.add_argument("--mlock", action=Refused,
                   why="sharpi does not lock the model in RAM; --ram-budget SIZE bounds the RAM experts take, "
                   "streaming the rest from the file",
                   help="refused: sharpi does not lock memory")
    return p


def add_speculative_arguments(p: argparse.ArgumentParser) -> None:
    """Speculative decoding with llama.cpp's flag names (sharpi.speculative): --spec-type,
    --spec-draft-n-max / -n-min, -md, --spec-ngram-simple-size-n / -m. Open it with
    speculation_from_args(session, args) on a session made with speculative_session_options."""
    from .speculative import DEFAULT_DRAFT_N_MAX, DEFAULT_NGRAM_SIZE_N, SPEC_TYPES

    g = p.add_argument_group("speculative decoding", "draft tokens cheaply and verify them in one step; the "
                             "output is the same as without it")
    g.add_argument("--spec-type", choices=SPEC_TYPES, default=None,
                   help="draft source: ngram-simple (prompt lookup), draft-simple (a draft model, -md), "
                   "draft-mtp (the file's MTP layers) or none (default: draft-simple with -md, else none)")
    g.add_argument("--spec-draft-n-max", "--draft-max", "--draft", "--draft-n", dest="spec_draft_n_max",
                   type=int_at_least("--spec-draft-n-max", 1), default=DEFAULT_DRAFT_N_MAX, metavar="N",
                   help="most draft tokens per step (default: %(default)s)")
    g.add_argument("--spec-draft-n-min", "--draft-min", dest="spec_draft_n_min",
                   type=non_negative_int("--spec-draft-n-min"), default=0, metavar="N",
                   help="fewer draft tokens than this: decode one token instead (default: %(default)s)")
    g.add_argument("--spec-draft-auto", action="store_true",
                   help="choose each step's draft length (up to --spec-draft-n-max) from the acceptance per draft "
                   "position and the measured cost of verify steps (docs/speculative.md)")
    g.add_argument("-md", "--spec-draft-model", "--model-draft", dest="spec_draft_model", default=None,
                   metavar="FILE", help="draft model GGUF with the target's vocabulary (implies draft-simple); with "
                   "--spec-type draft-mtp, a file holding the model's MTP block (llama.cpp's --mtp export)")
    g.add_argument("--spec-ngram-simple-size-n", type=int_at_least("--spec-ngram-simple-size-n", 1),
                   default=DEFAULT_NGRAM_SIZE_N, metavar="N",
                   help="ngram-simple: tokens of the n-gram looked up in the context (default: %(default)s)")
    g.add_argument("--spec-ngram-simple-size-m", type=int_at_least("--spec-ngram-simple-size-m", 1), default=48,
                   metavar="M", help="ngram-simple: most tokens copied after a match (default: %(default)s)")


def speculation_enabled(args: argparse.Namespace) -> bool:
    return (args.spec_type or ("draft-simple" if args.spec_draft_model else "none")) != "none"


def speculative_session_options(args: argparse.Namespace) -> dict:
    """The Session keywords speculation needs: room for the draft's recurrent-state copies (none
    without speculation, so the session is opened as before)."""
    if not speculation_enabled(args):
        return {}
    if args.spec_type != "draft-mtp":
        return {"max_draft_tokens": args.spec_draft_n_max}
    # draft-mtp: -md's block (a file holding only the block), else the shipped model's trained head
    # for the shipped model, else the model file's own block.
    from .models import default_model_path, default_mtp_path

    mtp = args.spec_draft_model or True
    if mtp is True and (args.model is None or os.path.abspath(args.model) == default_model_path()):
        mtp = default_mtp_path()
    return {"max_draft_tokens": args.spec_draft_n_max, "mtp": mtp}


def speculation_from_args(session, args: argparse.Namespace):
    """sharpi.speculative.Speculation for add_speculative_arguments' options, or None."""
    from .speculative import open_speculation

    return open_speculation(session, args.spec_type, n_max=args.spec_draft_n_max, n_min=args.spec_draft_n_min,
                            draft_model=args.spec_draft_model, ngram_size_n=args.spec_ngram_simple_size_n,
                            ngram_size_m=args.spec_ngram_simple_size_m, threads=getattr(args, "threads", 0),
                            n_seq=getattr(args, "parallel", 1), auto=args.spec_draft_auto)
