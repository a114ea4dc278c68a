#!/usr/bin/env python3
"""sharpi side by side with llama.cpp (and ik_llama.cpp when installed) on the same GGUF files.

    PYTHONPATH=python python benchmarks/compare.py --preset olmoe-1b-7b --quant q4_k_m,q8_0 \\
        --model-dir /work/models --out bench-out/compare
    PYTHONPATH=python python benchmarks/compare.py FILE.gguf [FILE.gguf ...] --out bench-out/compare

What it measures, per file and engine, for every prompt length N (default 32 and 512):
  prefill tok/s  N ÷ the time from sending the N prompt tokens to holding the logits of the last,
  decode tok/s   --decode greedy steps after that prompt (argmax of the logits fed back, EOS ignored)
                 ÷ their time, from the first step sent to the logits of the last.
Every engine gets the same token ids (tokenized once with sharpi's tokenizer, cut to N) and the
same thread count (llama.cpp: n_threads and n_threads_batch; n_batch = n_ubatch >= N, so the prompt is
one batch; use_mmap on; its weight repacking as llama.cpp defaults unless --llama-no-repack).

How, so that the engines see the same machine:
  - every measurement is a fresh subprocess (this script with --worker), one engine at a time, so one
    engine's memory, threads and page-table state never meet the other's;
  - the file is read once into the page cache, then each engine does one untimed warm pass (which
    also gives the logits compared in the sanity line); then the engines alternate, A B A B ..., for
    --repeats rounds, and the table shows medians;
  - inside a measurement, one untimed warm-up prompt of min(32, N) tokens runs before the timed one
    (first-touch page faults and thread-pool start are not prefill work).
Next to the speeds: the machine's read bandwidth at the same thread count (the engine's own threads
XOR-summing disjoint slices of a 1 GiB buffer in the widest vector loads the CPU has,
cpu/ops/read_sweep.h; numpy's reductions, also recorded, are compute-bound on some machines and
read low) and the bytes of weights one decoded token touches (dense
weights + n_expert_used/n_expert of every expert tensor + one embedding row), so decode can be read
as a fraction of the bandwidth limit (bytes/token × tok/s ÷ read bandwidth).

Writes OUT/compare.md (the table) and OUT/compare.json (every raw number, per repeat), and the
engines' logs under OUT/logs/. A peer that is not installed or fails is a column that says so.

Extending it (issue 13): an engine is an EngineRunner with measure(file, prompt_ids, n_decode) ->
dict; `wrap` is an argv prefix put before every worker (e.g. a cgroup launcher) and `before_run` a
hook called before each measurement (e.g. dropping the page cache). The table code only reads the
dicts measure() returns.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PROMPT_TEXT = (
    "The history of the printing press begins with movable type in East Asia and continues in Europe, "
    "where Johannes Gutenberg combined a screw press, oil-based ink and metal type cast in a hand mould. "
    "Within fifty years printers worked in more than two hundred cities; books became cheaper, spelling "
    "settled, and scholars could compare the same page in distant libraries. "
)
STATUS_OK = "ok"
STATUS_NOT_INSTALLED = "not installed"
STATUS_FAILED = "failed"


# ------------------------------------------------------------------------------------------------
# Engine runners: one interface, one subprocess per measurement
# ------------------------------------------------------------------------------------------------


class EngineRunner:
    """One engine. measure() runs one fresh worker process and returns its result dict:
    status ("ok" | "failed" | "not installed"), reason, and on success prefill_tok_s, decode_tok_s,
    prefill_s, decode_s, load_s, n_prompt, n_decode, tokens (the greedy tokens), top5 (ids of the
    prefill logits' five largest), plus engine settings.

    Subclasses set key/label/module and implement worker_main(spec) (runs inside the worker).
    wrap: argv prefix for the worker (issue 13's memory cap). before_run: called before each run."""

    key = "engine"
    label = "engine"
    module = None  # Python module the engine needs; None: always available
    worker_script = None  # the script whose --worker runs this engine (None: this file)

    def __init__(self, threads: int, n_ctx: int, log_dir: Path, timeout_s: float = 3600.0,
                 wrap: list | None = None, before_run=None, env: dict | None = None, kv_type: str = "f16",
                 decode_segments: int = 1):
        self.threads = threads
        self.decode_segments = decode_segments  # timed_greedy's segments
        self.kv_type = kv_type  # the KV cache's stored type for K and V, llama.cpp's names
        self.n_ctx = n_ctx
        self.log_dir = Path(log_dir)
        self.timeout_s = timeout_s
        self.wrap = list(wrap or [])
        self.before_run = before_run
        self.env = dict(env or {})
        self.n_runs = 0
        self._probe = None

    def options(self) -> dict:
        """Engine settings passed to the worker and recorded in the JSON."""
        return {}

    def child_env(self) -> dict:
        env = dict(os.environ)
        env.update(self.env)
        return env

    def probe(self) -> dict:
        """{"status": "ok" | "not installed", "reason", "version"}; imports the module in a subprocess."""
        if self._probe is not None:
            return self._probe
        if self.module is None:
            self._probe = {"status": STATUS_OK, "reason": "", "version": None}
            return self._probe
        code = (f"import {self.module} as m, json; "
                "print(json.dumps({'version': getattr(m, '__version__', None), 'file': m.__file__}))")
        r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, env=self.child_env(),
                           timeout=300)
        if r.returncode != 0:
            last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
            self._probe = {"status": STATUS_NOT_INSTALLED, "reason": f"import {self.module}: {last}",
                           "version": None}
        else:
            info = json.loads(r.stdout.strip().splitlines()[-1])
            self._probe = {"status": STATUS_OK, "reason": "", **info}
        return self._probe

    def measure(self, file, prompt_ids, n_decode: int, save_logits=None, tag: str = "") -> dict:
        probe = self.probe()
        if probe["status"] != STATUS_OK:
            return {"status": probe["status"], "reason": probe["reason"]}
        if self.before_run is not None:
            self.before_run(self, file)
        self.n_runs += 1
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{self.key}-{Path(file).stem}-{tag or self.n_runs}.log"
        with tempfile.TemporaryDirectory(prefix="sharpi-compare-") as tmp:
            spec = {
                "engine": self.key, "file": os.fspath(file), "prompt_ids": [int(t) for t in prompt_ids],
                "n_decode": int(n_decode), "threads": self.threads, "n_ctx": self.n_ctx,
                "kv_type": self.kv_type, "decode_segments": self.decode_segments, "options": self.options(),
                "result": os.path.join(tmp, "result.json"),
                "logits": os.fspath(save_logits) if save_logits else None,
            }
            spec_path = os.path.join(tmp, "spec.json")
            with open(spec_path, "w") as fh:
                json.dump(spec, fh)
            script = self.worker_script or Path(__file__).resolve()
            argv = self.wrap + [sys.executable, os.fspath(script), "--worker", spec_path]
            load_before = os.getloadavg()[0]
            ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.perf_counter()
            try:
                with open(log_path, "w") as log:
                    proc = subprocess.run(argv, check=False, stdout=log, stderr=subprocess.STDOUT, env=self.child_env(),
                                          timeout=self.timeout_s)
                rc = proc.returncode
            except subprocess.TimeoutExpired:
                rc = None
            wall = time.perf_counter() - t0
            ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            # CPU seconds of the worker (user + system), load average before it: on a shared machine
            # these tell a slow run from a starved one (a spin-waiting pool burns CPU while it waits).
            usage = {"cpu_s": (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime),
                     "loadavg_before": load_before, "wall_s": wall}
            result = None
            if os.path.exists(spec["result"]):
                with open(spec["result"]) as fh:
                    result = json.load(fh)
        if rc == 0 and result is not None:
            result.update(status=STATUS_OK, reason="", log=os.fspath(log_path), **usage)
            return result
        if rc is None:
            why = f"timed out after {self.timeout_s:.0f} s"
        elif rc < 0:
            why = f"killed by signal {-rc}"
        else:
            why = f"exit status {rc}"
        tail = _tail(log_path)
        return {"status": STATUS_FAILED, "reason": f"{why}: {tail}" if tail else why, "exit_status": rc,
                "log": os.fspath(log_path), **usage}

    # -- inside the worker --------------------------------------------------------------------
    @classmethod
    def worker_main(cls, spec: dict) -> dict:
        raise NotImplementedError


def _tail(path, n: int = 3) -> str:
    try:
        lines = [ln.strip() for ln in Path(path).read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return " | ".join(lines[-n:])[-400:]


def timed_greedy(prefill, step, reset, prompt_ids: list, n_decode: int, warmup: bool = True,
                 segments: int = 1) -> dict:
    """The timed part, shared by every engine: prefill(ids) -> logits of the last id, step(id) ->
    logits, reset() clears the sequence. One untimed warm-up prompt first (min(32, N) tokens and one
    step), then prefill and `segments` runs of n_decode greedy steps, each timed from the first token
    sent to the last logits returned. With segments > 1, decode_tok_s is the median of the segments'
    rates (one long prefill, several decode samples at nearly the same context length: how long-context
    decode gets a median of 3 without paying for three prefills)."""
    n = len(prompt_ids)
    if warmup:
        logits = prefill(prompt_ids[: min(32, n)])
        step(int(np.argmax(logits)))
        reset()
    t0 = time.perf_counter()
    logits = prefill(prompt_ids)
    t_prefill = time.perf_counter() - t0
    first = np.array(logits, dtype=np.float32, copy=True)
    token = int(np.argmax(logits))
    tokens = [token]
    segment_s = []
    for _ in range(max(1, segments)):
        t1 = time.perf_counter()
        for _ in range(n_decode):
            logits = step(token)
            token = int(np.argmax(logits))
            tokens.append(token)
        segment_s.append(time.perf_counter() - t1)
    rates = [n_decode / t for t in segment_s] if n_decode else []
    return {
        "n_prompt": n, "n_decode": n_decode * len(segment_s),
        "prefill_s": t_prefill, "decode_s": sum(segment_s),
        "prefill_tok_s": n / t_prefill, "decode_tok_s": statistics.median(rates) if rates else None,
        "segment_decode_tok_s": rates,
        "tokens": tokens, "top5": [int(i) for i in np.argsort(-first)[:5]],
        "logits_finite": bool(np.isfinite(first).all()), "logits_std": float(np.std(first)),
        "_first_logits": first,
    }


class SharpiRunner(EngineRunner):
    key = "sharpi"
    label = "sharpi"

    def __init__(self, *a, exact: bool = False, **kw):
        super().__init__(*a, **kw)
        self.exact = exact
        if exact:
            self.key, self.label = "sharpi_exact", "sharpi (exact)"

    def options(self) -> dict:
        return {"exact": self.exact}

    def child_env(self) -> dict:
        env = super().child_env()
        python_dir = os.fspath(REPO / "python")
        if developer_build() and python_dir not in env.get("PYTHONPATH", "").split(os.pathsep):
            env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), python_dir) if p)
        return env

    @classmethod
    def worker_main(cls, spec: dict) -> dict:
        import sharpi

        t0 = time.perf_counter()
        kv = spec.get("kv_type", "f16")
        s = sharpi.Session(spec["file"], threads=spec["threads"], n_ctx=spec["n_ctx"],
                           exact=spec["options"]["exact"], cache_type_k=kv, cache_type_v=kv,
                           allow_long_context=True)  # as llama.cpp, which only warns past the trained context
        load_s = time.perf_counter() - t0
        r = timed_greedy(lambda ids: s.decode(ids), lambda t: s.decode([t]), s.reset,
                         spec["prompt_ids"], spec["n_decode"], segments=spec.get("decode_segments", 1))
        r.update(load_s=load_s, version=sharpi.__version__ if hasattr(sharpi, "__version__") else None,
                 settings={"threads": spec["threads"], "n_ctx": spec["n_ctx"], "kv_type": kv, **spec["options"]})
        return r


