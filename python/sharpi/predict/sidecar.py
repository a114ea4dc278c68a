"""Sidecar predictor files: GGUF files that hold a trained predictor (docs/predictors.md).

What it owns: the exact on-disk layout of the `cooc`, `depthtime`, `learned` and `trajectory` sidecars — key
names and types, tensor names and numpy shapes (GGUF stores them reversed; gguf's writer and reader
do the reversal) — in one place, `expected_tensor_shapes`, used by both the writer and the reader so
the two cannot drift apart. It writes a file only when asked (`write_sidecar`) and never modifies one.

Reader contract (the C++ loader implements the same): a file that is not a sidecar, lacks a key,
lacks a tensor, holds a non-f32 tensor or a tensor of the wrong shape raises FormatError naming the
file and the key or tensor; a well-formed sidecar for a different model (n_layer, n_expert, top_k)
or with a smaller max_lookahead than asked raises InvalidArgument naming both shapes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

ARCH = "sharpi.predictor"
PREFIX = "sharpi.predictor."
KINDS = ("cooc", "depthtime", "learned", "trajectory")

# Kind-specific integer keys (under sharpi.predictor.), all written as uint32.
KIND_KEYS = {
    "cooc": ("cooc.history",),
    "depthtime": ("depthtime.gate", "depthtime.pool", "depthtime.neighbours"),
    "learned": ("n_embd", "learned.hidden", "learned.rank"),
    "trajectory": (
        "trajectory.window",
        "trajectory.d_model",
        "trajectory.n_block",
        "trajectory.n_head",
        "trajectory.d_ff",
    ),
}
COMMON_KEYS = ("n_layer", "n_expert", "top_k", "max_lookahead")
# Kind keys a file may lack (written before the key existed): read as this value.
KEY_DEFAULTS = {"depthtime.gate": 0, "depthtime.pool": 0, "depthtime.neighbours": 0}

# The per-expert features the depthtime stacker weighs, in the order of the last axis of dt.stack
# (defined in reference.DepthTimePredictor and docs/predictors.md; the C++ predictor uses the same
# order). A file with another count of features fails the shape check.
DEPTHTIME_DECAYS = (0.5, 0.8, 0.9, 0.97)  # hist<λ>: decayed counts of the earlier tokens
DEPTHTIME_VOTE_POWERS = (1, 4, 16)  # vote<p>, nvote<p>: route-similarity weights raised to p
DEPTHTIME_VOTE_WINDOW = 1024  # the earlier tokens that vote: at most this many, the latest
DEPTHTIME_BASE_FEATURES = (
    ("reg", "cnt", "prev1", "prev2", "prev3", "prev4")
    + tuple(f"hist{lam}" for lam in DEPTHTIME_DECAYS)
    + ("freq",)
    + tuple(f"vote{p}" for p in DEPTHTIME_VOTE_POWERS)
    + tuple(f"nvote{p}" for p in DEPTHTIME_VOTE_POWERS)
)
# Then products of two of those ("regp": the softmax of reg over the experts). Their factors, in order:
DEPTHTIME_PRODUCTS = tuple(
    (a, v) for a in ("reg", "regp") for v in DEPTHTIME_BASE_FEATURES[-2 * len(DEPTHTIME_VOTE_POWERS) :]
) + (("reg", "prev1"), ("reg", "hist0.9"), ("reg", "freq"), ("cnt", "nvote4"))
DEPTHTIME_FEATURES = DEPTHTIME_BASE_FEATURES + tuple(f"{a}*{b}" for a, b in DEPTHTIME_PRODUCTS)
# With depthtime.pool = N > 0 (dt.pool holds N training tokens' routes) nine more: the pool votes,
# a retrieval over those routes (reference.DepthTimePredictor), and their products with reg and regp.
DEPTHTIME_POOL_POWERS = (4, 16, 64)
DEPTHTIME_POOL_FEATURES = tuple(f"pvote{p}" for p in DEPTHTIME_POOL_POWERS) + tuple(
    f"{a}*pvote{p}" for a in ("reg", "regp") for p in DEPTHTIME_POOL_POWERS
)
# With depthtime.gate = 1 (trained with the model on a trace with hidden states) two more, last:
# "gate", layer t's own router applied to ffn_norm_t(hidden_L) (the next_gate score), and "gatep",
# its softmax over the experts.
DEPTHTIME_GATE_FEATURES = ("gate", "gatep")



def _format_error(message: str) -> Exception:
    from sharpi._core import FormatError

    return FormatError(message)


def _invalid(message: str) -> Exception:
    from sharpi._core import InvalidArgument

    return InvalidArgument(message)


@dataclass
class Sidecar:
    """A predictor's hyper-parameters and f32 tensors (numpy shapes as in docs/predictors.md)."""

    kind: str
    n_layer: int
    n_expert: int
    top_k: int
    max_lookahead: int
    source: str
    params: dict[str, int] = field(default_factory=dict)  # KIND_KEYS[kind] -> value
    tensors: dict[str, np.ndarray] = field(default_factory=dict)

    def shape_text(self) -> str:
        return f"n_layer={self.n_layer}, n_expert={self.n_expert}, top_k={self.top_k}"


