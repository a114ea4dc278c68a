"""The worker: one benchmark configuration, run inside its own process (bench.isolation launches it).

What it owns: everything that happens in the child. It reads the JSON config, runs one mode
(probe: the engine's plan; resident: every expert memory-mapped, decoded twice; stream: one budget
and predictor; harvest / train: a predictor's training data and sidecar), decodes one token at a
time recording wall and CPU time, the routing and a digest of the logits, and writes the raw
numbers as JSON for the parent. It computes no metric: bench.report does, in the parent.
"""

from __future__ import annotations

import hashlib
import json
import resource
import time
from pathlib import Path

import numpy as np

from .predictors import train_predictor_sidecar


def run_worker(config_path: str, result_path: str) -> int:
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
    whole process (every compute and reader thread), the routing ([t][il] lists of expert ids), a
    digest of all logits and the process's major page faults over the steps (pages of the mapped
    dense weights read back from disk after the memory cap reclaimed them: disk time the expert
    reader does not see, and that slows its reads)."""
    wall, cpu, routing = [], [], []
    digest = hashlib.sha256()
    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
    for i, token in enumerate(tokens):
        if on_step:
            on_step(i)
        c0, t0 = time.process_time(), time.perf_counter()
        logits = session.decode([int(token)])
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        # MoE layers only (deepseek2's leading dense layers route nothing), as traces record them.
        routing.append([[int(e) for e in ids[0]] for ids in session.last_routing() if ids.size])
        digest.update(np.ascontiguousarray(logits, dtype=np.float32).tobytes())
    return {"step_s": wall, "cpu_s": cpu, "routing": routing, "logits_sha256": digest.hexdigest(),
            "major_faults": resource.getrusage(resource.RUSAGE_SELF).ru_majflt - faults0}  # fmt: skip


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


def _predictor_kwargs(cfg: dict) -> dict:
    """Session keyword arguments for cfg's predictor."""
    name = cfg.get("predictor", "none")
    if name == "none":
        return {}
    kwargs = {"predictor": name, "lookahead": int(cfg.get("lookahead", 1)),
              "prefetch_sizing": cfg.get("prefetch_sizing", "topk")}
    if cfg.get("predictor_file"):
        kwargs["predictor_file"] = cfg["predictor_file"]
    return kwargs


def _worker_run(sharpi, cfg: dict) -> dict:
    mode = cfg["mode"]
    if mode == "harvest":
        from ..harvest import harvest

        return {"harvest": harvest(cfg["path"], cfg["prompts"], cfg["out"], hidden=cfg["hidden"],
                                   threads=cfg["threads"], n_ctx=cfg["n_ctx"])}  # fmt: skip
    if mode == "train":
        t0 = time.perf_counter()
        train_predictor_sidecar(cfg["kind"], cfg["trace"], cfg["out"], cfg["lookahead"], cfg["seed"])
        return {"sidecar": cfg["out"], "train_s": time.perf_counter() - t0}
    kwargs = {"threads": cfg["threads"], "n_ctx": cfg["n_ctx"], "reader": cfg["reader"]}
    if mode in ("probe", "stream"):
        kwargs["ram_budget"] = int(cfg["budget_bytes"])
        kwargs["cache_policy"] = cfg.get("cache_policy")
    if mode == "stream":
        kwargs.update(_predictor_kwargs(cfg))
    want_timeline = bool(cfg.get("timeline_path"))
    if want_timeline:
        kwargs["timeline"] = True

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
    # Prefetch staging slots come out of the same budget: cache + staging = the planned slots.
    planned = int(st["n_slots"]) + int(st.get("n_staging", 0))
    if planned != int(cfg["n_slots"]):
        raise RuntimeError(
            f"engine planned {st['n_slots']} slots + {st.get('n_staging', 0)} staging for the budget, "
            f"expected {cfg['n_slots']} in all"
        )
    warm_run = _decode_steps(session, warm)
    session.reset_stats()
    first_traced = len(measured) - int(cfg.get("timeline_tokens", 0))

    def on_step(i: int) -> None:
        # Cleared at the first measured token too, so the spans of untraced tokens never pile up.
        if want_timeline and i in (0, first_traced):
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
            "n_staging": int(st.get("n_staging", 0)),
            # MoE layers only (the bench counts layers as the traces do; deepseek2's first is dense).
            "layers": [dict(lay) for lay in st["layers"][int(session.info.get("n_layer_dense_lead", 0)) :]],
            # Top-level counters (io_busy_ms, decode_ms, predict_ms, ... where the engine has them).
            "stats_globals": {
                k: v for k, v in st.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
            },
            "warm_routing": warm_run["routing"],
        }
    )
    if want_timeline:
        from ..timeline import write_chrome_trace

        events = list(session.timeline_events())
        events += _token_spans(events, len(warm) + first_traced)
        summary = write_chrome_trace(events, cfg["timeline_path"], process_name="sharpi decode")
        summary["tokens"] = int(cfg.get("timeline_tokens", 0))
        summary["tracks"] = sorted({e["track"] for e in events})
        out["timeline"] = summary
    return out