class LlamaCppRunner(EngineRunner):
    """llama.cpp through llama-cpp-python's low-level API (the ctypes mirror of llama.h): the ids
    go in one llama_batch, logits only for the last, KV cleared between warm-up and timed prompt."""

    key = "llama_cpp"
    label = "llama.cpp"
    module = "llama_cpp"
    lowlevel = "llama_cpp"  # the module with llama.h's functions and structs
    n_gpu_layers = 0  # CPU only (bench_cuda.py's runner offloads every layer)

    def __init__(self, *a, no_repack: bool = False, **kw):
        super().__init__(*a, **kw)
        self.no_repack = no_repack

    def options(self) -> dict:
        return {"module": self.module, "lowlevel": self.lowlevel, "no_repack": self.no_repack, "env": self.env}

    @classmethod
    def configure_model_params(cls, L, mp, spec: dict, settings: dict):
        """A subclass's changes to llama_model_params before the load (bench_cuda.py's --n-cpu-moe);
        returns what must stay alive until the model is loaded."""
        return ()

    @classmethod
    def worker_main(cls, spec: dict) -> dict:
        import ctypes
        import importlib

        L = importlib.import_module(spec["options"]["lowlevel"])
        version = getattr(importlib.import_module(spec["options"]["module"]), "__version__", None)
        n_max = max(len(spec["prompt_ids"]), 32)
        threads = spec["threads"]

        def pick(*names):
            for name in names:
                if hasattr(L, name):
                    return getattr(L, name)
            raise AttributeError(f"{L.__name__} has none of {names}")

        L.llama_backend_init()
        mp = L.llama_model_default_params()
        mp.use_mmap = True
        mp.n_gpu_layers = cls.n_gpu_layers
        settings = {"threads": threads, "n_ctx": spec["n_ctx"], "n_batch": n_max, "n_ubatch": n_max,
                    "use_mmap": True}
        # Weight repacking: llama.cpp's "extra buffer types" (use_extra_bufts), ik_llama.cpp's
        # repack_tensors. Off keeps the weights in the mapped file (needed under a memory cap).
        repack_field = next((f for f in ("use_extra_bufts", "repack_tensors") if hasattr(mp, f)), None)
        if spec["options"]["no_repack"]:
            if repack_field is None:
                raise RuntimeError(f"{L.__name__}: llama_model_params has no use_extra_bufts/repack_tensors "
                                   "(cannot turn weight repacking off)")
            setattr(mp, repack_field, False)
        if repack_field is not None:
            settings[repack_field] = bool(getattr(mp, repack_field))
        keep_alive = cls.configure_model_params(L, mp, spec, settings)  # noqa: F841  (read by the load below)
        t0 = time.perf_counter()
        model = pick("llama_model_load_from_file", "llama_load_model_from_file")(spec["file"].encode(), mp)
        if not model:
            raise RuntimeError(f"{L.__name__} could not load {spec['file']} (see the log above)")
        cp = L.llama_context_default_params()
        cp.n_ctx = spec["n_ctx"]
        cp.n_batch = n_max
        cp.n_ubatch = n_max
        cp.n_threads = threads
        cp.n_threads_batch = threads
        kv = spec.get("kv_type", "f16")
        cp.type_k = cp.type_v = GGML_KV_TYPES[kv]
        settings["kv_type"] = kv
        for field in ("flash_attn_type", "flash_attn", "type_k", "type_v"):  # recorded as llama.cpp chose
            if hasattr(cp, field):
                settings[field] = int(getattr(cp, field))
        ctx = pick("llama_init_from_model", "llama_new_context_with_model")(model, cp)
        if not ctx:
            raise RuntimeError(f"{L.__name__} could not create a context")
        load_s = time.perf_counter() - t0
        if hasattr(L, "llama_model_get_vocab") and hasattr(L, "llama_vocab_n_tokens"):
            n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
        else:
            n_vocab = pick("llama_n_vocab")(model)
        batch = L.llama_batch_init(n_max, 0, 1)
        n_past = [0]

        def run(ids):
            batch.n_tokens = len(ids)
            for i, t in enumerate(ids):
                batch.token[i] = t
                batch.pos[i] = n_past[0] + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = i == len(ids) - 1
            rc = L.llama_decode(ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
            n_past[0] += len(ids)
            ptr = L.llama_get_logits_ith(ctx, len(ids) - 1)
            return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(n_vocab,))

        def reset():
            if hasattr(L, "llama_memory_clear") and hasattr(L, "llama_get_memory"):
                L.llama_memory_clear(L.llama_get_memory(ctx), True)
            else:
                pick("llama_kv_self_clear", "llama_kv_cache_clear")(ctx)
            n_past[0] = 0

        r = timed_greedy(run, lambda t: run([t]), reset, spec["prompt_ids"], spec["n_decode"],
                         segments=spec.get("decode_segments", 1))
        sysinfo = L.llama_print_system_info() if hasattr(L, "llama_print_system_info") else b""
        r.update(load_s=load_s, version=version, settings=settings,
                 system_info=sysinfo.decode() if isinstance(sysinfo, bytes) else str(sysinfo))
        L.llama_batch_free(batch)
        return r