def depthtime_features(sc: Sidecar) -> tuple[str, ...]:
    """The features of sc's dt.stack, in order."""
    pool = DEPTHTIME_POOL_FEATURES if depthtime_pool(sc) else ()
    return DEPTHTIME_FEATURES + pool + (DEPTHTIME_GATE_FEATURES if depthtime_gate(sc) else ())


def depthtime_pool(sc: Sidecar) -> int:
    """The number of training tokens whose routes the depthtime sidecar sc keeps for the pool votes (0: none)."""
    return int(sc.params.get("depthtime.pool", KEY_DEFAULTS["depthtime.pool"]))


def depthtime_gate(sc: Sidecar) -> bool:
    """Whether the depthtime sidecar sc weighs the gate feature (needs the model's routers and hidden states)."""
    return bool(sc.params.get("depthtime.gate", KEY_DEFAULTS["depthtime.gate"]))


def expected_tensor_shapes(sc: Sidecar) -> dict[str, tuple[int, ...]]:
    """Every tensor the spec requires for sc.kind with sc's keys, name -> numpy shape."""
    n_layer, E, dmax, p = sc.n_layer, sc.n_expert, sc.max_lookahead, sc.params
    if sc.kind == "cooc":
        n_off = dmax + p["cooc.history"] - 1
        return {"cooc.bias": (n_layer, E), "cooc.layer": (n_layer, n_off, E, E), "cooc.prev": (n_layer, E, E)}
    if sc.kind == "depthtime":
        return {
            "dt.bias": (n_layer, E),
            "dt.layer": (n_layer, max(n_layer - 1, 1), E, E),
            "dt.prev": (n_layer, 3, E, E),
            "dt.count_bias": (n_layer, E),
            "dt.count": (n_layer, dmax, E, E),
            "dt.stack": (dmax, n_layer, len(depthtime_features(sc))),
        } | ({"dt.pool": (depthtime_pool(sc), n_layer, sc.top_k)} if depthtime_pool(sc) else {})
    if sc.kind == "learned":
        n_embd, H, R = p["n_embd"], p["learned.hidden"], p["learned.rank"]
        shapes: dict[str, tuple[int, ...]] = {}
        for L in range(n_layer - 1):
            if R > 0:
                shapes[f"learned.{L}.pca_mean"] = (n_embd,)
                shapes[f"learned.{L}.pca"] = (R, n_embd)
            shapes[f"learned.{L}.w1"] = (H, R if R > 0 else n_embd)
            shapes[f"learned.{L}.b1"] = (H,)
            shapes[f"learned.{L}.w2"] = (dmax * E, H)
            shapes[f"learned.{L}.b2"] = (dmax * E,)
        return shapes
    if sc.kind == "trajectory":
        D, F = p["trajectory.d_model"], p["trajectory.d_ff"]
        shapes = {
            "traj.expert_emb": (n_layer, E, D),
            "traj.layer_emb": (n_layer, D),
            "traj.prev_emb": (n_layer, E, D),
            "traj.prev_none": (D,),
        }
        for b in range(p["trajectory.n_block"]):
            pre = f"traj.blk.{b}."
            shapes.update(
                {
                    pre + "ln1.w": (D,),
                    pre + "ln1.b": (D,),
                    pre + "qkv.w": (3 * D, D),
                    pre + "qkv.b": (3 * D,),
                    pre + "out.w": (D, D),
                    pre + "out.b": (D,),
                    pre + "ln2.w": (D,),
                    pre + "ln2.b": (D,),
                    pre + "up.w": (F, D),
                    pre + "up.b": (F,),
                    pre + "down.w": (D, F),
                    pre + "down.b": (D,),
                }
            )
        shapes["traj.ln_f.w"] = (D,)
        shapes["traj.ln_f.b"] = (D,)
        for d in range(1, dmax + 1):
            shapes[f"traj.head.{d}.w"] = (n_layer, E, D)
            shapes[f"traj.head.{d}.b"] = (n_layer, E)
        return shapes
    raise _invalid(f"unknown sidecar kind '{sc.kind}' (one of {', '.join(KINDS)})")


