"""Train the project's small MoE on the Python standard library (seeded, resumable, CPU).

Owns the run folder given as --out and nothing else:
  tokenizer.json                 byte-level BPE (bpe_tokenizer.py), trained on the train files only
  tokens_train.npy, tokens_heldout.npy   uint16 token streams (<|endoftext|> before every file)
  checkpoint.pt                  model + optimiser + step, rewritten atomically every --ckpt-every-s
  train_log.jsonl                one JSON line per logged step and per evaluation
  hf/                            the final model and tokenizer, written with save_pretrained
  result.json                    final held-out loss, per-layer balance, wall time
It never reads the held-out stream for anything but evaluation.

Determinism: parameters come from --seed; the training windows of step s are drawn from
numpy.random.default_rng([seed, s]), so a resumed run draws the same windows as an uninterrupted one.

Usage (the shipped model's command is in python/sharpi/models/MODEL_CARD.md):
    python tools/train_moe/train.py --out runs/stdlib-moe [--steps N] [--resume]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

# torch's OpenMP threads spin while waiting by default; on a machine whose cores other processes
# also use, a spinning thread holds a core its partner needs and a step takes 3-6x longer (measured
# here: 270-700 tok/s spinning vs 1350-1900 passive under load). Must be set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bpe_tokenizer
import corpus
from model import ArchConfig, build_model, per_layer_balance_losses, router_z_loss, selection_shares


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    # architecture
    p.add_argument("--vocab-size", type=int, default=3072)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--moe-ff", type=int, default=192)
    # optimisation
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument(
        "--bf16",
        type=int,
        default=1,
        help="1: forward under torch.autocast(bfloat16) (float32 master weights, float32 evaluation); "
        "uses the CPU's AVX-512 BF16 dot products, ~1.3-1.5x the float32 step rate here",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=0,
        help="total steps (fixed schedule, exactly reproducible); 0: set by --time-budget-min",
    )
    p.add_argument(
        "--time-budget-min",
        type=float,
        default=0.0,
        help="with --steps 0: train at constant LR until (1 - decay_frac) of this wall time has "
        "passed, then fix the total step count there (recorded in result.json)",
    )
    p.add_argument("--optimizer", choices=["muon", "adamw"], default="muon")
    p.add_argument(
        "--lr",
        type=float,
        default=3e-3,
        help="AdamW learning rate (all parameters with adamw; embeddings, norms and routers with muon)",
    )
    p.add_argument("--muon-lr", type=float, default=0.02)
    p.add_argument("--muon-weight-decay", type=float, default=0.0)
    p.add_argument("--min-lr-frac", type=float, default=0.02)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument(
        "--decay-frac", type=float, default=0.3, help="last fraction of steps spent decaying the LR"
    )
    p.add_argument(
        "--replay-lr",
        type=Path,
        default=None,
        help="result.json of an earlier run: take its step count and per-step LR (exact replay)",
    )
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--balance-coef", type=float, default=0.02, help="weight of each layer's balance term")
    p.add_argument("--z-coef", type=float, default=1e-3)
    # bookkeeping
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--eval-windows", type=int, default=24, help="held-out windows in periodic evals")
    p.add_argument("--ckpt-every-s", type=float, default=240.0)
    p.add_argument("--resume", action="store_true")
    return p.parse_args(argv)


def arch_from_args(args) -> ArchConfig:
    return ArchConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.moe_ff,
    )


def prepare_data(out: Path, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokenizer and token streams, built once per run folder."""
    out.mkdir(parents=True, exist_ok=True)
    train_path, heldout_path = out / "tokens_train.npy", out / "tokens_heldout.npy"
    if (out / "tokenizer.json").exists() and train_path.exists() and heldout_path.exists():
        return np.load(train_path), np.load(heldout_path)
    train_files, heldout_files = corpus.collect()
    problems = corpus.check_against_manifest(train_files, heldout_files)
    if problems:
        print(
            f"note: the local stdlib differs from {corpus.MANIFEST_PATH.name} in {len(problems)} places "
            f"(first: {problems[0]}); the run is still valid, its corpus is just not the shipped one"
        )
    tokenizer = bpe_tokenizer.train_tokenizer(train_files, vocab_size)
    tokenizer.save(str(out / "tokenizer.json"))
    train_tokens = bpe_tokenizer.encode_files(tokenizer, train_files)
    heldout_tokens = bpe_tokenizer.encode_files(tokenizer, heldout_files)
    np.save(train_path, train_tokens)
    np.save(heldout_path, heldout_tokens)
    (out / "corpus.json").write_text(json.dumps(corpus.manifest(train_files, heldout_files), indent=1))
    return train_tokens, heldout_tokens


