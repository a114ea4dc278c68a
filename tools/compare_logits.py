"""Bit-identity check of two sharpi builds: the same prompts through both, logits compared as bytes.

Usage (from the repository root):
    python tools/compare_logits.py --old /work/main/python --new python [--dir /tmp/cmp] [--quick]

It writes small synthetic models with `sharpi.make_model.write_model` (every arch, several quant
types), then runs each configuration (resident; streamed with a tight and a roomy RAM budget; both
readers; predictors; route-trace replay; exact mode; prefill and token-by-token decode) once under
each build in a subprocess (PYTHONPATH=<build>), and compares the logits byte for byte. Exit status 1
on any difference. A tool, not a test: it needs two builds side by side.

--control runs the new side with SHARPI_ISA=scalar (other kernels, other rounding in fast mode):
it must report differences, which shows the comparison can fail (exit status 0 only if it does).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

MODELS = [  # (arch, quant)
    ("qwen3moe", "f32"),
    ("qwen3moe", "q4_k_m"),
    ("qwen2moe", "q8_0"),
    ("qwen2moe", "q6_k"),
    ("olmoe", "q4_0"),
    ("olmoe", "f16"),
    ("llama", "q5_k_m"),
    ("llama", "q8_0"),
    ("deepseek2", "q4_k_m"),
    ("deepseek2", "f16"),
    ("gpt-oss", "mxfp4"),
    ("gpt-oss", "q8_0"),
    ("qwen3next", "q4_k_m"),
    ("qwen35moe", "q8_0"),
    ("qwen2", "q6_k"),
    ("qwen3", "q4_0"),
]
QUICK_MODELS = [
    ("qwen3moe", "q4_k_m"),
    ("qwen2moe", "q8_0"),
    ("deepseek2", "q4_k_m"),
    ("gpt-oss", "mxfp4"),
    ("qwen3next", "q4_k_m"),
]

# "uring" runs as "auto" (pread) on a build without io_uring (both builds must agree on that).
READERS = ("pread", "uring")

PROMPT = [1, 5, 9, 2, 77, 31, 4, 18, 63, 7, 12, 40]
N_GEN = 6


def configs() -> list[dict]:
    out = [{"budget": None}]
    for budget in ("small", "large"):
        for reader in READERS:
            out.append({"budget": budget, "reader": reader})
    for predictor in ("prev_token", "next_gate"):
        out.append({"budget": "small", "reader": "auto", "predictor": predictor, "lookahead": 2})
    out.append(
        {
            "budget": "small",
            "reader": "pread",
            "predictor": "next_gate",
            "lookahead": 1,
            "slru_probation": 0.5,
        }
    )
    out.append({"budget": None, "route_trace": True})
    out.append({"budget": "small", "reader": "auto", "route_trace": True, "predictor": "prev_token"})
    # Exact mode (f32 on dequantized weights), resident and streamed.
    out.append({"budget": None, "exact": True})
    out.append({"budget": "small", "reader": "pread", "exact": True})
    # Every named activation of the last decode (embedding, each layer's intermediates, output head).
    out.append({"budget": "small", "reader": "pread", "dump_activations": True})
    return out


def run_side(model_dir: Path, out_path: Path) -> None:
    """Runs every configuration on every model under this process's sharpi; writes digests + raw."""
    import numpy as np
    import sharpi
    from sharpi import _core

    try:
        from sharpi import _internal
    except ImportError:  # a build from before the bindings split: the internals were in _core
        _internal = _core

    results = {}
    raw = {}
    for gguf in sorted(model_dir.glob("*.gguf")):
        probe = sharpi.Session(str(gguf))
        info = probe.info
        del probe

        def budgets_for(exact: bool, gguf=gguf, info=info) -> dict:
            # The smallest budget that streams (exact mode's f32 KV cache needs more), plus 0.2 MiB.
            minimum = None
            try:
                sharpi.Session(str(gguf), ram_budget=1, predictor="next_gate", lookahead=2, exact=exact)
            except _core.InvalidArgument as e:
                m = re.search(r"need at least ([0-9.]+) MiB", str(e))
                minimum = float(m.group(1)) if m else None
            if minimum is None:  # a dense model: nothing streams
                return {}
            return {
                "small": int((minimum + 0.2) * 1024 * 1024),
                "large": int(info["bytes_dense"] + 2 * info["bytes_experts"] + (256 << 20)),
            }

        budgets = {False: budgets_for(False), True: budgets_for(True)}
        rng = np.random.default_rng(0)
        n_moe_layers = info["n_layer"] - info.get("n_layer_dense_lead", 0)  # traces cover MoE layers only
        trace = rng.integers(0, info["n_expert"], size=(7, n_moe_layers, info["n_expert_used"])).astype(
            np.int32
        )
        for i, cfg in enumerate(configs()):
            if (cfg["budget"] or cfg.get("route_trace")) and not info.get("n_expert"):
                continue  # expert streaming and routing configurations need experts
            kw = {}
            if cfg["budget"]:
                kw["ram_budget"] = budgets[bool(cfg.get("exact"))][cfg["budget"]]
                kw["reader"] = cfg["reader"] if cfg["reader"] != "uring" or _internal.uring_compiled() else "auto"
            for key in ("predictor", "lookahead", "slru_probation", "dump_activations", "exact"):
                if key in cfg:
                    kw[key] = cfg[key]
            s = sharpi.Session(str(gguf), **kw)
            if cfg.get("route_trace"):
                s.set_route_trace(trace)
            rows = []
            prompt = [t % info["n_vocab"] for t in PROMPT]
            rows.append(s.decode(prompt, all_logits=True))  # prefill path
            tok = int(np.argmax(rows[-1][-1]))
            for _ in range(N_GEN):  # one-token path
                lg = s.decode([tok])
                rows.append(lg)
                tok = int(np.argmax(lg))
            s.reset()
            for t in prompt[:4]:  # token by token from a reset
                rows.append(s.decode([t]))
            if cfg.get("dump_activations"):
                s.decode(prompt[4:8], all_logits=True)  # a batch, so the dump has prefill shapes
                dump = s.dump()
                rows.extend(np.asarray(dump[name]) for name in sorted(dump))
            blob = b"".join(np.ascontiguousarray(r, dtype=np.float32).tobytes() for r in rows)
            key = f"{gguf.stem}#{i}:{json.dumps(cfg, sort_keys=True)}"
            results[key] = hashlib.sha256(blob).hexdigest()
            raw[key] = blob
            del s
    out_path.write_text(json.dumps(results, indent=1))
    with open(out_path.with_suffix(".raw"), "wb") as f:
        for key in sorted(raw):
            f.write(raw[key])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", default="/work/main/python")
    p.add_argument("--new", default="python")
    p.add_argument("--dir", default="/tmp/sharpi-compare")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--control", action="store_true", help="new side under SHARPI_ISA=scalar: must differ")
    p.add_argument("--side", help=argparse.SUPPRESS)
    a = p.parse_args()
    work = Path(a.dir)
    if a.side:
        run_side(work / "models", Path(a.side))
        return 0
    (work / "models").mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, os.path.abspath(a.new))
    from sharpi.make_model import write_model

    for arch, quant in QUICK_MODELS if a.quick else MODELS:
        path = work / "models" / f"{arch}-{quant}.gguf"
        if not path.exists():
            write_model(path, arch=arch, preset="tiny", quant=quant, seed=3)
    digests = {}
    for side, pp in (("old", a.old), ("new", a.new)):
        env = dict(os.environ, PYTHONPATH=os.path.abspath(pp))
        if a.control and side == "new":
            env["SHARPI_ISA"] = "scalar"
        out = work / f"{side}.json"
        subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--dir", str(work), "--side", str(out)],
            env=env,
            check=True,
        )
        digests[side] = json.loads(out.read_text())
    same = [k for k in digests["old"] if digests["new"].get(k) == digests["old"][k]]
    diff = [k for k in digests["old"] if digests["new"].get(k) != digests["old"][k]]
    print(f"{len(same)} of {len(digests['old'])} runs bit-identical")
    for k in diff:
        print("DIFFERENT:", k)
    if a.control:
        print("control: the comparison " + ("can fail (as it must)" if diff else "did NOT fail: it is blind"))
        return 0 if diff else 1
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
