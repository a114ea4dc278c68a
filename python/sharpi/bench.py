"""`sharpi bench`: decode speed of expert streaming under RAM budgets, against the IO lower bound.

What it measures (DESIGN §7, §9). For a synthetic model (default: Qwen3-30B-A3B's shapes at q4_k_m,
built once and reused from --model-dir) and, when the recorded trace is at hand, for DeepSeek-V2-Lite's
expert layout replaying its real routing (shared/traces/deepseek_v2_lite_train.npz), it runs:
  - a probe, which reads the engine's own plan: fixed bytes (dense weights, KV cache, buffers) and
    the size of one expert slot;
  - the reader's sequential bandwidth on this file (O_DIRECT, page cache dropped), expert-sized
    reads back to back through the expert tensors;
  - the resident engine (every expert memory-mapped) decoding the same tokens twice: the second pass
    is the all-in-RAM TPOT;
  - one streamed run per budget share s: n_slots = s x n_layer x n_expert, ram_budget = fixed +
    n_slots x slot, each in a fresh subprocess under a cgroup-v1 memory cap of budget + a stated
    overhead (when running as root with the memory controller mounted), page cache dropped first.
Every run decodes the same tokens one at a time: a warm-up of --warmup tokens, then --tokens measured
tokens. From the measured part: TPOT, tok/s, hit rate, stall fraction (stall / decode wall time), IO
GB/s (bytes read over decode wall time and over stall time), bytes read per token.

The lower bound. Each run records its exact expert-access sequence (Session.last_routing() after
every token: layer by layer, the set of experts). Belady's optimal replacement (sharpi.belady) on
that sequence with capacity n_slots, starting from the best content the warm-up could have left,
gives the fewest misses any demand cache can have; their bytes over the sequential bandwidth is the
least IO time any reactive engine needs. TPOT / that bound (per token) is the headline ratio; the
bound ignores compute, so TPOT / (bound + resident TPOT) is reported beside it. LRU's simulated
misses on the same sequence are reported for comparison with the engine's SLRU.

Process layout: this process only plans, launches and summarises; each configuration runs in a
child (`python -m sharpi.bench --worker CONFIG RESULT`), so one run's memory, page cache and cache
state never leak into the next. The children write JSON; the parent computes policies and ratios.
Output: a table on stdout (also saved as bench.txt) and every raw number in bench.json under --out,
plus a Chrome/Perfetto trace of a few tokens of the smallest-budget run (timeline.json).
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import platform
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

MiB = 1 << 20
GiB = 1 << 30

GOAL_RATIO = 1.5  # TPOT / IO lower bound a reactive engine should reach (issue 3, item 5)
TRACE_FILE = "deepseek_v2_lite_train.npz"
TRACE_PRESET = "deepseek-trace"
# --quick: the trace model keeps DeepSeek-V2-Lite's 64 experts, top-6, but with 4 small layers (the
# trace's first 4 layers are replayed) so the smoke run writes a few MiB, not gigabytes.
QUICK_TRACE_OVERRIDES = {
    "n_layer": 4,
    "n_embd": 256,
    "n_head": 4,
    "n_head_kv": 4,
    "head_dim": 64,
    "n_ff": 512,
    "n_ff_exp": 256,
    "n_vocab": 1024,
}

# Fields of every streamed run in bench.json (tests check them).
RUN_FIELDS = (
    "share",
    "n_slots",
    "budget_bytes",
    "cap",
    "cache_drop",
    "reader",
    "tokens",
    "warmup_tokens",
    "decode_s",
    "tpot_ms",
    "tpot_p50_ms",
    "decode_tok_s",
    "cpu_ms_per_token",
    "accesses",
    "hits",
    "misses",
    "evictions",
    "hit_rate",
    "bytes_read",
    "bytes_per_token",
    "stall_ms",
    "stall_fraction",
    "io_gbps_wall",
    "io_gbps_stall",
    "peak_rss_bytes",
    "belady_misses",
    "belady_bytes",
    "belady_hit_rate",
    "lru_misses",
    "lru_hit_rate",
    "lower_bound_ms_per_token",
    "ratio_tpot_to_lower_bound",
    "ratio_tpot_to_lower_bound_plus_resident",
    "goal_met",
    "verdict",
    "engine_misses_at_least_belady",
    "output_matches_resident",
    "layers",
)


# ==================================================================================================
# Command line
# ==================================================================================================


def _shares(text: str) -> list:
    try:
        shares = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--budgets expects comma-separated shares like 0.25,0.5,1.0, got {text!r}"
        ) from None
    if not shares or any(not 0 < s <= 1 for s in shares):
        raise argparse.ArgumentTypeError(f"--budgets: every share must be in (0, 1], got {text!r}")
    return sorted(set(shares))


def _positive(name: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{name} must be > 0, got {value}")
        return value

    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `sharpi bench` (defaults None where --quick picks its own)."""
    p.add_argument(
        "--out", default="bench-out/streaming", help="folder for bench.json, bench.txt, timeline.json"
    )
    p.add_argument(
        "--model-dir",
        default=None,
        help="where synthetic models are written and reused (default: <out>/../models)",
    )
    p.add_argument("--preset", default=None, help="model preset (default: qwen3-30b-a3b; tiny with --quick)")
    p.add_argument("--quant", default="q4_k_m", help="quantization of the synthetic models (default: q4_k_m)")
    p.add_argument(
        "--budgets",
        type=_shares,
        default=[0.25, 0.5, 1.0],
        help="RAM budgets as shares of all expert slots (default: 0.25,0.5,1.0)",
    )
    p.add_argument(
        "--tokens", type=_positive("--tokens"), default=None, help="measured decode tokens (default: 32)"
    )
    p.add_argument("--warmup", type=_positive("--warmup"), default=None, help="warm-up tokens (default: 8)")
    p.add_argument("--threads", type=_positive("--threads"), default=2, help="compute threads (default: 2)")
    p.add_argument(
        "--reader", choices=["auto", "uring", "pread"], default="auto", help="expert reader (default: auto)"
    )
    p.add_argument(
        "--trace", default=None, help=f"routing trace to replay (default: ../shared/traces/{TRACE_FILE})"
    )
    p.add_argument("--trace-start", type=int, default=0, help="first trace row replayed (default: 0)")
    p.add_argument("--no-trace", action="store_true", help="skip the trace-replay workload")
    p.add_argument(
        "--cap-overhead",
        default="512MiB",
        help="memory cap = budget + this, for the interpreter and libraries (default: 512MiB)",
    )
    p.add_argument("--no-cap", action="store_true", help="run without the cgroup memory cap")
    p.add_argument(
        "--timeline-tokens",
        type=_positive("--timeline-tokens"),
        default=None,
        help="decoded tokens shown in timeline.json (default: 3)",
    )
    p.add_argument(
        "--bw-bytes", default="1GiB", help="bytes read to measure sequential bandwidth (default: 1GiB)"
    )
    p.add_argument(
        "--drop-cache",
        choices=["all", "file"],
        default=None,
        help="before each run drop the whole page cache (all, as root) or the model file's (file) "
        "(default: all; file with --quick)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the model weights and the decoded tokens")
    p.add_argument("--quick", action="store_true", help="tiny models and few tokens (smoke test, seconds)")