def _check_params(sc: Sidecar, where: str, error) -> None:
    """Ranges the spec fixes; `error` is the exception factory (InvalidArgument when writing,
    FormatError when reading)."""
    if sc.kind not in KINDS:
        raise error(f"{where}: unknown predictor kind '{sc.kind}' (one of {', '.join(KINDS)})")
    if sc.n_layer < 1 or sc.n_expert < 1 or not 1 <= sc.top_k <= sc.n_expert:
        raise error(f"{where}: bad shape {sc.shape_text()}")
    if not 1 <= sc.max_lookahead <= 3:
        raise error(f"{where}: max_lookahead {sc.max_lookahead} outside 1..3")
    p = sc.params
    if sc.kind == "cooc" and not p["cooc.history"] >= 1:
        raise error(f"{where}: cooc.history must be >= 1, got {p['cooc.history']}")
    if sc.kind == "depthtime" and p.get("depthtime.gate", 0) not in (0, 1):
        raise error(f"{where}: depthtime.gate must be 0 or 1, got {p['depthtime.gate']}")
    if sc.kind == "depthtime" and p.get("depthtime.pool", 0) > 0 and p.get("depthtime.neighbours", 0) < 1:
        raise error(f"{where}: depthtime.neighbours must be >= 1 with a pool, got {p.get('depthtime.neighbours', 0)}")
    if sc.kind == "learned" and (
        p["n_embd"] < 1 or p["learned.hidden"] < 1 or p["learned.rank"] < 0 or p["learned.rank"] > p["n_embd"]
    ):
        raise error(
            f"{where}: bad learned sizes n_embd={p['n_embd']} hidden={p['learned.hidden']} "
            f"rank={p['learned.rank']}"
        )
    if sc.kind == "trajectory":
        W, D, H = p["trajectory.window"], p["trajectory.d_model"], p["trajectory.n_head"]
        if (
            not 1 <= W <= 10
            or D < 1
            or H < 1
            or D % H
            or p["trajectory.d_ff"] < 1
            or p["trajectory.n_block"] < 0
        ):
            raise error(
                f"{where}: bad trajectory sizes window={W} d_model={D} n_head={H} "
                f"d_ff={p['trajectory.d_ff']} n_block={p['trajectory.n_block']} "
                "(window 1..10, d_model divisible by n_head)"
            )


def _check_pool_ids(sc: Sidecar, where: str, error) -> None:
    """dt.pool holds expert ids: integers in [-1, n_expert), -1 = unknown."""
    pool = sc.tensors.get("dt.pool")
    if pool is None or pool.size == 0:
        return
    bad = (pool != np.round(pool)) | (pool < -1) | (pool >= sc.n_expert)
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise error(
            f"{where}: tensor 'dt.pool' holds {float(pool[at])!r} at {at}, not an expert id "
            f"(an integer in [-1, {sc.n_expert}))"
        )


