"""sharpi.predict: the offline predictor pipeline — load routing traces, train predictors, evaluate
them on held-out sequences, and read/write the sidecar GGUF files the engine loads
(docs/predictors.md). `sharpi predictor train|eval` (cli.py) is the command-line front end.

numpy and gguf only, except training `learned` and `trajectory`, which import torch lazily
(`pip install sharpi[torch]`).
"""

# (evaluate.evaluate is not re-exported: the name would shadow the module sharpi.predict.evaluate)
from .reference import PREDICTOR_NAMES, ModelRouters, make_predictor, predicted_sets  # noqa: F401
from .sidecar import Sidecar, read_sidecar, write_sidecar  # noqa: F401
from .traces import RoutingTrace, TraceSplit, load_trace, split_by_sequences  # noqa: F401