def _resolve_options(args: argparse.Namespace) -> dict:
    from . import _core

    quick = bool(args.quick)
    opts = {
        "out": Path(args.out),
        "preset": args.preset or ("tiny" if quick else "qwen3-30b-a3b"),
        "quant": args.quant,
        "budgets": list(args.budgets),
        "tokens": args.tokens or (6 if quick else 32),
        "warmup": args.warmup or (3 if quick else 8),
        "threads": args.threads,
        "reader": args.reader,
        "trace_start": args.trace_start,
        "timeline_tokens": args.timeline_tokens or (2 if quick else 3),
        "cap": not args.no_cap,
        "cap_overhead": _core.parse_byte_size(str(args.cap_overhead)),
        "bw_bytes": _core.parse_byte_size(str(args.bw_bytes)),
        "seed": args.seed,
        "drop_cache": args.drop_cache or ("file" if quick else "all"),
        "quick": quick,
    }
    opts["model_dir"] = Path(args.model_dir) if args.model_dir else opts["out"].parent / "models"
    opts["timeline_tokens"] = min(opts["timeline_tokens"], opts["tokens"])
    if args.no_trace:
        opts["trace"], opts["trace_skip"] = None, "--no-trace given"
    else:
        path = Path(args.trace) if args.trace else default_trace_path()
        if path is None or not path.is_file():
            where = args.trace or f"../shared/traces/{TRACE_FILE} next to the repository"
            opts["trace"], opts["trace_skip"] = None, f"no routing trace at {where}"
        else:
            opts["trace"], opts["trace_skip"] = path, None
    return opts


def default_trace_path() -> Path | None:
    """../shared/traces/<TRACE_FILE> beside the repository this package runs from, else beside the cwd."""
    here = Path(__file__).resolve()
    candidates = [here.parents[2].parent / "shared" / "traces" / TRACE_FILE]  # <repo>/python/sharpi/bench.py
    cwd = Path.cwd()
    candidates += [cwd.parent / "shared" / "traces" / TRACE_FILE, cwd / "shared" / "traces" / TRACE_FILE]
    return next((c for c in candidates if c.is_file()), None)


# ==================================================================================================
# Models
# ==================================================================================================


def ensure_model(model_dir: Path, preset: str, quant: str, seed: int, overrides: dict, log) -> dict:
    """The synthetic model for (preset, quant, seed, overrides): reused when a file of that name with
    the same shape and seed exists, else written. Returns {path, reused, seconds}."""
    from . import presets
    from .make_model import write_model

    suffix = "".join(f"-{k}{v}" for k, v in sorted(overrides.items()))
    path = Path(model_dir) / f"{preset}-{quant}{suffix}-seed{seed}.gguf"
    expected = presets.resolve(None, preset, **overrides)
    if path.is_file() and _model_matches(path, expected, preset, seed):
        return {"path": str(path), "reused": True, "seconds": 0.0}
    os.makedirs(model_dir, exist_ok=True)
    log(f"writing {path} ({preset} {quant}) ...")
    t0 = time.perf_counter()
    write_model(path, preset=preset, quant=quant, seed=seed, progress=lambda m: log("  " + m), **overrides)
    return {"path": str(path), "reused": False, "seconds": time.perf_counter() - t0}


def _model_matches(path: Path, hp, preset: str, seed: int) -> bool:
    from . import _core

    try:
        md = _core.GgufFile(str(path)).metadata()
    except _core.SharpiError:
        return False  # truncated or foreign: rewrite it
    a = md.get("general.architecture")
    want = {
        "general.architecture": hp.arch,
        "sharpi.preset": preset,
        "sharpi.seed": seed,
        f"{a}.block_count": hp.n_layer,
        f"{a}.embedding_length": hp.n_embd,
        f"{a}.expert_count": hp.n_expert,
        f"{a}.expert_used_count": hp.n_expert_used,
        f"{a}.expert_feed_forward_length": hp.n_ff_exp,
    }
    return all(md.get(k) == v for k, v in want.items())