def training_batch(tokens: np.ndarray, seed: int, step: int, batch: int, seq_len: int):
    """[batch, seq_len + 1] int64 windows at offsets drawn from rng([seed, step])."""
    import torch

    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch)
    rows = np.stack([tokens[s : s + seq_len + 1] for s in starts]).astype(np.int64)
    return torch.from_numpy(rows)


def heldout_windows(tokens: np.ndarray, seq_len: int) -> list[np.ndarray]:
    """The held-out stream cut into consecutive windows of seq_len tokens (the last may be shorter).
    The held-out loss predicts every token of a window after its first from the ones before it."""
    return [
        tokens[i : i + seq_len] for i in range(0, len(tokens), seq_len) if len(tokens[i : i + seq_len]) >= 2
    ]


def evaluate(model, windows: list[np.ndarray], top_k: int, batch: int = 8) -> dict:
    """Held-out cross-entropy (nats/token, mean over predicted tokens) and per-layer selection shares."""
    import torch

    model.eval()
    total_nll, total_count, share_sum, share_tokens = 0.0, 0, None, 0
    with torch.no_grad():
        same_length = [w for w in windows if len(w) == len(windows[0])]
        rest = [w for w in windows if len(w) != len(windows[0])]
        groups = [same_length[i : i + batch] for i in range(0, len(same_length), batch)] + [[w] for w in rest]
        for group in groups:
            ids = torch.from_numpy(np.stack(group).astype(np.int64))
            out = model(input_ids=ids, output_router_logits=True)
            logits = out.logits[:, :-1].reshape(-1, out.logits.shape[-1]).double()
            targets = ids[:, 1:].reshape(-1)
            total_nll += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
            total_count += targets.numel()
            shares = selection_shares(out.router_logits, top_k) * ids.numel()
            share_sum = shares if share_sum is None else share_sum + shares
            share_tokens += ids.numel()
    model.train()
    ce = total_nll / total_count
    return {
        "ce": ce,
        "ppl": math.exp(ce),
        "tokens": total_count,
        "shares": (share_sum / share_tokens).tolist(),
    }


def balance_summary(shares) -> dict:
    """Per layer: most-used and least-used expert's share relative to the uniform share 1/n_expert."""
    shares = np.asarray(shares)
    uniform = 1.0 / shares.shape[1]
    return {
        "max_over_uniform": (shares.max(axis=1) / uniform).round(3).tolist(),
        "min_over_uniform": (shares.min(axis=1) / uniform).round(3).tolist(),
    }