def write_sidecar(path: str | os.PathLike, sc: Sidecar) -> None:
    """Writes sc as a GGUF sidecar (to `<path>.tmp`, renamed when complete)."""
    import gguf

    path = str(path)
    _check_params(sc, f"sidecar {path}", _invalid)
    want = expected_tensor_shapes(sc)
    missing = [n for n in want if n not in sc.tensors]
    extra = [n for n in sc.tensors if n not in want]
    if missing or extra:
        raise _invalid(
            f"sidecar {path}: tensors do not match kind '{sc.kind}': missing {missing}, extra {extra}"
        )
    for name, shape in want.items():
        if tuple(sc.tensors[name].shape) != shape:
            raise _invalid(
                f"sidecar {path}: tensor {name} has shape {sc.tensors[name].shape}, expected {shape}"
            )
    _check_pool_ids(sc, f"sidecar {path}", _invalid)
    tmp = path + ".tmp"
    w = gguf.GGUFWriter(tmp, ARCH)
    w.add_string(PREFIX + "kind", sc.kind)
    for key in COMMON_KEYS:
        w.add_uint32(PREFIX + key, int(getattr(sc, key)))
    w.add_string(PREFIX + "source", sc.source)
    for key in KIND_KEYS[sc.kind]:
        w.add_uint32(PREFIX + key, int(sc.params.get(key, KEY_DEFAULTS.get(key))))
    for name in want:  # spec order: deterministic files
        w.add_tensor(name, np.ascontiguousarray(sc.tensors[name], dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)


def _field_value(reader, key: str, path: str, want_int: bool):
    import gguf

    f = reader.fields.get(key)
    if f is None:
        raise _format_error(f"sidecar {path}: missing key '{key}'")
    vtype = f.types[0] if f.types else None
    if want_int:
        ints = {
            gguf.GGUFValueType.UINT8,
            gguf.GGUFValueType.UINT16,
            gguf.GGUFValueType.UINT32,
            gguf.GGUFValueType.UINT64,
            gguf.GGUFValueType.INT8,
            gguf.GGUFValueType.INT16,
            gguf.GGUFValueType.INT32,
            gguf.GGUFValueType.INT64,
        }
        if vtype not in ints:
            raise _format_error(f"sidecar {path}: key '{key}' must be an integer, got {vtype}")
        return int(f.contents())
    if vtype != gguf.GGUFValueType.STRING:
        raise _format_error(f"sidecar {path}: key '{key}' must be a string, got {vtype}")
    return str(f.contents())


def read_sidecar(
    path: str | os.PathLike,
    kind: str | None = None,
    n_layer: int | None = None,
    n_expert: int | None = None,
    top_k: int | None = None,
    min_lookahead: int | None = None,
) -> Sidecar:
    """Reads and validates a sidecar. kind: the kind the caller expects (None = any).
    n_layer / n_expert / top_k: the model's shape to check against (None = unchecked);
    min_lookahead: the lookahead the caller will ask for (None = unchecked)."""
    import gguf

    path = str(path)
    if not os.path.isfile(path):
        raise _invalid(f"sidecar {path}: no such file")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # noqa: BLE001 -- gguf raises untyped errors (ValueError, struct.error, ...) on garbage
        raise _format_error(f"sidecar {path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    arch = _field_value(reader, "general.architecture", path, want_int=False)
    if arch != ARCH:
        raise _format_error(f"sidecar {path}: general.architecture is '{arch}', expected '{ARCH}'")
    file_kind = _field_value(reader, PREFIX + "kind", path, want_int=False)
    if file_kind not in KINDS:
        raise _format_error(
            f"sidecar {path}: unknown predictor kind '{file_kind}' (one of {', '.join(KINDS)})"
        )
    common = {k: _field_value(reader, PREFIX + k, path, want_int=True) for k in COMMON_KEYS}
    params = {
        k: KEY_DEFAULTS[k] if k in KEY_DEFAULTS and PREFIX + k not in reader.fields else _field_value(reader, PREFIX + k, path, want_int=True)
        for k in KIND_KEYS[file_kind]
    }
    source_field = reader.fields.get(PREFIX + "source")
    source = str(source_field.contents()) if source_field is not None else ""
    sc = Sidecar(
        file_kind,
        common["n_layer"],
        common["n_expert"],
        common["top_k"],
        common["max_lookahead"],
        source,
        params,
    )
    _check_params(sc, f"sidecar {path}", _format_error)
    if kind is not None and kind != file_kind:
        raise _invalid(f"sidecar {path}: holds a '{file_kind}' predictor, not '{kind}'")
    model = (n_layer, n_expert, top_k)
    if any(m is not None and m != f for m, f in zip(model, (sc.n_layer, sc.n_expert, sc.top_k))):
        raise _invalid(
            f"sidecar {path}: predictor shape {sc.shape_text()} does not match the model "
            f"n_layer={n_layer}, n_expert={n_expert}, top_k={top_k}"
        )
    if min_lookahead is not None and sc.max_lookahead < min_lookahead:
        raise _invalid(
            f"sidecar {path}: predicts up to {sc.max_lookahead} layers ahead, {min_lookahead} asked"
        )

    by_name = {t.name: t for t in reader.tensors}
    for name, shape in expected_tensor_shapes(sc).items():
        t = by_name.get(name)
        if t is None:
            raise _format_error(f"sidecar {path}: missing tensor '{name}' (kind {file_kind})")
        if t.tensor_type != gguf.GGMLQuantizationType.F32:
            raise _format_error(f"sidecar {path}: tensor '{name}' is {t.tensor_type.name}, must be F32")
        # GGUF stores ggml ne (innermost first); the numpy shape is its reverse.
        got = tuple(int(v) for v in reversed(t.shape.tolist()))
        if got != shape:
            raise _format_error(f"sidecar {path}: tensor '{name}' has shape {got}, expected {shape}")
        sc.tensors[name] = np.array(t.data, dtype=np.float32).reshape(shape)
    _check_pool_ids(sc, f"sidecar {path}", _format_error)
    return sc
