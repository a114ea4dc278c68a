"""`sharpi trace`: harvest expert-routing traces (and optionally hidden states) from a MoE model.

What it owns: reading a prompts file, running each prompt through a fresh KV cache of one
sharpi.Session made with dump_activations=True, and writing one .npz in the format of
shared/traces/README.md (the format predictors are trained and evaluated on). It reads the model
only through the Session and writes only `out_path` (through `<out_path>.tmp`, renamed when
complete, so a crash never leaves a half-written trace behind). It never samples: generation is
greedy (argmax), so a trace is reproducible from the model and the prompts alone.

Per prompt (one sequence of the trace):
  1. tokenize (the model's own tokenizer, BOS as its metadata says) — or take token ids as given;
  2. decode the whole prompt as one batch (the prefill path, which is what the prompt phase of the
     shared traces records);
  3. optionally decode `generate` greedy tokens one at a time (the decode path). The argmax of the
     last logits is only traced once it is decoded, so a sequence holds prompt + generated tokens,
     each with the routing the engine computed for it. Generation stops early at an
     end-of-generation token or when the context is full.
After every decode the session's dump gives, per MoE layer il, "ffn_moe_topk-il" (expert ids as
floats [T, k], rank order), "ffn_moe_probs-il" (softmax over all experts [T, n_expert]),
"ffn_moe_logits-il" (router logits [T, n_expert]) and "ffn_inp-il" (the residual stream entering
the MoE block [T, n_embd]). The ids are checked against Session.last_routing() (the routing the
expert cache actually served) before they are kept.

Output arrays (names and dtypes of shared/traces/README.md, plus the extras it allows):
  experts int16 [tokens, moe_layers, top_k] (rank order), seq_start int64 [sequences],
  num_experts, top_k (int64 scalars), moe_layer_ids int16 [moe_layers],
  scores float16 [tokens, moe_layers, top_k]: the gate probabilities of the selected experts
    (softmax over all experts, before any top-k renormalisation; as in tests/data/stdlib_moe_trace.npz
    and the "gate probabilities" of the shared traces, so scores mean the same thing for every arch),
  tokens int32 [tokens], token_str_utf8 uint8 + token_str_offsets int64 [tokens + 1] (token i is
    bytes [off[i]:off[i+1]]), prompt_id int32 [sequences] (index of the prompt in the input),
  generated bool [tokens] (True for tokens produced by greedy decoding, False for prompt tokens),
  model str (file name of the model);
  with hidden=True also hidden float16 [tokens, moe_layers, n_embd], router_logits float16
    [tokens, moe_layers, n_expert] and hidden_kind (str, what `hidden` is).

Memory: dump_activations keeps every named activation of the last decode, so a long prompt on a
large model costs (prompt tokens x activations per layer x layers) floats for the duration of one
decode; the trace itself keeps only the float16/int16 arrays above.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Union

import numpy as np

from .cli_args import add_compute_arguments, non_negative_int, session_kv_options

HIDDEN_KIND = "residual stream entering the MoE block: after the layer's attention, before ffn_norm"

Prompt = Union[str, Sequence[int]]


# ==================================================================================================
# Prompts
# ==================================================================================================


def read_prompts(path: str) -> list:
    """Prompts from a file: one prompt per line (blank lines skipped), or JSON Lines where every
    non-blank line is an object with "prompt" or "text" (a string) or "tokens" (a list of token ids).
    The file is JSON Lines when its first non-blank line starts with "{". Raises InvalidArgument
    naming the file and line for anything else, and for a file with no prompt at all."""
    from ._core import InvalidArgument

    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except UnicodeDecodeError as e:
        raise InvalidArgument(f"prompts file {path}: not UTF-8 text ({e})") from None
    numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
    if not numbered:
        raise InvalidArgument(f"prompts file {path}: no prompts (the file is empty or blank)")
    if not numbered[0][1].lstrip().startswith("{"):
        return [line for _, line in numbered]
    prompts: list = []
    for lineno, line in numbered:
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise InvalidArgument(f"prompts file {path}, line {lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise InvalidArgument(
                f"prompts file {path}, line {lineno}: expected a JSON object, got {type(obj).__name__}"
            )
        if "prompt" in obj or "text" in obj:
            text = obj["prompt"] if "prompt" in obj else obj["text"]
            if not isinstance(text, str):
                raise InvalidArgument(
                    f'prompts file {path}, line {lineno}: "prompt"/"text" must be a string, got {type(text).__name__}'
                )
            prompts.append(text)
        elif "tokens" in obj:
            ids = obj["tokens"]
            if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids
            ):
                raise InvalidArgument(
                    f'prompts file {path}, line {lineno}: "tokens" must be a list of integers'
                )
            prompts.append(ids)
        else:
            raise InvalidArgument(
                f'prompts file {path}, line {lineno}: an object needs a "prompt", "text" or "tokens" field, '
                f"got keys {sorted(obj)}"
            )
    return prompts


# ==================================================================================================
# Harvest
# ==================================================================================================


class _SequenceRecorder:
    """Accumulates the per-token arrays of the whole trace, one decode at a time."""

    def __init__(self, moe_layers: list, n_expert: int, top_k: int, hidden: bool):
        self.moe_layers = moe_layers
        self.n_expert = n_expert
        self.top_k = top_k
        self.hidden = hidden
        self.experts: list = []
        self.scores: list = []
        self.hidden_states: list = []
        self.router_logits: list = []
        self.tokens: list = []
        self.generated: list = []

    def add(self, session, token_ids: list, generated: bool, where: str) -> None:
        """Takes the routing of the last decode (of `token_ids`) from the session's dump."""
        dump = session.dump()
        routing = session.last_routing()
        n = len(token_ids)
        k, E = self.top_k, self.n_expert
        experts = np.empty((n, len(self.moe_layers), k), dtype=np.int16)
        scores = np.empty((n, len(self.moe_layers), k), dtype=np.float16)
        if self.hidden:
            n_embd = dump[f"ffn_inp-{self.moe_layers[0]}"].shape[1]
            hidden_states = np.empty((n, len(self.moe_layers), n_embd), dtype=np.float16)
            router_logits = np.empty((n, len(self.moe_layers), E), dtype=np.float16)
        for j, il in enumerate(self.moe_layers):
            topk = _dumped(dump, f"ffn_moe_topk-{il}", (n, k), where)
            ids = np.rint(topk).astype(np.int64)
            if not np.array_equal(ids, topk) or ids.min() < 0 or ids.max() >= E:
                raise RuntimeError(
                    f"{where}: layer {il}: ffn_moe_topk holds ids outside [0, {E}): {topk.tolist()}"
                )
            if any(len(set(row.tolist())) != k for row in ids):
                raise RuntimeError(
                    f"{where}: layer {il}: an expert is selected twice in one token: {ids.tolist()}"
                )
            served = np.asarray(routing[il])
            if served.shape != (n, k) or not np.array_equal(np.sort(served, axis=1), np.sort(ids, axis=1)):
                raise RuntimeError(
                    f"{where}: layer {il}: the dumped top-k {ids.tolist()} differs from Session.last_routing() "
                    f"{served.tolist()} (the experts the engine actually ran)"
                )
            experts[:, j, :] = ids
            probs = dump.get(f"ffn_moe_probs-{il}")
            if probs is not None:
                probs = _dumped(dump, f"ffn_moe_probs-{il}", (n, E), where)
                scores[:, j, :] = np.take_along_axis(probs, ids, axis=1)
            else:  # an engine without the probs activation: recompute the softmax from the logits
                logits = _dumped(dump, f"ffn_moe_logits-{il}", (n, E), where).astype(np.float64)
                p = np.exp(logits - logits.max(axis=1, keepdims=True))
                p /= p.sum(axis=1, keepdims=True)
                scores[:, j, :] = np.take_along_axis(p, ids, axis=1)
            if self.hidden:
                hidden_states[:, j, :] = _dumped(dump, f"ffn_inp-{il}", (n, hidden_states.shape[2]), where)
                router_logits[:, j, :] = _dumped(dump, f"ffn_moe_logits-{il}", (n, E), where)
        self.experts.append(experts)
        self.scores.append(scores)
        if self.hidden:
            self.hidden_states.append(hidden_states)
            self.router_logits.append(router_logits)
        self.tokens.extend(int(t) for t in token_ids)
        self.generated.extend([generated] * n)