def args_dict(args) -> dict:
    """The command-line arguments as JSON-safe values (paths as strings)."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}


def decay_start(total_steps: int, decay_frac: float) -> int:
    return round(total_steps * (1.0 - decay_frac))


def lr_at(step: int, total_steps: int, args, elapsed_s: float = 0.0) -> float:
    """Warm-up-stable-decay: linear warm-up, constant, then linear decay to min_lr_frac * lr over the
    last decay_frac of the steps. total_steps = 0 means "not fixed yet" (time-budget mode, stable
    phase). In time-budget mode the decay also follows the clock: its progress is the larger of the
    step fraction and the time fraction of the decay window, so a machine that slows down (other
    processes taking the cores) shortens the decay instead of overrunning the budget. Every step's LR
    is recorded (result.json "lr_per_step"), and --replay-lr replays a run exactly."""
    progress = decay_progress(step, total_steps, args, elapsed_s)
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    if progress is None:
        return args.lr
    return args.lr * (1.0 - (1.0 - args.min_lr_frac) * min(1.0, progress))


def decay_progress(step: int, total_steps: int, args, elapsed_s: float):
    """None before the decay; else its progress (>= 1: training is over)."""
    if not total_steps:
        return None
    start = decay_start(total_steps, args.decay_frac)
    if step < start:
        return None
    progress = (step - start) / max(1, total_steps - start)
    if args.time_budget_min > 0:
        budget_s = args.time_budget_min * 60.0
        decay_start_s = (1.0 - args.decay_frac) * budget_s
        progress = max(progress, (elapsed_s - decay_start_s) / (budget_s - decay_start_s))
    return progress


def make_optimizers(model, args) -> list:
    """[(optimizer, base learning rate)]. With --optimizer muon: Muon for the attention projections
    and the expert matrices, AdamW for what is not a hidden-to-hidden matrix (embeddings, which are
    also the output matrix, norms, routers). With --optimizer adamw: AdamW for all. Weight decay on
    matrices only, never on norms."""
    import torch
    from muon import Muon

    muon_params, adam_decay, adam_no_decay = [], [], []
    for name, param in model.named_parameters():
        is_hidden_matrix = ("self_attn" in name and name.endswith("proj.weight")) or ".mlp.experts." in name
        if args.optimizer == "muon" and is_hidden_matrix:
            muon_params.append((param, 2 if name.endswith("gate_up_proj") else 1))
        elif param.ndim >= 2:
            adam_decay.append(param)
        else:
            adam_no_decay.append(param)
    adam = torch.optim.AdamW(
        [
            {"params": adam_decay, "weight_decay": args.weight_decay},
            {"params": adam_no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    optimizers = [(adam, args.lr)]
    if muon_params:
        optimizers.append(
            (
                Muon(muon_params, lr=args.muon_lr, momentum=0.95, weight_decay=args.muon_weight_decay),
                args.muon_lr,
            )
        )
    return optimizers


def save_checkpoint(
    path: Path, model, optimizers, step: int, wall_s: float, args, total_steps: int, lr_history: list
) -> None:
    import torch

    tmp = path.with_suffix(".tmp")
    torch.save(
        {
            "model": model.state_dict(),
            "optimizers": [o.state_dict() for o, _ in optimizers],
            "step": step,
            "total_steps": total_steps,
            "lr_per_step": lr_history,
            "wall_s": wall_s,
            "args": args_dict(args),
        },
        tmp,
    )
    os.replace(tmp, path)  # atomic: a crash mid-write leaves the previous checkpoint intact


def main(argv=None) -> None:
    import torch

    args = parse_args(argv)
    if args.steps <= 0 and args.time_budget_min <= 0 and not args.replay_lr:
        raise SystemExit("give --steps N, --time-budget-min M or --replay-lr RESULT_JSON")
    torch.set_num_threads(args.threads)
    out = args.out
    log_path, ckpt_path = out / "train_log.jsonl", out / "checkpoint.pt"
    t_start = time.perf_counter()

    train_tokens, heldout_tokens = prepare_data(out, args.vocab_size)
    arch = arch_from_args(args)
    model = build_model(arch, args.seed)
    model.train()
    optimizers = make_optimizers(model, args)
    step, wall_before, total_steps = 0, 0.0, args.steps
    lr_history: list = []
    replay = json.loads(args.replay_lr.read_text())["lr_per_step"] if args.replay_lr else None
    if replay:
        total_steps = len(replay)
    if args.resume and ckpt_path.exists():
        state = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(state["model"])
        for (optimizer, _), saved in zip(optimizers, state["optimizers"]):
            optimizer.load_state_dict(saved)
        step, wall_before = state["step"], state["wall_s"]
        total_steps = total_steps or state.get("total_steps", 0)
        # Checkpoints written before per-step LRs were recorded: their steps ran the step-based
        # schedule, which is recomputed here.
        lr_history = state.get("lr_per_step") or [
            lr_at(s, total_steps, argparse.Namespace(**(vars(args) | {"time_budget_min": 0.0})))
            for s in range(step)
        ]
        print(f"resumed at step {step} ({wall_before:.0f} s of earlier wall time)", flush=True)
    elif not args.resume:
        log_path.unlink(missing_ok=True)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"arch {arch.as_dict()}\nparameters {n_params / 1e6:.2f} M; train tokens {len(train_tokens)}, "
        f"held-out tokens {len(heldout_tokens)}; steps of {args.batch}x{args.seq_len}: "
        f"{total_steps or f'set after {(1 - args.decay_frac) * args.time_budget_min:.1f} min'}",
        flush=True,
    )

    windows = heldout_windows(heldout_tokens, args.seq_len)
    # Periodic evaluations use evenly spaced full windows; the final one uses all of them.
    probe = [windows[i] for i in np.linspace(0, len(windows) - 2, args.eval_windows).astype(int)]
    log = open(log_path, "a")  # noqa: SIM115 (held across the loop, closed after the final evaluation)

    def elapsed() -> float:
        return wall_before + time.perf_counter() - t_start

    last_ckpt = time.perf_counter()
    t_log, tokens_since = time.perf_counter(), 0
    while total_steps == 0 or step < total_steps:
        if total_steps == 0 and elapsed() >= (1.0 - args.decay_frac) * args.time_budget_min * 60:
            total_steps = max(step + 1, math.ceil(step / (1.0 - args.decay_frac)))
            log.write(json.dumps({"step": step, "total_steps_fixed": total_steps}) + "\n")
            print(
                f"time budget: stable phase over at step {step}; total steps fixed at {total_steps}",
                flush=True,
            )
        if replay:
            lr = replay[step]
        else:
            progress = decay_progress(step, total_steps, args, elapsed())
            if progress is not None and progress >= 1.0:
                print(f"time budget: decay complete at step {step} ({elapsed() / 60:.1f} min)", flush=True)
                break
            lr = lr_at(step, total_steps, args, elapsed())
        lr_history.append(lr)
        for optimizer, base_lr in optimizers:
            for group in optimizer.param_groups:
                group["lr"] = base_lr * lr / args.lr
        batch = training_batch(train_tokens, args.seed, step, args.batch, args.seq_len)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(args.bf16)):
            out_model = model(input_ids=batch[:, :-1], output_router_logits=True)
        logits = out_model.logits.float().reshape(-1, arch.vocab_size)
        ce = torch.nn.functional.cross_entropy(logits, batch[:, 1:].reshape(-1))
        balance = per_layer_balance_losses(out_model.router_logits, arch.num_experts_per_tok)
        z = router_z_loss(out_model.router_logits)
        loss = ce + args.balance_coef * balance.sum() + args.z_coef * z
        for optimizer, _ in optimizers:
            optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        for optimizer, _ in optimizers:
            optimizer.step()
        step += 1
        tokens_since += batch.shape[0] * args.seq_len

        if step % args.log_every == 0 or step == total_steps:
            shares = selection_shares(out_model.router_logits, arch.num_experts_per_tok)
            summary = balance_summary(shares)
            now = time.perf_counter()
            record = {
                "step": step,
                "ce": round(ce.item(), 4),
                "balance": [round(b, 3) for b in balance.tolist()],
                "z": round(z.item(), 3),
                "lr": lr,
                "grad_norm": round(grad_norm.item(), 3),
                "tok_per_s": round(tokens_since / (now - t_log)),
                "wall_s": round(elapsed(), 1),
                "max_share": summary["max_over_uniform"],
                "min_share": summary["min_over_uniform"],
            }
            t_log, tokens_since = now, 0
            log.write(json.dumps(record) + "\n")
            log.flush()
            print(
                f"step {step} ce {record['ce']:.3f} bal max {max(record['balance']):.3f} "
                f"maxshare {max(summary['max_over_uniform']):.2f} minshare {min(summary['min_over_uniform']):.2f} "
                f"lr {lr:.2e} gn {record['grad_norm']:.2f} {record['tok_per_s']} tok/s {record['wall_s']:.0f}s",
                flush=True,
            )
        if step % args.eval_every == 0 and step != total_steps:
            result = evaluate(model, probe, arch.num_experts_per_tok)
            summary = balance_summary(result["shares"])
            log.write(json.dumps({"step": step, "eval_probe_ce": result["ce"], **summary}) + "\n")
            log.flush()
            print(
                f"eval step {step}: held-out probe ce {result['ce']:.3f} | max share/uniform per layer "
                f"{summary['max_over_uniform']} min {summary['min_over_uniform']}",
                flush=True,
            )
        if time.perf_counter() - last_ckpt > args.ckpt_every_s:
            save_checkpoint(ckpt_path, model, optimizers, step, elapsed(), args, total_steps, lr_history)
            last_ckpt = time.perf_counter()

    save_checkpoint(ckpt_path, model, optimizers, step, elapsed(), args, total_steps, lr_history)
    train_wall = elapsed()
    result = evaluate(model, windows, arch.num_experts_per_tok)
    summary = balance_summary(result["shares"])
    model.eval()
    model.save_pretrained(out / "hf")
    tokenizer = bpe_tokenizer.hf_tokenizer(bpe_tokenizer.load_tokenizer(out))
    tokenizer.save_pretrained(out / "hf")
    final = {
        "heldout_ce": result["ce"],
        "heldout_ppl": result["ppl"],
        "heldout_tokens": result["tokens"],
        "seq_len": args.seq_len,
        "selection_shares": result["shares"],
        **summary,
        "train_wall_s": train_wall,
        "steps": step,
        "lr_per_step": lr_history,
        "train_tokens": len(train_tokens),
        "args": args_dict(args),
        "arch": arch.as_dict(),
        "parameters": n_params,
    }
    (out / "result.json").write_text(json.dumps(final, indent=1))
    log.write(json.dumps({"final": True, "heldout_ce": result["ce"], "train_wall_s": train_wall}) + "\n")
    log.close()
    print(
        f"done: held-out ce {result['ce']:.4f} (ppl {result['ppl']:.2f}) on {result['tokens']} tokens; "
        f"training wall time {train_wall / 60:.1f} min\nmax share/uniform {summary['max_over_uniform']}\n"
        f"min share/uniform {summary['min_over_uniform']}",
        flush=True,
    )


if __name__ == "__main__":
    main()