class IkLlamaRunner(LlamaCppRunner):
    """ik_llama.cpp (package ik-llama-cpp-python): its _ctypes_api mirrors ik_llama.cpp's llama.h
    (older names: llama_kv_cache_clear; repack_tensors for repacking)."""

    key = "ik_llama_cpp"
    label = "ik_llama.cpp"
    module = "ik_llama_cpp"
    lowlevel = "ik_llama_cpp._ctypes_api"


# ggml_type values of the KV cache types both engines accept (ggml.h).
GGML_KV_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8}


def process_memory() -> dict:
    """This process's memory from /proc/self/status, in bytes: peak resident set (VmHWM), and the
    resident anonymous and file-backed parts now (RssAnon is what the engine allocated; RssFile is
    mapped file pages, which the page cache can drop)."""
    out = {}
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key in ("VmHWM", "RssAnon", "RssFile"):
                    out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


WORKERS = {"sharpi": SharpiRunner, "sharpi_exact": SharpiRunner, "llama_cpp": LlamaCppRunner,
           "ik_llama_cpp": IkLlamaRunner}


def worker(spec_path: str) -> int:
    with open(spec_path) as fh:
        spec = json.load(fh)
    r = WORKERS[spec["engine"]].worker_main(spec)
    r["memory"] = process_memory()
    first = r.pop("_first_logits")
    if spec.get("logits"):
        np.save(spec["logits"], first)
    with open(spec["result"], "w") as fh:
        json.dump(r, fh)
    return 0


