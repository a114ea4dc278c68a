"""The predictor axis of `sharpi bench`: which predictors a workload runs and the sidecar files they
need, trained for the bench when none is given.

What it owns: the predictor names the bench knows, the plan of one workload's predictor runs
(prepare_predictors) and training a sidecar (train_predictor_sidecar, run inside a worker). The
sidecars are written under <model-dir>/predictors and reused by later runs; training data is the
train split of the recorded trace (bench.workloads) or a trace harvested from the model itself
(sharpi.harvest, in a worker). The training itself is sharpi.predict.train's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .isolation import launch
from .workloads import write_train_trace

# The predictor axis (--predictors). Sidecar predictors need a trained file (docs/predictors.md);
# hidden-state predictors read the model's own hidden states, which under trace replay belong to a
# random-weight model whose router is overridden, so they are skipped on the trace workload.
PREDICTORS = ("none", "prev_token", "next_gate", "pregate", "cooc", "depthtime", "learned", "trajectory")
SIDECAR_PREDICTORS = ("cooc", "depthtime", "learned", "trajectory")
HIDDEN_STATE_PREDICTORS = ("next_gate", "learned", "pregate")
HARVEST_SEQ_LEN = 32  # tokens per sequence harvested from the random-weight model


def train_predictor_sidecar(kind: str, trace_path: str, out_path: str, lookahead: int, seed: int) -> None:
    """Trains a `kind` sidecar (cooc, depthtime, trajectory, learned) on every token of the trace at trace_path
    (already the training split) with sharpi.predict.train and writes it to out_path."""
    from ..predict import train as predict_train
    from ..predict.sidecar import write_sidecar
    from ..predict.traces import load_trace

    trace = load_trace(str(trace_path))
    if kind == "depthtime":
        from ..predict.regression import train_depthtime as fn
    else:
        fn = getattr(predict_train, f"train_{kind}")
    sidecar = fn(trace, np.arange(trace.n_tokens, dtype=np.int64), max_lookahead=lookahead, seed=seed,
                 source=f"{trace_path} (all tokens)", quiet=True)
    write_sidecar(str(out_path), sidecar)


def prepare_predictors(
    name: str, model_path: str, info: dict, opts: dict, work: Path, log, trace=None
) -> dict:
    """The predictor runs of one workload: {"runs": [(predictor, sidecar path or None)], "skipped":
    {predictor: reason}, "sidecars": {predictor: {path, how}}, "train_trace": {...}}.

    Sidecars come from --predictor-file, else from a trained file of the same name under
    <model-dir>/predictors (unless --retrain), else are trained here, each in a worker: on the train
    split of the recorded trace (trace workload) or on a trace harvested from the model itself
    (random workload: prompts of random token ids, not the decoded ones)."""
    plan: dict = {"runs": [("none", None)], "skipped": {}, "sidecars": {}}
    wanted = [p for p in opts["predictors"] if p != "none"]
    given = {}
    for workload, pred, path in opts["predictor_files"]:
        if workload in (None, name):
            given[pred] = path
            plan["sidecars"][pred] = {"path": path, "how": "--predictor-file"}
    to_train = []
    for pred in wanted:
        if trace is not None and pred in HIDDEN_STATE_PREDICTORS:
            plan["skipped"][pred] = (
                "needs the model's hidden states, but under trace replay the router follows the recorded "
                "trace and the hidden states are a random-weight model's"
            )
        elif pred in SIDECAR_PREDICTORS and pred not in given:
            to_train.append(pred)
    if to_train:
        n_layer = int(info["n_layer"]) - int(info.get("n_layer_dense_lead", 0))  # MoE layers, as traces
        tag = (
            f"trace{opts['train_tokens'] or 'all'}"
            if trace is not None
            else f"harvest{opts['harvest_tokens']}"
        )
        pred_dir = Path(opts["model_dir"]) / "predictors"
        targets = {
            p: pred_dir / f"{Path(model_path).stem}-{p}-d{opts['lookahead']}-{tag}.gguf" for p in to_train
        }
        missing = [p for p in to_train if opts["retrain"] or not targets[p].is_file()]
        for p in to_train:
            if p not in missing:
                given[p] = str(targets[p])
                plan["sidecars"][p] = {"path": str(targets[p]), "how": "reused (trained by an earlier run)"}
        train_trace = work / f"{name}-train-trace.npz"
        if missing and trace is not None:
            plan["train_trace"] = write_train_trace(Path(trace), train_trace, n_layer, opts["train_tokens"])
        elif missing:
            rng = np.random.default_rng(opts["seed"] + 1)  # not the decoded tokens (seed)
            n_seq = max(2, opts["harvest_tokens"] // HARVEST_SEQ_LEN)
            prompts = [
                [int(t) for t in rng.integers(1, int(info["n_vocab"]), size=HARVEST_SEQ_LEN)]
                for _ in range(n_seq)
            ]
            cfg = {
                "mode": "harvest",
                "path": model_path,
                "prompts": prompts,
                "out": str(train_trace),
                "hidden": "learned" in missing,
                "threads": opts["threads"],
                "n_ctx": HARVEST_SEQ_LEN + 16,
            }
            log(
                f"{name}: harvesting {n_seq} x {HARVEST_SEQ_LEN} random-token prompts to train predictors ..."
            )
            res = launch(cfg, work, f"{name}-harvest")
            if res["ok"]:
                plan["train_trace"] = dict(
                    res["harvest"], source=f"harvested from {model_path} (random token ids)"
                )
            else:
                for p in missing:
                    plan["skipped"][p] = f"harvesting a training trace failed: {res['error']}"
                missing = []
        for p in missing:
            pred_dir.mkdir(parents=True, exist_ok=True)
            cfg = {
                "mode": "train",
                "kind": p,
                "trace": str(train_trace),
                "out": str(targets[p]),
                "lookahead": opts["lookahead"],
                "seed": opts["seed"],
            }
            log(f"{name}: training {p} on {plan['train_trace']['tokens']} tokens ...")
            res = launch(cfg, work, f"{name}-train-{p}")
            if res["ok"]:
                given[p] = str(targets[p])
                plan["sidecars"][p] = {"path": str(targets[p]), "how": f"trained in {res['train_s']:.1f} s"}
                log(f"{name}: {p} trained in {res['train_s']:.1f} s")
            else:
                plan["skipped"][p] = f"training failed: {res['error']}"
                log(f"{name}: {p} not trained: {res['error']}")
    for pred in wanted:
        if pred not in plan["skipped"]:
            plan["runs"].append((pred, given.get(pred)))
    return plan