def expert_layout(path: str) -> dict:
    """Per layer: bytes of one expert (its gate + up + down slices) and the expert byte ranges of the
    file in file order, from the GGUF header."""
    from . import _core

    f = _core.GgufFile(path)
    md = f.metadata()
    arch = md["general.architecture"]
    n_layer = int(md[f"{arch}.block_count"])
    n_expert = int(md[f"{arch}.expert_count"])
    by_name = {t["name"]: t for t in f.tensors()}
    expert_bytes, tensors = [], []
    for il in range(n_layer):
        total = 0
        for part in ("gate", "up", "down"):
            t = by_name[f"blk.{il}.ffn_{part}_exps.weight"]
            total += t["nbytes"] // n_expert
            tensors.append((t["file_offset"], t["nbytes"] // n_expert))
        expert_bytes.append(total)
    return {"expert_bytes": expert_bytes, "tensors": sorted(tensors), "n_expert": n_expert}


# ==================================================================================================
# Page cache, bandwidth, memory cap
# ==================================================================================================


def drop_page_cache(paths, how: str = "all") -> str:
    """Empties the page cache of `paths` (the model file: the only file a run reads); returns how.
    how="all": the whole page cache through /proc/sys/vm/drop_caches (root), falling back to
    "fadvise": POSIX_FADV_DONTNEED on each file (what how="file" does directly, sparing the page
    cache of other work on the machine)."""
    if how == "all":
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1\n")
            return "drop_caches"
        except OSError:
            pass
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise"


def measure_sequential_bandwidth(
    path: str, reader_kind: str, layout: dict, max_bytes: int, drop: str = "all", repeats: int = 2
) -> dict:
    """Bandwidth of this session's reader kind on this file: expert-sized reads back to back through
    the expert tensors (in file order), page cache dropped before each pass; the best pass counts."""
    from . import _core

    ranges, total = [], 0
    for offset, per_expert in layout["tensors"]:
        for e in range(layout["n_expert"]):
            if total >= max_bytes:
                break
            ranges.append((offset + e * per_expert, per_expert, "demand"))
            total += per_expert
    reader = _core.ExpertReaderTest(reader_kind, path, arena_bytes=64 * MiB)
    best = None
    how = ""
    for _ in range(repeats):
        how = drop_page_cache([path], drop)
        t0 = time.perf_counter()
        nbytes = reader.read(ranges, keep_bytes=False)
        seconds = time.perf_counter() - t0
        if best is None or seconds < best[1]:
            best = (nbytes, seconds)
    nbytes, seconds = best
    return {
        "reader": reader.describe,
        "bytes": int(nbytes),
        "requests": len(ranges),
        "seconds": seconds,
        "gbps": nbytes / seconds / 1e9,
        "cache_drop": how,
    }


class MemoryCap:
    """A cgroup-v1 memory limit around one benchmark subprocess.

    Owns one child group of this process's own memory cgroup (<own>/sharpi-bench-<pid>-<n>): created
    on enter with memory.limit_in_bytes = limit, removed on exit after its counters are read. Only the
    subprocess launched through command() joins it (a shell writes its own pid to cgroup.procs, then
    execs the worker). It never changes any other group's settings or moves any other process. When
    the controller is absent, read-only or we are not root, the run goes on uncapped and report()
    says why.
    """

    ROOT = Path("/sys/fs/cgroup/memory")
    _count = 0

    def __init__(self, limit_bytes: int, enabled: bool = True):
        self.limit_bytes = int(limit_bytes)
        self.enabled = enabled
        self.group: Path | None = None
        self.applied = False
        self.reason = "disabled (--no-cap)" if not enabled else ""
        self.counters: dict = {}

    def __enter__(self):
        if not self.enabled:
            return self
        if os.geteuid() != 0:
            self.reason = "not root"
            return self
        if not (self.ROOT / "memory.limit_in_bytes").exists():
            self.reason = f"no cgroup-v1 memory controller at {self.ROOT}"
            return self
        own = _own_memory_cgroup()
        MemoryCap._count += 1
        group = self.ROOT / own.lstrip("/") / f"sharpi-bench-{os.getpid()}-{MemoryCap._count}"
        try:
            group.mkdir()
        except OSError as e:
            self.reason = f"cannot create {group}: {e.strerror}"
            return self
        self.group = group
        try:
            (group / "memory.limit_in_bytes").write_text(str(self.limit_bytes))
            memsw = group / "memory.memsw.limit_in_bytes"
            if memsw.exists():  # with swap, cap RAM + swap too, so the budget cannot spill into swap
                try:
                    memsw.write_text(str(self.limit_bytes))
                except OSError:
                    pass
            applied = int((group / "memory.limit_in_bytes").read_text())
        except OSError as e:
            self.reason = f"cannot set the limit in {group}: {e.strerror}"
            self._remove()
            return self
        if applied > self.limit_bytes + 4096:
            self.reason = f"the kernel kept a limit of {applied} bytes"
            self._remove()
            return self
        self.limit_bytes = applied  # rounded down to whole pages by the kernel
        self.applied = True
        return self

    def command(self, argv: list) -> list:
        if not self.applied:
            return argv
        procs = str(self.group / "cgroup.procs")
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', procs, *argv]

    def read_counters(self) -> None:
        if not self.applied or self.group is None:
            return
        g = self.group
        try:
            self.counters["peak_bytes"] = int((g / "memory.max_usage_in_bytes").read_text())
            self.counters["failcnt"] = int((g / "memory.failcnt").read_text())
            oom = dict(
                line.split() for line in (g / "memory.oom_control").read_text().splitlines() if line.strip()
            )
            self.counters["oom_kills"] = int(oom.get("oom_kill", 0))
        except (OSError, ValueError):
            pass

    def report(self) -> dict:
        out = {
            "applied": self.applied,
            "limit_bytes": self.limit_bytes if self.applied else None,
            "reason": None if self.applied else self.reason,
            "group": str(self.group) if self.group else None,
        }
        out.update(self.counters)
        return out

    def _remove(self) -> None:
        if self.group is None:
            return
        for _ in range(50):  # the exiting task may take a moment to leave the group
            try:
                self.group.rmdir()
                break
            except OSError:
                time.sleep(0.1)
        self.group = None

    def __exit__(self, *exc) -> None:
        group = self.group
        self._remove()
        self.group = group  # the report names the group; the directory itself is gone


def _own_memory_cgroup() -> str:
    with open("/proc/self/cgroup") as f:
        for line in f:
            parts = line.rstrip("\n").split(":", 2)
            if len(parts) == 3 and "memory" in parts[1].split(","):
                return parts[2]
    return "/"


# ==================================================================================================
# Worker (one configuration, in its own process)
# ==================================================================================================


def _worker(config_path: str, result_path: str) -> int:
    """Runs one configuration described by the JSON at config_path; writes the result JSON."""
    import sharpi

    cfg = json.loads(Path(config_path).read_text())
    result: dict = {"mode": cfg["mode"]}
    try:
        result.update(_worker_run(sharpi, cfg))
        result["ok"] = True
    except Exception as e:  # noqa: BLE001 -- any failure is reported to the parent, which prints it
        result["ok"] = False
        result["error"] = f"{type(e).__name__}: {e}"
    result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    Path(result_path).write_text(json.dumps(result))
    return 0 if result["ok"] else 1


def _decode_steps(session, tokens, on_step=None) -> dict:
    """Decodes tokens one at a time. Returns per step the wall seconds and the CPU seconds of the
    whole process (every compute and reader thread), the routing ([t][il] lists of expert ids) and a
    digest of all logits."""
    wall, cpu, routing = [], [], []
    digest = hashlib.sha256()
    for i, token in enumerate(tokens):
        if on_step:
            on_step(i)
        c0, t0 = time.process_time(), time.perf_counter()
        logits = session.decode([int(token)])
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        routing.append([[int(e) for e in ids[0]] for ids in session.last_routing()])
        digest.update(np.ascontiguousarray(logits, dtype=np.float32).tobytes())
    return {"step_s": wall, "cpu_s": cpu, "routing": routing, "logits_sha256": digest.hexdigest()}


def _token_spans(events: list, first_pos: int) -> list:
    """A "token" track over the engine's spans: one span per decoded token (named by its position), from the start of its
    first layer's compute to the end of the last compute span before the next token's first layer.
    The engine names layer spans "layer <il>"; with other names there is no token track."""
    compute = sorted((e for e in events if e["track"] == "compute"), key=lambda e: e["start_us"])
    starts = [i for i, e in enumerate(compute) if e["name"] == "layer 0"]
    spans = []
    for n, i in enumerate(starts):
        j = starts[n + 1] if n + 1 < len(starts) else len(compute)
        end = max(e["start_us"] + e["dur_us"] for e in compute[i:j])
        begin = compute[i]["start_us"]
        spans.append(
            {
                "track": "token",
                "name": f"token at position {first_pos + n}",
                "start_us": begin,
                "dur_us": end - begin,
            }
        )
    return spans


def _worker_run(sharpi, cfg: dict) -> dict:
    mode = cfg["mode"]
    kwargs = {"threads": cfg["threads"], "n_ctx": cfg["n_ctx"], "reader": cfg["reader"]}
    if mode in ("probe", "stream"):
        kwargs["ram_budget"] = int(cfg["budget_bytes"])
    want_timeline = bool(cfg.get("timeline_path"))
    timeline_note = None
    if want_timeline:
        if "timeline" in inspect.signature(sharpi.Session.__init__).parameters:
            kwargs["timeline"] = True
        else:
            want_timeline = False
            timeline_note = "this build's Session has no timeline (Session(timeline=True), timeline_events()); no trace written"

    t_load = time.perf_counter()
    session = sharpi.Session(cfg["path"], **kwargs)
    load_s = time.perf_counter() - t_load
    info = dict(session.info)
    if mode == "probe":
        st = session.expert_stats()
        return {
            "info": info,
            "reader": st["reader"],
            "fixed_bytes": int(st["fixed_bytes"]),
            "slot_bytes": int(st["slot_bytes"]),
            "n_slots": int(st["n_slots"]),
            "load_s": load_s,
        }
    if cfg.get("trace_rows"):
        session.set_route_trace(np.load(cfg["trace_rows"]))
    tokens = cfg["tokens"]
    warm = tokens[: cfg["warmup"]]
    measured = tokens[cfg["warmup"] :]
    out: dict = {"info": info, "load_s": load_s}

    if mode == "resident":
        # Pass 1 faults the file's pages in (cold); pass 2, same tokens from position 0 again, runs
        # with every expert it needs already in RAM: the all-in-RAM TPOT.
        _decode_steps(session, warm)
        cold = _decode_steps(session, measured)
        session.reset()
        warm_run = _decode_steps(session, warm)
        out.update(_decode_steps(session, measured))
        out["cold_step_s"] = cold["step_s"]
        out["warm_routing"] = warm_run["routing"]
        return out

    st = session.expert_stats()
    if int(st["n_slots"]) != int(cfg["n_slots"]):
        raise RuntimeError(f"engine planned {st['n_slots']} slots for the budget, expected {cfg['n_slots']}")
    warm_run = _decode_steps(session, warm)
    session.reset_stats()
    first_traced = len(measured) - int(cfg.get("timeline_tokens", 0))

    def on_step(i: int) -> None:
        # Cleared at the first measured token too, so the spans of untraced tokens never pile up.
        if want_timeline and i in (0, first_traced) and hasattr(session, "clear_timeline"):
            session.clear_timeline()

    out.update(_decode_steps(session, measured, on_step))
    st = session.expert_stats()
    out.update(
        {
            "reader": st["reader"],
            "n_slots": int(st["n_slots"]),
            "slot_bytes": int(st["slot_bytes"]),
            "fixed_bytes": int(st["fixed_bytes"]),
            "budget_bytes": int(st["budget_bytes"]),
            "layers": [dict(lay) for lay in st["layers"]],
            "warm_routing": warm_run["routing"],
        }
    )
    if want_timeline:
        from .timeline import write_chrome_trace

        events = list(session.timeline_events())
        first_pos = len(warm) + first_traced if hasattr(session, "clear_timeline") else 0
        events += _token_spans(events, first_pos)
        if first_traced > 0 and not hasattr(session, "clear_timeline"):
            timeline_note = "no clear_timeline(): the trace holds every decoded token"
        summary = write_chrome_trace(events, cfg["timeline_path"], process_name="sharpi decode")
        summary["tokens"] = int(cfg.get("timeline_tokens", 0))
        summary["tracks"] = sorted({e["track"] for e in events})
        out["timeline"] = summary
    if timeline_note:
        out["timeline_note"] = timeline_note
    return out


# ==================================================================================================
# Parent: plan, launch, summarise
# ==================================================================================================


def _child_env() -> dict:
    # The child must import this very sharpi (a developer build under python/ included).
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def launch(cfg: dict, work: Path, label: str, cap: MemoryCap | None = None) -> dict:
    """Runs one worker; returns its result dict (ok False with the reason if it failed or was killed)."""
    work.mkdir(parents=True, exist_ok=True)
    cfg_path, res_path = work / f"{label}.config.json", work / f"{label}.result.json"
    cfg_path.write_text(json.dumps(cfg))
    res_path.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "sharpi.bench", "--worker", str(cfg_path), str(res_path)]
    if cap is not None:
        argv = cap.command(argv)
    proc = subprocess.run(
        argv, check=False, env=_child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    if cap is not None:
        cap.read_counters()
    if res_path.is_file():
        result = json.loads(res_path.read_text())
    else:
        killed = proc.returncode in (-9, 137)
        oom = cap is not None and cap.counters.get("oom_kills", 0) > 0
        why = (
            "killed by the OOM killer under the memory cap"
            if killed and oom
            else f"exit status {proc.returncode}"
        )
        result = {"ok": False, "error": f"worker {label}: {why}; output: {proc.stdout[-2000:].strip()}"}
    return result


def _summarise_stream(
    res: dict, n_layer: int, n_expert: int, expert_bytes: list, seq_gbps: float, resident: dict
) -> dict:
    """The numbers of one streamed run, its Belady / LRU simulation and its ratios."""
    from .belady import belady, lru, steps_from_routing

    steps = res["step_s"]
    n_tok = len(steps)
    decode_s = float(sum(steps))
    layers = res["layers"]
    accesses = sum(lay["accesses"] for lay in layers)
    hits = sum(lay["hits"] for lay in layers)
    misses = sum(lay["misses"] for lay in layers)
    bytes_read = sum(lay["bytes_read"] for lay in layers)
    stall_ms = sum(lay["stall_ms"] for lay in layers)
    n_slots = res["n_slots"]

    warm_steps = steps_from_routing(res["warm_routing"], n_expert)
    dec_steps = steps_from_routing(res["routing"], n_expert)
    warm_set = set().union(*warm_steps) if warm_steps else set()
    opt = belady(dec_steps, n_slots, warm=warm_set)
    ref = lru(warm_steps + dec_steps, n_slots, count_from=len(warm_steps))
    # Step j of the decode sequence is layer j % n_layer; a miss there costs that layer's expert bytes.
    opt_bytes = sum(m * expert_bytes[j % n_layer] for j, m in enumerate(opt.misses_per_step))
    lb_ms = opt_bytes / (seq_gbps * 1e9) * 1e3 / n_tok if seq_gbps > 0 else None

    tpot_ms = decode_s * 1e3 / n_tok
    res_tpot = resident.get("tpot_ms")
    ratio_lb = tpot_ms / lb_ms if lb_ms else None
    ratio_both = tpot_ms / (lb_ms + res_tpot) if lb_ms is not None and res_tpot else None
    goal_met = ratio_lb is not None and ratio_lb <= GOAL_RATIO
    io_stall = bytes_read / (stall_ms / 1e3) / 1e9 if stall_ms > 0 else None
    out = {
        "share": None,  # filled by the caller
        "n_slots": n_slots,
        "budget_bytes": res["budget_bytes"],
        "reader": res["reader"],
        "tokens": n_tok,
        "warmup_tokens": len(res["warm_routing"]),
        "decode_s": decode_s,
        "tpot_ms": tpot_ms,
        "tpot_p50_ms": float(np.median(steps)) * 1e3,
        "decode_tok_s": n_tok / decode_s,
        "cpu_ms_per_token": float(sum(res["cpu_s"])) * 1e3 / n_tok,
        "accesses": accesses,
        "hits": hits,
        "misses": misses,
        "evictions": sum(lay["evictions"] for lay in layers),
        "hit_rate": hits / accesses if accesses else 0.0,
        "bytes_read": bytes_read,
        "bytes_per_token": bytes_read / n_tok,
        "stall_ms": stall_ms,
        "stall_fraction": stall_ms / 1e3 / decode_s,
        "io_gbps_wall": bytes_read / decode_s / 1e9,
        "io_gbps_stall": io_stall,
        "peak_rss_bytes": res.get("peak_rss_bytes"),
        "belady_misses": opt.misses,
        "belady_bytes": opt_bytes,
        "belady_hit_rate": opt.hit_rate,
        "lru_misses": ref.misses,
        "lru_hit_rate": ref.hit_rate,
        "lower_bound_ms_per_token": lb_ms,
        "ratio_tpot_to_lower_bound": ratio_lb,
        "ratio_tpot_to_lower_bound_plus_resident": ratio_both,
        "goal_met": goal_met,
        # Sanity: a demand cache can never miss less than Belady from the same warm-up.
        "engine_misses_at_least_belady": misses >= opt.misses,
        # Lossless invariant: streamed logits are bit-identical to the resident engine's.
        "output_matches_resident": (
            res["logits_sha256"] == resident.get("logits_sha256") if resident.get("logits_sha256") else None
        ),
        "layers": layers,
    }
    out["verdict"] = _verdict(out, resident, seq_gbps)
    return out


def _verdict(r: dict, resident: dict, seq_gbps: float) -> str:
    """Plain words: is TPOT within GOAL_RATIO of the lower bound, and if not, where the time went."""
    resident_tpot = resident.get("tpot_ms")
    lb = r["lower_bound_ms_per_token"]
    if not lb:
        return (
            "no bound: Belady needs no reads after the warm-up, so the IO lower bound is 0; "
            "compare TPOT with the resident TPOT instead"
        )
    ratio = r["ratio_tpot_to_lower_bound"]
    if r["goal_met"]:
        return f"goal met: TPOT is {ratio:.2f}x the IO lower bound (<= {GOAL_RATIO})"
    reasons = []
    if resident_tpot and resident_tpot > GOAL_RATIO * lb:
        reasons.append(
            f"compute alone (resident TPOT {resident_tpot:.1f} ms) is {resident_tpot / lb:.2f}x the IO bound "
            f"({lb:.1f} ms, which counts no compute): no IO schedule can meet the goal on this machine"
        )
    elif resident_tpot and resident_tpot > (GOAL_RATIO - 1) * lb:
        reasons.append(
            f"compute (resident TPOT {resident_tpot:.1f} ms) exceeds the {GOAL_RATIO - 1:.1f}x slack the goal "
            f"leaves over the IO bound ({lb:.1f} ms): only reads fully hidden behind compute can meet it"
        )
    if r["belady_misses"] and r["misses"] > r["belady_misses"]:
        reasons.append(
            f"SLRU misses {r['misses']} vs Belady {r['belady_misses']} ({r['misses'] / r['belady_misses']:.2f}x, LRU "
            f"{r['lru_misses']}): the reactive policy reads more than the optimum"
        )
    if r["io_gbps_stall"] and r["io_gbps_stall"] < 0.8 * seq_gbps:
        reasons.append(
            f"reads ran at {r['io_gbps_stall']:.2f} GB/s while compute waited vs {seq_gbps:.2f} GB/s sequential "
            "(demand reads of one layer's missing experts at a time, no prefetch)"
        )
    if r["stall_fraction"] < 0.5:
        busy_ms = r["tpot_ms"] * (1 - r["stall_fraction"])
        text = f"only {r['stall_fraction']:.0%} of decode time is stall: compute dominates"
        if resident_tpot and busy_ms > 1.1 * resident_tpot:
            text += (
                f" (time not stalled {busy_ms:.0f} ms/token = {busy_ms / resident_tpot:.2f}x the resident TPOT; "
                f"CPU {r['cpu_ms_per_token']:.0f} vs {resident['cpu_ms_per_token']:.0f} ms/token resident: "
                "the excess is streaming's own CPU work or other load on the cores)"
            )
        elif resident_tpot:
            text += f" (time not stalled {busy_ms:.0f} ms/token, resident TPOT {resident_tpot:.0f} ms)"
        reasons.append(text)
    if not reasons:
        reasons.append("no single cause stands out in the counters")
    return f"goal NOT met: TPOT is {ratio:.2f}x the IO lower bound (> {GOAL_RATIO}); " + "; ".join(reasons)


def _summarise_resident(res: dict) -> dict:
    steps = res["step_s"]
    return {
        "tokens": len(steps),
        "decode_s": float(sum(steps)),
        "tpot_ms": float(sum(steps)) * 1e3 / len(steps),
        "tpot_p50_ms": float(np.median(steps)) * 1e3,
        "decode_tok_s": len(steps) / float(sum(steps)),
        "cpu_ms_per_token": float(sum(res["cpu_s"])) * 1e3 / len(steps),
        "cold_tpot_ms": float(sum(res["cold_step_s"])) * 1e3 / len(steps),
        "peak_rss_bytes": res.get("peak_rss_bytes"),
        "logits_sha256": res["logits_sha256"],
    }


def run_workload(
    name: str, model: dict, opts: dict, trace_rows: np.ndarray | None, timeline_path: Path | None, log
) -> dict:
    """Probe, bandwidth, resident and one streamed run per budget for one model."""
    path = model["path"]
    work = opts["out"] / "work"
    n_ctx = opts["warmup"] + opts["tokens"] + 16
    base = {"path": path, "threads": opts["threads"], "n_ctx": n_ctx, "reader": opts["reader"]}
    w: dict = {"name": name, "model": dict(model)}

    probe = launch(
        {**base, "mode": "probe", "budget_bytes": os.path.getsize(path) + GiB}, work, f"{name}-probe"
    )
    if not probe["ok"]:
        raise RuntimeError(f"{name}: probe failed: {probe['error']}")
    info = probe["info"]
    n_layer, n_expert, k = info["n_layer"], info["n_expert"], info["n_expert_used"]
    layout = expert_layout(path)
    w["model"].update(
        {
            "arch": info["arch"],
            "file_bytes": os.path.getsize(path),
            "n_layer": n_layer,
            "n_expert": n_expert,
            "n_expert_used": k,
            "n_vocab": info["n_vocab"],
            "bytes_dense": info["bytes_dense"],
            "bytes_experts": info["bytes_experts"],
            "expert_bytes_per_layer": layout["expert_bytes"],
            "fixed_bytes": probe["fixed_bytes"],
            "slot_bytes": probe["slot_bytes"],
            "reader": probe["reader"],
            "n_ctx": n_ctx,
        }
    )
    kind = "uring" if probe["reader"] == "io_uring" else "pread"
    bw = measure_sequential_bandwidth(path, kind, layout, opts["bw_bytes"], opts["drop_cache"])
    w["sequential_read"] = bw
    log(
        f"{name}: {probe['reader']} sequential read {bw['gbps']:.2f} GB/s ({bw['bytes'] / GiB:.2f} GiB, {bw['cache_drop']})"
    )

    rng = np.random.default_rng(opts["seed"])
    tokens = [int(t) for t in rng.integers(1, info["n_vocab"], size=opts["warmup"] + opts["tokens"])]
    base.update({"tokens": tokens, "warmup": opts["warmup"]})
    if trace_rows is not None:
        rows_path = work / f"{name}-replayed-rows.npy"
        np.save(rows_path, trace_rows)
        base["trace_rows"] = str(rows_path)

    cache_drop = drop_page_cache([path], opts["drop_cache"])
    res = launch({**base, "mode": "resident"}, work, f"{name}-resident")
    if not res["ok"]:
        raise RuntimeError(f"{name}: resident run failed: {res['error']}")
    resident = _summarise_resident(res)
    resident["cache_drop"] = cache_drop
    w["resident"] = resident
    log(f"{name}: resident TPOT {resident['tpot_ms']:.1f} ms (cold pass {resident['cold_tpot_ms']:.1f} ms)")

    total = n_layer * n_expert
    runs = []
    for share in opts["budgets"]:
        n_slots = min(total, max(k, round(share * total)))
        budget = probe["fixed_bytes"] + n_slots * probe["slot_bytes"]
        cfg = {**base, "mode": "stream", "budget_bytes": budget, "n_slots": n_slots}
        if timeline_path is not None and share == opts["budgets"][0]:
            cfg["timeline_path"] = str(timeline_path)
            cfg["timeline_tokens"] = opts["timeline_tokens"]
        label = f"{name}-{share:g}"
        load_before = os.getloadavg()[0]
        with MemoryCap(budget + opts["cap_overhead"], enabled=opts["cap"]) as cap:
            cache_drop = drop_page_cache([path], opts["drop_cache"])
            res = launch(cfg, work, label, cap)
        if not res["ok"]:
            log(f"{label}: FAILED: {res['error']}")
            runs.append(
                {
                    "share": share,
                    "n_slots": n_slots,
                    "budget_bytes": budget,
                    "cap": cap.report(),
                    "error": res["error"],
                }
            )
            continue
        r = _summarise_stream(res, n_layer, n_expert, layout["expert_bytes"], bw["gbps"], resident)
        r["share"] = share
        r["loadavg_1min"] = load_before
        r["cap"] = cap.report()
        r["cache_drop"] = cache_drop
        if "timeline" in res:
            w["timeline"] = res["timeline"]
        if "timeline_note" in res:
            w["timeline_note"] = res["timeline_note"]
        runs.append(r)
        log(
            f"{label}: TPOT {r['tpot_ms']:.1f} ms, hit {r['hit_rate']:.3f}, stall {r['stall_fraction']:.2f}, "
            f"LB {_fmt(r['lower_bound_ms_per_token'], '.1f')} ms, cap {'on' if r['cap']['applied'] else 'off'}"
        )
    w["runs"] = runs
    return w


def _trace_rows(path: Path, start: int, n_rows: int, n_layer: int) -> tuple:
    """Rows [start, start + n_rows) of the trace's experts array, its first n_layer layers; and a note."""
    with np.load(path) as z:
        experts = z["experts"]
    if experts.ndim != 3:
        raise ValueError(f"{path}: 'experts' should be [tokens, layers, top_k], got shape {experts.shape}")
    if start < 0 or start + n_rows > experts.shape[0]:
        raise ValueError(f"{path}: rows {start}..{start + n_rows} are outside its {experts.shape[0]} tokens")
    if experts.shape[1] < n_layer:
        raise ValueError(f"{path}: {experts.shape[1]} layers, the model has {n_layer}")
    rows = np.ascontiguousarray(experts[start : start + n_rows, :n_layer, :], dtype=np.int32)
    note = f"rows {start}..{start + n_rows - 1}"
    if experts.shape[1] > n_layer:
        note += f", first {n_layer} of {experts.shape[1]} layers"
    return rows, note


# ==================================================================================================
# Report
# ==================================================================================================


def _fmt(v, spec: str, none: str = "-") -> str:
    return none if v is None else format(v, spec)


def format_report(doc: dict) -> str:
    lines = []
    for w in doc["workloads"]:
        if "skipped" in w:
            lines.append(f"[{w['name']}] skipped: {w['skipped']}")
            lines.append("")
            continue
        m, bw, res = w["model"], w["sequential_read"], w["resident"]
        lines.append(
            f"[{w['name']}] {m['preset']} {m['quant']} ({m['arch']}, {m['n_layer']} layers x {m['n_expert']} experts, "
            f"top-{m['n_expert_used']}, {m['file_bytes'] / GiB:.2f} GiB; expert {np.mean(m['expert_bytes_per_layer']) / MiB:.2f} MiB, "
            f"slot {m['slot_bytes'] / MiB:.2f} MiB, fixed {m['fixed_bytes'] / GiB:.2f} GiB)"
            + (f", replaying {w['trace']}" if w.get("trace") else "")
        )
        lines.append(
            f"  reader {m['reader']}: sequential {bw['gbps']:.2f} GB/s | resident TPOT {res['tpot_ms']:.1f} ms "
            f"({res['decode_tok_s']:.2f} tok/s, CPU {res['cpu_ms_per_token']:.0f} ms/token; cold pass "
            f"{res['cold_tpot_ms']:.1f} ms) | "
            f"{w['runs'][0]['tokens'] if w['runs'] and 'tokens' in w['runs'][0] else '-'} tokens after a warm-up, page cache: {res['cache_drop']}"
        )
        head = (
            f"  {'share':>5} {'slots':>6} {'budget':>8} {'cap':>9} {'TPOT ms':>8} {'tok/s':>6} {'CPU ms':>6} {'hit':>5} "
            f"{'Belady':>6} {'LRU':>5} {'stall':>5} {'GB/s wall':>9} {'GB/s stall':>10} {'MB/tok':>7} "
            f"{'LB ms':>7} {'TPOT/LB':>7} {'/(LB+res)':>9} {'RSS':>7}"
        )
        lines.append(head)
        for r in w["runs"]:
            cap = r["cap"]
            cap_s = f"{cap['limit_bytes'] / GiB:.2f}G" if cap["applied"] else "none"
            if "error" in r:
                lines.append(
                    f"  {r['share']:>5.0%} {r['n_slots']:>6} {r['budget_bytes'] / GiB:>7.2f}G {cap_s:>9}  FAILED: {r['error']}"
                )
                continue
            lines.append(
                f"  {r['share']:>5.0%} {r['n_slots']:>6} {r['budget_bytes'] / GiB:>7.2f}G {cap_s:>9} "
                f"{r['tpot_ms']:>8.1f} {r['decode_tok_s']:>6.2f} {r['cpu_ms_per_token']:>6.0f} {r['hit_rate']:>5.3f} "
                f"{r['belady_hit_rate']:>6.3f} "
                f"{r['lru_hit_rate']:>5.3f} {r['stall_fraction']:>5.2f} {r['io_gbps_wall']:>9.2f} "
                f"{_fmt(r['io_gbps_stall'], '.2f'):>10} {r['bytes_per_token'] / 1e6:>7.1f} "
                f"{_fmt(r['lower_bound_ms_per_token'], '.1f'):>7} {_fmt(r['ratio_tpot_to_lower_bound'], '.2f'):>7} "
                f"{_fmt(r['ratio_tpot_to_lower_bound_plus_resident'], '.2f'):>9} "
                f"{_fmt(r['peak_rss_bytes'] and r['peak_rss_bytes'] / GiB, '.2f'):>6}G"
            )
        for r in w["runs"]:
            if "verdict" in r:
                lines.append(f"  {r['share']:.0%}: {r['verdict']}")
                checks = []
                if not r["engine_misses_at_least_belady"]:
                    checks.append("engine missed less than Belady (impossible: check the recorded routing)")
                if r["output_matches_resident"] is False:
                    checks.append("logits differ from the resident engine (lossless invariant broken)")
                if r["cap"].get("failcnt"):
                    checks.append(f"the cap was reached {r['cap']['failcnt']} times (page cache reclaimed)")
                if checks:
                    lines.append("       " + "; ".join(checks))
        lines.append("")
    lines.append(
        "CPU ms: process CPU time per token (all threads; below threads x TPOT when the cores are shared or "
        "idle). hit / Belady / LRU: hit rates of the engine's SLRU and of the two policies simulated on the "
        "same accesses. stall: stall time / decode time. GB/s wall: bytes read / decode time; GB/s stall: "
        "bytes read / stall time (above the disk's rate when reads overlap compute). LB: Belady's bytes / "
        "sequential GB/s, per token. res: resident TPOT. RSS: worker peak RSS."
    )
    mach = doc["machine"]
    lines.append(
        f"machine: {mach['cpus']} CPUs, load average {mach['loadavg_start'][0]:.1f} at start, "
        f"{mach.get('loadavg_end', [float('nan')])[0]:.1f} at end"
    )
    t = doc.get("timeline") or {}
    if t.get("path"):
        lines.append(
            f"timeline: {t['path']} ({t['n_events']} spans, lanes: {', '.join(t['lanes'][:6])}{', ...' if len(t['lanes']) > 6 else ''})"
        )
    elif t.get("note"):
        lines.append(f"timeline: {t['note']}")
    lines.append(f"wall time {doc['wall_s']:.0f} s")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    """`sharpi bench`: returns the exit status (0 even when the goal is not met; 1 when a run failed)."""
    t_start = time.perf_counter()
    opts = _resolve_options(args)
    out = opts["out"]
    out.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(f"[bench] {msg}", file=sys.stderr, flush=True)

    doc: dict = {
        "command": " ".join(shlex.quote(a) for a in sys.argv),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_start": os.getloadavg(),
        },
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in opts.items()},
        "goal_ratio": GOAL_RATIO,
        "workloads": [],
    }
    timeline_path = out / "timeline.json"
    timeline_path.unlink(missing_ok=True)

    main_model = ensure_model(opts["model_dir"], opts["preset"], opts["quant"], opts["seed"], {}, log)
    main_model.update({"preset": opts["preset"], "quant": opts["quant"]})
    doc["workloads"].append(run_workload("random", main_model, opts, None, timeline_path, log))

    if opts["trace"] is None:
        log(f"trace replay skipped: {opts['trace_skip']}")
        doc["workloads"].append({"name": "trace", "skipped": opts["trace_skip"]})
    else:
        overrides = QUICK_TRACE_OVERRIDES if opts["quick"] else {}
        tm = ensure_model(opts["model_dir"], TRACE_PRESET, opts["quant"], opts["seed"], overrides, log)
        tm.update({"preset": TRACE_PRESET, "quant": opts["quant"], "overrides": overrides})
        from . import presets

        n_layer = presets.resolve(None, TRACE_PRESET, **overrides).n_layer
        rows, note = _trace_rows(opts["trace"], opts["trace_start"], opts["warmup"] + opts["tokens"], n_layer)
        w = run_workload("trace", tm, opts, rows, None, log)
        w["trace"] = f"{opts['trace']} ({note})"
        doc["workloads"].append(w)

    tl = next((w["timeline"] for w in doc["workloads"] if "timeline" in w), None)
    note = next((w["timeline_note"] for w in doc["workloads"] if "timeline_note" in w), None)
    doc["timeline"] = dict(tl or {}, note=note) if (tl or note) else {"note": "no timeline recorded"}
    if note:
        log(f"timeline: {note}")
    doc["wall_s"] = time.perf_counter() - t_start
    doc["machine"]["loadavg_end"] = os.getloadavg()
    text = format_report(doc)
    sys.stdout.write(text)
    (out / "bench.txt").write_text(text)
    with open(out / "bench.json", "w") as f:
        json.dump(doc, f, indent=1, default=_json_default)
    log(f"wrote {out / 'bench.json'} and {out / 'bench.txt'}")
    failed = any("error" in r for w in doc["workloads"] for r in w.get("runs", []))
    return 1 if failed else 0


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def main(argv: list | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        if len(argv) != 3:
            print("usage: python -m sharpi.bench --worker CONFIG.json RESULT.json", file=sys.stderr)
            return 2
        return _worker(argv[1], argv[2])
    p = argparse.ArgumentParser(prog="sharpi bench", description=__doc__.split("\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