# ------------------------------------------------------------------------------------------------
# Machine and file facts
# ------------------------------------------------------------------------------------------------


def read_bandwidth_gbps(threads: int, size_bytes: int = 1 << 30, repeats: int = 3) -> dict:
    """Bytes read per second by `threads` threads, each reading its own slice of one buffer: the
    engine's SIMD read loop (the limit decode is divided by) and, for reference, numpy reductions
    (numpy releases the GIL in these loops), best of the repeats each."""
    from sharpi import _internal

    simd = _internal.read_bandwidth(threads, size_bytes, max(repeats, 3))
    buf = np.ones(size_bytes // 8, dtype=np.int64)
    parts = np.array_split(buf, threads)
    kernels = {"int64 sum": lambda p: p.sum(),
               "float32 dot": lambda p: np.dot(p.view(np.float32), p.view(np.float32))}
    per_kernel = {}
    for name, fn in kernels.items():
        best = float("inf")
        for _ in range(repeats):
            ths = [threading.Thread(target=fn, args=(p,)) for p in parts]
            t0 = time.perf_counter()
            for t in ths:
                t.start()
            for t in ths:
                t.join()
            best = min(best, time.perf_counter() - t0)
        per_kernel[f"numpy {name}"] = size_bytes / best / 1e9
    del buf, parts
    per_kernel[f"simd read loop ({simd['isa']})"] = simd["gbps"]
    return {"gbps": simd["gbps"], "kernel": f"simd read loop ({simd['isa']})", "per_kernel_gbps": per_kernel,
            "threads": threads, "buffer_bytes": size_bytes}


def file_facts(path) -> dict:
    """Bytes of weights touched per decoded token: dense weights + n_expert_used/n_expert of every
    expert tensor + one row of token_embd (the whole of it when it is also the output matrix)."""
    from sharpi import _core

    f = _core.GgufFile(os.fspath(path), map_data=False)
    md = f.metadata()
    arch = md["general.architecture"]
    n_expert = int(md.get(f"{arch}.expert_count", 0) or 0)
    k = int(md.get(f"{arch}.expert_used_count", 0) or 0)
    tensors = f.tensors()
    names = {t["name"] for t in tensors}
    dense = experts = embd_row = 0.0
    for t in tensors:
        if "_exps." in t["name"] and n_expert:
            experts += t["nbytes"]
        elif t["name"] == "token_embd.weight" and "output.weight" in names:
            embd_row += t["nbytes"] / t["shape"][1]
        else:
            dense += t["nbytes"]
    touched = dense + embd_row + (experts * k / n_expert if n_expert else 0.0)
    return {"arch": arch, "file_bytes": os.path.getsize(path), "n_expert": n_expert, "n_expert_used": k,
            "dense_bytes": dense, "expert_bytes": experts, "bytes_per_token": touched,
            "file_type": md.get("general.file_type"), "n_vocab": len(md.get("tokenizer.ggml.tokens", []))}


def prompt_ids_for(path, lengths: list) -> tuple:
    """Token ids of PROMPT_TEXT (repeated as needed) from sharpi's tokenizer, cut to each length;
    seeded random ids when the file's tokenizer cannot encode it."""
    from sharpi import _core
    from sharpi.tokenizer import Tokenizer

    md = _core.GgufFile(os.fspath(path), map_data=False).metadata()
    n_max = max(lengths)
    try:
        tok = Tokenizer.from_metadata(md)
        text = PROMPT_TEXT
        ids = tok.encode(text)
        while len(ids) < n_max:
            text += PROMPT_TEXT
            ids = tok.encode(text)
        source = "sharpi tokenizer"
    except Exception as e:  # noqa: BLE001 - any tokenizer failure falls back to random ids
        n_vocab = len(md.get("tokenizer.ggml.tokens", [])) or 1000
        ids = np.random.default_rng(0).integers(10, n_vocab - 10, size=n_max).tolist()
        source = f"random ids (tokenizer: {e})"
    return {n: [int(t) for t in ids[:n]] for n in lengths}, source


def warm_page_cache(path) -> float:
    """Reads the whole file once (so every engine starts from the same, warm, page cache); seconds."""
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as fh:
        while fh.read(16 << 20):
            pass
    return time.perf_counter() - t0


def ensure_model(model_dir: Path, preset: str, quant: str) -> Path:
    path = model_dir / f"{preset}-{quant}.gguf"
    if not path.exists():
        from sharpi.make_model import write_model

        model_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".gguf.part")
        t0 = time.perf_counter()
        print(f"compare: writing {path} (sharpi make-model --preset {preset} --quant {quant})", file=sys.stderr)
        write_model(tmp, preset=preset, quant=quant, seed=0)
        os.replace(tmp, path)
        print(f"compare: wrote {path} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return path


# ------------------------------------------------------------------------------------------------
# The run and the table
# ------------------------------------------------------------------------------------------------


def median_or_none(values: list):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(runs: list, metric: str) -> dict:
    ok = [r for r in runs if r.get("status") == STATUS_OK]
    if ok and len(ok) == len(runs):
        return {"status": STATUS_OK, "median": median_or_none([r[metric] for r in ok]),
                "values": [r[metric] for r in ok]}
    bad = next((r for r in runs if r.get("status") != STATUS_OK), {"status": STATUS_FAILED, "reason": "no run"})
    return {"status": bad["status"], "reason": bad.get("reason", ""), "median": None,
            "values": [r.get(metric) for r in ok]}


def logits_agreement(ref: np.ndarray, other: np.ndarray) -> dict:
    return {
        "rel_l2": float(np.linalg.norm(other - ref) / max(np.linalg.norm(ref), 1e-30)),
        "max_abs": float(np.max(np.abs(other - ref))),
        "top1_same": bool(int(np.argmax(ref)) == int(np.argmax(other))),
        "top5_overlap": len(set(np.argsort(-ref)[:5].tolist()) & set(np.argsort(-other)[:5].tolist())),
    }


def greedy_prefix(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def run_file(path: Path, runners: list, lengths: list, n_decode: int, repeats: int, out: Path,
             bandwidth_gbps: float) -> dict:
    facts = file_facts(path)
    prompts, source = prompt_ids_for(path, lengths)
    entry = {"file": os.fspath(path), "name": path.name, **facts, "prompt_source": source,
             "page_cache_read_s": warm_page_cache(path), "engines": {}}
    stem = path.stem
    # Untimed warm pass per engine: also the logits for the sanity check.
    warm = {}
    for r in runners:
        logits_path = out / "logits" / f"{stem}-{r.key}.npy"
        logits_path.parent.mkdir(parents=True, exist_ok=True)
        res = r.measure(path, prompts[lengths[0]], n_decode, save_logits=logits_path, tag="warm")
        warm[r.key] = (res, logits_path)
        print(f"compare: {path.name} warm {r.label}: {res['status']} {res.get('reason', '')}", file=sys.stderr)
    runs = {r.key: {n: [] for n in lengths} for r in runners}
    for rep in range(repeats):
        for n in lengths:
            for r in runners:  # A B A B ...
                res = r.measure(path, prompts[n], n_decode, tag=f"p{n}-r{rep}")
                runs[r.key][n].append(res)
                if res["status"] == STATUS_NOT_INSTALLED:
                    continue
                if res["status"] == STATUS_OK:
                    mem = res.get("memory", {})
                    msg = (f"prefill {res['prefill_tok_s']:.1f} tok/s, decode {res['decode_tok_s']:.2f} tok/s, "
                           f"peak RSS {mem.get('VmHWM', 0) / 2**30:.2f} GiB (anon {mem.get('RssAnon', 0) / 2**30:.2f})")
                else:
                    msg = f"{res['status']} {res.get('reason', '')}"
                print(f"compare: {path.name} repeat {rep + 1}/{repeats} prompt {n} {r.label}: {msg}",
                      file=sys.stderr)
    ref_key = runners[0].key
    for r in runners:
        w, logits_path = warm[r.key]
        e = {"label": r.label, "probe": r.probe(), "options": r.options(), "warm": _strip(w), "prompts": {}}
        for n in lengths:
            p = {"runs": [_strip(x) for x in runs[r.key][n]],
                 "prefill_tok_s": summarize(runs[r.key][n], "prefill_tok_s"),
                 "decode_tok_s": summarize(runs[r.key][n], "decode_tok_s")}
            d = p["decode_tok_s"]["median"]
            p["decode_fraction_of_read_limit"] = (d * facts["bytes_per_token"] / (bandwidth_gbps * 1e9)
                                                  if d else None)
            e["prompts"][str(n)] = p
        if r.key != ref_key and w["status"] == STATUS_OK and warm[ref_key][0]["status"] == STATUS_OK:
            agree = logits_agreement(np.load(warm[ref_key][1]), np.load(logits_path))
            agree["greedy_same_prefix"] = greedy_prefix(warm[ref_key][0]["tokens"], w["tokens"])
            agree["greedy_len"] = len(w["tokens"])
            e["vs_" + ref_key] = agree
        entry["engines"][r.key] = e
    # Ratios: reference engine (sharpi) ÷ each peer, of the medians.
    entry["ratios"] = {}
    ref = entry["engines"][ref_key]["prompts"]
    for r in runners[1:]:
        peer = entry["engines"][r.key]["prompts"]
        entry["ratios"][r.key] = {}
        for n in lengths:
            rr = {}
            for metric in ("prefill_tok_s", "decode_tok_s"):
                a, b = ref[str(n)][metric]["median"], peer[str(n)][metric]["median"]
                rr[metric] = a / b if a and b else None
            entry["ratios"][r.key][str(n)] = rr
    return entry


def _strip(res: dict) -> dict:
    return {k: v for k, v in res.items() if not k.startswith("_")}


def _fmt(v, spec=".1f") -> str:
    return "–" if v is None else format(v, spec)


def render_table(report: dict) -> str:
    cfg = report["config"]
    bw = report["read_bandwidth"]
    engines = report["engines"]  # [{key, label}]
    ref = engines[0]
    peers = engines[1:]
    plural = "s" if cfg["threads"] != 1 else ""
    title = (f"# sharpi vs peers — {cfg['threads']} thread{plural}, {cfg['n_decode']} decode tokens, "
             f"median of {cfg['repeats']} alternating runs")
    numpy_best = max((v for k, v in bw.get("per_kernel_gbps", {}).items() if k.startswith("numpy")), default=None)
    numpy_note = f"; numpy's reductions {numpy_best:.1f} GB/s" if numpy_best is not None else ""
    machine = (f"read bandwidth ({bw['threads']} thread{plural}, {bw.get('kernel', 'numpy')}): {bw['gbps']:.1f} "
               f"GB/s (best of "
               f"{bw['start_gbps']:.1f} before and {bw['end_gbps']:.1f} after the runs{numpy_note}); load average "
               f"{report['loadavg_start'][0]:.2f} at start, {report['loadavg_end'][0]:.2f} at end; "
               f"{report['machine']}")
    lines = [title, "", machine, ""]
    head = ["file", "measure", ref["label"]]
    for p in peers:
        head += [p["label"], f"{ref['label']} ÷ {p['label']}"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes = []
    for f in report["files"]:
        first = True
        for n in cfg["prompts"]:
            for metric, name in (("prefill_tok_s", f"prefill {n} tok/s"), ("decode_tok_s", f"decode tok/s @{n}")):
                row = [f["name"] if first else "", name]
                first = False
                row.append(_cell(f["engines"][ref["key"]]["prompts"][str(n)][metric], notes))
                for p in peers:
                    row.append(_cell(f["engines"][p["key"]]["prompts"][str(n)][metric], notes))
                    row.append(_fmt(f["ratios"][p["key"]][str(n)][metric], ".2f"))
                lines.append("| " + " | ".join(row) + " |")
            row = ["", f"decode @{n} ÷ read limit"]
            row.append(_fmt(f["engines"][ref["key"]]["prompts"][str(n)]["decode_fraction_of_read_limit"], ".2f"))
            for p in peers:
                row += [_fmt(f["engines"][p["key"]]["prompts"][str(n)]["decode_fraction_of_read_limit"], ".2f"), ""]
            lines.append("| " + " | ".join(row) + " |")
    lines += ["", "| file | arch | MB touched / token (dense + experts) | read limit tok/s | prompt ids |",
              "|---|---|---|---|---|"]
    for f in report["files"]:
        k, e = f["n_expert_used"], f["n_expert"]
        exp = f["expert_bytes"] * k / e if e else 0
        lines.append(f"| {f['name']} | {f['arch']} | {f['bytes_per_token'] / 1e6:.0f} "
                     f"({(f['bytes_per_token'] - exp) / 1e6:.0f} + {exp / 1e6:.0f}, {k} of {e} experts) | "
                     f"{bw['gbps'] * 1e9 / f['bytes_per_token']:.1f} | {f['prompt_source']} |")
    sanity = []
    for f in report["files"]:
        for p in peers:
            a = f["engines"][p["key"]].get("vs_" + ref["key"])
            if a:
                sanity.append(f"- {f['name']}: {p['label']} vs {ref['label']} logits after the "
                              f"{cfg['prompts'][0]}-token prompt: rel. L2 {a['rel_l2']:.3g}, top-1 "
                              f"{'same' if a['top1_same'] else 'DIFFERENT'}, top-5 overlap {a['top5_overlap']}/5, "
                              f"greedy tokens equal for {a['greedy_same_prefix']} of {a['greedy_len']}")
    if sanity:
        lines += ["", "Logits sanity (untimed warm pass):", *sanity]
    if notes:
        lines += ["", *[f"[{i + 1}] {t}" for i, t in enumerate(notes)]]
    return "\n".join(lines) + "\n"


def _cell(summary: dict, notes: list) -> str:
    if summary["status"] == STATUS_OK:
        return _fmt(summary["median"], ".2f" if summary["median"] < 100 else ".0f")
    if summary["status"] == STATUS_NOT_INSTALLED:
        return STATUS_NOT_INSTALLED
    reason = summary.get("reason", "")
    if reason not in notes:
        notes.append(reason)
    return f"{summary['status']} [{notes.index(reason) + 1}]"


def int_at_least(minimum: int):
    def parse(text: str) -> int:
        v = int(text)
        if v < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {v}")
        return v

    return parse


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="*", metavar="FILE", help="GGUF files to compare on")
    ap.add_argument("--preset", default=None, help="sharpi make-model preset (e.g. olmoe-1b-7b), with --quant")
    ap.add_argument("--quant", default="q4_k_m", help="comma-separated quants for --preset (default: q4_k_m)")
    ap.add_argument("--model-dir", default=os.environ.get("SHARPI_MODEL_DIR", "~/.cache/sharpi/models"),
                    help="where --preset files are written once and reused (default: $SHARPI_MODEL_DIR or "
                         "~/.cache/sharpi/models)")
    ap.add_argument("--threads", type=int_at_least(1), default=2)
    ap.add_argument("--prompts", default="32,512", help="comma-separated prompt lengths (default: 32,512)")
    ap.add_argument("--decode", type=int_at_least(1), default=32, help="greedy decode steps (default: 32)")
    ap.add_argument("--n-ctx", type=int, default=0, help="context size (default: longest prompt + decode + 16)")
    ap.add_argument("--repeats", type=int_at_least(3), default=3, help="alternating rounds (>= 3; default 3)")
    ap.add_argument("--engines", default="sharpi,llama.cpp,ik_llama.cpp",
                    help="engines (sharpi, sharpi-exact, llama.cpp, ik_llama.cpp); the first is the numerator of "
                         "every ratio (default: sharpi,llama.cpp,ik_llama.cpp)")
    ap.add_argument("--kv-type", choices=sorted(GGML_KV_TYPES), default="f16",
                    help="KV cache type of K and V for every engine (default f16, both engines' default)")
    ap.add_argument("--rewarm", action="store_true",
                    help="read the file into the page cache again before every run (for files near RAM size)")
    ap.add_argument("--sharpi-exact", action="store_true", help="sharpi in exact mode (Session(exact=True))")
    ap.add_argument("--llama-no-repack", action="store_true",
                    help="llama.cpp (and ik_llama.cpp) with weight repacking off (use_extra_bufts=False)")
    ap.add_argument("--llama-env", action="append", default=[], metavar="KEY=VALUE",
                    help="environment for the llama.cpp/ik_llama.cpp workers only, e.g. OMP_WAIT_POLICY=passive "
                         "(repeatable)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds one measurement may take")
    ap.add_argument("--bw-bytes", type=int, default=1 << 30, help="buffer for the read-bandwidth loop")
    ap.add_argument("--out", default="bench-out/compare", help="folder for compare.md, compare.json, logs")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return ap


def make_runners(args, n_ctx: int, log_dir: Path) -> list:
    """--engines names -> runners. "sharpi" follows --sharpi-exact; "sharpi-exact" is always exact
    mode (a peer column: fast ÷ exact once the fast kernels land)."""
    llama_env = {}
    for item in args.llama_env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"compare: --llama-env wants KEY=VALUE, got {item!r}")
        llama_env[key] = value
    common = {"timeout_s": args.timeout, "kv_type": args.kv_type}
    if args.rewarm:
        # A peer that copies the weights into its own memory (llama.cpp's repacking) pushes the file
        # out of the page cache when it and the file do not both fit; re-reading before every run
        # gives each engine the same warm start.
        common["before_run"] = lambda runner, file: warm_page_cache(file)
    engines = {
        "sharpi": lambda: SharpiRunner(args.threads, n_ctx, log_dir, exact=args.sharpi_exact, **common),
        "sharpi-exact": lambda: SharpiRunner(args.threads, n_ctx, log_dir, exact=True, **common),
        "llama.cpp": lambda: LlamaCppRunner(args.threads, n_ctx, log_dir, no_repack=args.llama_no_repack,
                                            env=llama_env, **common),
        "ik_llama.cpp": lambda: IkLlamaRunner(args.threads, n_ctx, log_dir, no_repack=args.llama_no_repack,
                                              env=llama_env, **common),
    }
    runners = []
    for name in [e.strip() for e in args.engines.split(",") if e.strip()]:
        if name not in engines:
            raise SystemExit(f"compare: unknown engine {name!r} (known: {', '.join(engines)})")
        runners.append(engines[name]())
    if len({r.key for r in runners}) != len(runners):
        raise SystemExit(f"compare: an engine is named twice in --engines {args.engines}")
    return runners


def developer_build() -> bool:
    """Whether this checkout's python/sharpi holds a compiled _core (a developer build). Only then is
    python/ put on the path; otherwise sharpi is the installed package, and the checkout's python/
    (sources without _core) must not shadow it."""
    return any((REPO / "python" / "sharpi").glob("_core*.so"))


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        return worker(args.worker)
    if developer_build():
        sys.path.insert(0, os.fspath(REPO / "python"))
    lengths = [int(x) for x in args.prompts.split(",") if x.strip()]
    if not lengths or min(lengths) < 1:
        raise SystemExit("compare: --prompts needs positive lengths")
    files = [Path(f).expanduser() for f in args.files]
    if args.preset:
        model_dir = Path(args.model_dir).expanduser()
        files += [ensure_model(model_dir, args.preset, q.strip()) for q in args.quant.split(",") if q.strip()]
    if not files:
        raise SystemExit("compare: give GGUF files or --preset")
    for f in files:
        if not f.is_file():
            raise SystemExit(f"compare: {f}: no such file")
    n_ctx = args.n_ctx or max(lengths) + args.decode + 16
    if n_ctx < max(lengths) + args.decode + 1:
        raise SystemExit(f"compare: --n-ctx {n_ctx} is smaller than the longest prompt + decode")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runners = make_runners(args, n_ctx, out / "logs")
    for r in runners:
        p = r.probe()
        print(f"compare: {r.label}: {p['status']} {p.get('version') or ''} {p.get('reason', '')}", file=sys.stderr)
    if runners[0].probe()["status"] != STATUS_OK:
        raise SystemExit(f"compare: the reference engine {runners[0].label} is not available")

    report = {
        "config": {"threads": args.threads, "prompts": lengths, "n_decode": args.decode, "n_ctx": n_ctx,
                   "repeats": args.repeats, "sharpi_exact": args.sharpi_exact,
                   "llama_no_repack": args.llama_no_repack, "kv_type": args.kv_type, "rewarm": args.rewarm, "llama_env": args.llama_env, "argv": sys.argv[1:] if argv is None else list(argv)},
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {_cpu_model()}",
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "loadavg_start": list(os.getloadavg()),
        "engines": [{"key": r.key, "label": r.label, "probe": r.probe()} for r in runners],
    }
    # Read bandwidth before and after the runs; the limit uses the better of the two (on a shared
    # machine a busy moment only ever lowers it).
    bw_start = read_bandwidth_gbps(args.threads, args.bw_bytes)
    print(f"compare: read bandwidth {bw_start['gbps']:.1f} GB/s ({args.threads} threads)", file=sys.stderr)
    report["files"] = [run_file(f, runners, lengths, args.decode, args.repeats, out, bw_start["gbps"])
                       for f in files]
    report["loadavg_end"] = list(os.getloadavg())
    bw_end = read_bandwidth_gbps(args.threads, args.bw_bytes)
    best = max(bw_start, bw_end, key=lambda b: b["gbps"])
    report["read_bandwidth"] = {**best, "start_gbps": bw_start["gbps"], "end_gbps": bw_end["gbps"]}
    for f in report["files"]:
        for e in f["engines"].values():
            for p in e["prompts"].values():
                d = p["decode_tok_s"]["median"]
                p["decode_fraction_of_read_limit"] = d * f["bytes_per_token"] / (best["gbps"] * 1e9) if d else None
    report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    table = render_table(report)
    (out / "compare.md").write_text(table)
    with open(out / "compare.json", "w") as fh:
        json.dump(report, fh, indent=1)
    print(table)
    print(f"compare: wrote {out / 'compare.md'} and {out / 'compare.json'}", file=sys.stderr)
    return 0


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


if __name__ == "__main__":
    sys.exit(main())