def _dumped(dump: dict, name: str, shape: tuple, where: str) -> np.ndarray:
    if name not in dump:
        raise RuntimeError(
            f"{where}: the engine's dump has no {name!r} (Session(dump_activations=True) expected)"
        )
    value = np.asarray(dump[name])
    if value.shape != shape:
        raise RuntimeError(f"{where}: activation {name} has shape {value.shape}, expected {shape}")
    return value


def _moe_layers(session) -> list:
    """Decoder layers with a router, found from one decode's dump (the engine names them)."""
    dump = session.dump()
    return [il for il in range(int(session.info["n_layer"])) if f"ffn_moe_topk-{il}" in dump]


def harvest(
    model_path,
    prompts: Sequence[Prompt],
    out_path,
    hidden: bool = False,
    generate: int = 0,
    threads: int = 0,
    ram_budget=None,
    n_ctx: int = 0,
    progress=None,
    exact: bool = False,
    progress_bar: bool = False,
    **session_options,
) -> dict:
    """Runs every prompt (text, or a list of token ids) through the model and writes the trace .npz
    to out_path. Returns a summary: {path, sequences, tokens, prompt_tokens, generated_tokens,
    moe_layers, num_experts, top_k, hidden, seconds}.

    generate: greedy tokens decoded one by one after each prompt. ram_budget: as Session's (None =
    every expert resident; the routing is the same either way). progress: callable(str) or None;
    progress_bar: bars on stderr for the model's loading and the prompts (sharpi.progress: shown on
    a terminal only).
    session_options: more Session keywords (cache_type_k, cache_type_v, allow_long_context).
    exact: run the session in exact mode (f32 math, as the trace of an independent implementation
    would be computed); the default fast mode records the routing sharpi itself runs by default.
    Raises InvalidArgument for a dense model, an empty prompt list, an empty prompt or a token id
    outside the vocabulary; ContextOverflowError when a prompt does not fit the context."""
    from . import _core
    from .progress import bar, loading
    from .session import Session

    if generate < 0:
        raise _core.InvalidArgument(f"generate must be >= 0, got {generate}")
    prompts = list(prompts)
    if not prompts:
        raise _core.InvalidArgument("harvest: no prompts given")
    t0 = time.perf_counter()
    with loading(os.fspath(model_path), disable=not progress_bar):
        session = Session(
            model_path,
            threads=threads,
            n_ctx=n_ctx,
            exact=exact,
            dump_activations=True,
            ram_budget=ram_budget,
            **session_options,
        )
    info = session.info
    if int(info["n_expert"]) == 0 or int(info["n_expert_used"]) == 0:
        raise _core.InvalidArgument(
            f"{os.fspath(model_path)}: {info['arch']} model without experts (n_expert = {info['n_expert']}); "
            "sharpi trace records expert routing and needs a Mixture-of-Experts model"
        )
    n_expert, top_k, n_ctx_used, n_vocab = (
        int(info["n_expert"]),
        int(info["n_expert_used"]),
        int(info["n_ctx"]),
        int(info["n_vocab"]),
    )
    tokenizer = session.tokenizer
    eog = set(getattr(tokenizer, "eog_ids", ()) or ())

    recorder = None
    seq_start: list = []
    prompt_id: list = []
    n_prompt_tokens = n_generated = 0
    for index, prompt in enumerate(bar(prompts, desc="prompts", unit="prompt", disable=not progress_bar)):
        where = f"prompt {index}"
        if isinstance(prompt, str):
            ids = session.tokenize(prompt)
        else:
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < n_vocab]
            if bad:
                raise _core.InvalidArgument(
                    f"{where}: token id {bad[0]} outside the vocabulary [0, {n_vocab})"
                )
        if not ids:
            raise _core.InvalidArgument(f"{where}: empty prompt (no tokens)")
        if len(ids) > n_ctx_used:
            raise _core.ContextOverflowError(
                f"{where}: {len(ids)} tokens do not fit the context of {n_ctx_used} tokens (raise n_ctx / -c)"
            )
        session.reset()
        logits = session.decode(ids)
        if recorder is None:
            layers = _moe_layers(session)
            if not layers:
                raise _core.InvalidArgument(
                    f"{os.fspath(model_path)}: no layer of this model has a router; sharpi trace needs MoE layers"
                )
            recorder = _SequenceRecorder(layers, n_expert, top_k, hidden)
        seq_start.append(len(recorder.tokens))
        prompt_id.append(index)
        recorder.add(session, ids, False, where)
        n_prompt_tokens += len(ids)
        for step in range(generate):
            token = int(np.argmax(logits))
            if token in eog or session.n_past >= n_ctx_used:
                break
            logits = session.decode([token])
            recorder.add(session, [token], True, f"{where}, generated token {step}")
            n_generated += 1
        if progress:
            progress(f"{where}: {len(recorder.tokens) - seq_start[-1]} tokens")

    rec = recorder
    tokens = np.asarray(rec.tokens, dtype=np.int32)
    pieces = [tokenizer.token_to_bytes(int(t)) for t in tokens]
    offsets = np.zeros(len(pieces) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(p) for p in pieces])
    arrays = {
        "experts": np.concatenate(rec.experts, axis=0),
        "seq_start": np.asarray(seq_start, dtype=np.int64),
        "num_experts": np.int64(n_expert),
        "top_k": np.int64(top_k),
        "moe_layer_ids": np.asarray(rec.moe_layers, dtype=np.int16),
        "scores": np.concatenate(rec.scores, axis=0),
        "tokens": tokens,
        "token_str_utf8": np.frombuffer(b"".join(pieces), dtype=np.uint8),
        "token_str_offsets": offsets,
        "prompt_id": np.asarray(prompt_id, dtype=np.int32),
        "generated": np.asarray(rec.generated, dtype=bool),
        "model": np.str_(os.path.basename(os.fspath(model_path))),
    }
    if hidden:
        arrays["hidden"] = np.concatenate(rec.hidden_states, axis=0)
        arrays["router_logits"] = np.concatenate(rec.router_logits, axis=0)
        arrays["hidden_kind"] = np.str_(HIDDEN_KIND)
    _write_npz(os.fspath(out_path), arrays)
    return {
        "path": os.fspath(out_path),
        "sequences": len(seq_start),
        "tokens": int(tokens.size),
        "prompt_tokens": n_prompt_tokens,
        "generated_tokens": n_generated,
        "moe_layers": len(rec.moe_layers),
        "num_experts": n_expert,
        "top_k": top_k,
        "hidden": bool(hidden),
        "seconds": time.perf_counter() - t0,
    }


def _write_npz(path: str, arrays: dict) -> None:
    """np.savez_compressed to path + '.tmp', then an atomic rename (np.savez appends '.npz' to names
    without it, so the temporary name keeps that suffix)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.tmp.npz")
    try:
        np.savez_compressed(tmp, **arrays)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


# ==================================================================================================
# Command line
# ==================================================================================================


def add_trace_parser(subparsers) -> argparse.ArgumentParser:
    """Registers `sharpi trace` on an argparse subparsers object; returns the parser."""
    p = subparsers.add_parser(
        "trace",
        help="record expert routing (and hidden states) of prompts into a trace .npz",
        description="Run prompts through a MoE model and write the experts each layer selected per token "
        "(format of shared/traces/README.md), for training and evaluating expert predictors.",
    )
    p.add_argument(
        "-m",
        "--model",
        default=None,
        metavar="FILE",
        help="GGUF model file (default: the shipped stdlib-moe model)",
    )
    p.add_argument(
        "--prompts",
        required=True,
        metavar="FILE",
        help='one prompt per line, or JSON Lines with {"prompt": ...}, {"text": ...} or {"tokens": [...]}',
    )
    p.add_argument("-o", "--out", required=True, metavar="OUT.npz", help="trace file to write")
    p.add_argument(
        "--hidden",
        action="store_true",
        help="also store hidden states (residual entering each MoE block) and router logits, float16",
    )
    p.add_argument(
        "--generate",
        type=non_negative_int("--generate"),
        default=0,
        metavar="N",
        help="greedy tokens decoded one by one after each prompt (default: 0)",
    )
    add_compute_arguments(p)
    p.add_argument(
        "--ram-budget",
        default=None,
        metavar="BYTES",
        help="stream experts within this RAM budget (e.g. 2GiB); default: every expert resident",
    )
    return p




def run_trace_command(args: argparse.Namespace) -> int:
    """`sharpi trace`: returns 0; sharpi's typed errors and OSError propagate to the CLI, which
    prints them as one line."""
    model = args.model
    if model is None:
        from .models import default_model_path

        model = default_model_path()
    for path, what in ((model, "model"), (args.prompts, "prompts file")):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: no such {what}")
    from .progress import write as progress_write

    prompts = read_prompts(args.prompts)
    summary = harvest(
        model,
        prompts,
        args.out,
        hidden=args.hidden,
        generate=args.generate,
        threads=args.threads,
        ram_budget=args.ram_budget,
        n_ctx=getattr(args, "ctx_size", 0) or 0,
        **session_kv_options(args),
        progress=lambda m: progress_write(f"sharpi trace: {m}"),
        progress_bar=True,
    )
    print(
        f"sharpi trace: wrote {summary['path']}: {summary['sequences']} sequences, {summary['tokens']} tokens "
        f"({summary['prompt_tokens']} prompt, {summary['generated_tokens']} generated), "
        f"{summary['moe_layers']} MoE layers x {summary['num_experts']} experts, top-{summary['top_k']}"
        f"{', with hidden states' if summary['hidden'] else ''} in {summary['seconds']:.1f} s",
        file=sys.stderr,
    )
    return 0
