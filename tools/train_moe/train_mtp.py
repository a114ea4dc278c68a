"""Train a multi-token-prediction (MTP) head for the shipped model and write it as a sidecar GGUF.

The head is DeepSeek-V3's / Qwen3.5's MTP module on top of the frozen trunk of
python/sharpi/models/stdlib-moe-q8_0.gguf (docs/speculative.md, "The MTP block"):

    z  = eh_proj([enorm(embed(x_{p+1})) | hnorm(h_p)])      h_p: the trunk's hidden after its output norm
    o  = one qwen3moe decoder layer on z (causal over the pairs, RoPE position p + 1)
    logits = lm_head(shared_head_norm(o))                    (the trunk's tied embeddings, frozen)

trained to predict x_{p+2}: the token after the next, so the trunk's next token and the head's
guess of the one after it make a two-token step. The layer starts as a copy of the trunk's last
layer; the trunk and the embeddings never change.

Data: the standard library's train files (tools/train_moe/corpus.py's split), tokenized with the
shipped file's own tokenizer, <|endoftext|> before every file as the trunk was trained; the
held-out files are only read for the final evaluation.

Output: a GGUF holding only the block (blk.<n_layer>.* with its nextn.* tensors) plus the trunk's
metadata, token_embd and output_norm, as llama.cpp's `convert_hf_to_gguf.py --mtp` lays out a
draft head: `sharpi run --spec-type draft-mtp -md FILE` (or Session(mtp=FILE)) loads it beside the
trunk. Matrices Q8_0 like the trunk, norms F32.

    python tools/train_moe/train_mtp.py --out runs/stdlib-moe-mtp --time-budget-min 25
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see train.py

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "python"))

import corpus
import gguf_weights

SHIPPED = ROOT / "python/sharpi/models/stdlib-moe-q8_0.gguf"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--trunk", type=Path, default=SHIPPED)
    p.add_argument("--time-budget-min", type=float, default=25.0)
    p.add_argument("--max-steps", type=int, default=100000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--eval-only", action="store_true",
                   help="skip training: evaluate OUT/stdlib-moe-mtp-q8_0.gguf and write the card")
    p.add_argument("--card", type=Path, default=ROOT / "python/sharpi/models/MTP_CARD.md")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------- data


def encode(session, files, eot: int) -> np.ndarray:
    """One uint16 stream: <|endoftext|> before every file, then its tokens (as train.py's)."""
    pieces = []
    for f in files:
        pieces.append(np.array([eot], dtype=np.uint16))
        pieces.append(np.asarray(session.tokenize(f.text, add_bos=False), dtype=np.uint16))
    return np.concatenate(pieces)


def batch_windows(tokens: np.ndarray, seed: int, step: int, batch: int, seq_len: int):
    import torch

    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch)
    return torch.from_numpy(np.stack([tokens[s : s + seq_len] for s in starts]).astype(np.int64))


# ---------------------------------------------------------------------------------------- model


def rms_norm(x, w, eps):
    import torch

    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, positions, theta: float):
    """NeoX RoPE over the whole head ([B, T, H, D]): pairs (i, i + D/2), as qwen3moe does."""
    import torch

    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = positions[:, None].float() * inv[None, :]  # [T, D/2]
    cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class MtpHead:
    """The head's parameters (torch tensors with requires_grad) and its forward pass."""

    def __init__(self, tensors: dict, meta: dict):
        import torch

        p = "qwen3moe."
        self.n_layer = meta[p + "block_count"]
        self.E = meta[p + "embedding_length"]
        self.H, self.Hkv, self.D = (meta[p + "attention.head_count"], meta[p + "attention.head_count_kv"],
                                    meta[p + "attention.key_length"])
        self.k = meta[p + "expert_used_count"]
        self.eps = float(meta[p + "attention.layer_norm_rms_epsilon"])
        self.theta = float(meta[p + "rope.freq_base"])
        last = f"blk.{self.n_layer - 1}."

        def param(array):
            return torch.nn.Parameter(torch.from_numpy(np.array(array, dtype=np.float32)))

        rng = np.random.default_rng(0)
        E = self.E
        self.params = {
            # The block starts as the trunk's last layer; the projection as [0 | I] (the hidden
            # state through, the embedding's share learnt) plus noise.
            **{name: param(tensors[last + name]) for name in (
                "attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
                "attn_q_norm.weight", "attn_k_norm.weight", "ffn_norm.weight", "ffn_gate_inp.weight",
                "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")},
            "nextn.eh_proj.weight": param(np.concatenate([0.02 * rng.standard_normal((E, E)), np.eye(E)], axis=1)),
            "nextn.enorm.weight": param(np.ones(E)),
            "nextn.hnorm.weight": param(np.ones(E)),
            "nextn.shared_head_norm.weight": param(tensors["output_norm.weight"]),
        }
        self.embed = torch.from_numpy(tensors["token_embd.weight"])  # frozen, tied lm_head

    def forward(self, h, next_tokens):
        """h: [B, T, E] trunk hidden (normed) of positions 0..T-1; next_tokens: [B, T] tokens 1..T.
        Returns logits [B, T, V] for tokens 2..T+1."""
        import torch
        import torch.nn.functional as F

        w = self.params
        B, T, E = h.shape
        z = torch.cat([rms_norm(self.embed[next_tokens], w["nextn.enorm.weight"], self.eps),
                       rms_norm(h, w["nextn.hnorm.weight"], self.eps)], dim=-1) @ w["nextn.eh_proj.weight"].T
        x = rms_norm(z, w["attn_norm.weight"], self.eps)
        q = (x @ w["attn_q.weight"].T).view(B, T, self.H, self.D)
        k = (x @ w["attn_k.weight"].T).view(B, T, self.Hkv, self.D)
        v = (x @ w["attn_v.weight"].T).view(B, T, self.Hkv, self.D)
        q = rms_norm(q, w["attn_q_norm.weight"], self.eps)
        k = rms_norm(k, w["attn_k_norm.weight"], self.eps)
        positions = torch.arange(1, T + 1)
        q, k = rope(q, positions, self.theta), rope(k, positions, self.theta)
        rep = self.H // self.Hkv
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        z = z + att.transpose(1, 2).reshape(B, T, self.H * self.D) @ w["attn_output.weight"].T
        x = rms_norm(z, w["ffn_norm.weight"], self.eps).reshape(B * T, E)
        probs = torch.softmax(x @ w["ffn_gate_inp.weight"].T, dim=-1)
        top, idx = torch.topk(probs, self.k, dim=-1)
        top = top / top.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(probs.shape[-1]):
            rows, slot = (idx == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            xe = x[rows]
            y = (F.silu(xe @ w["ffn_gate_exps.weight"][e].T) * (xe @ w["ffn_up_exps.weight"][e].T)) @ \
                w["ffn_down_exps.weight"][e].T
            out = out.index_add(0, rows, y * top[rows, slot, None])
        z = z + out.view(B, T, E)
        return rms_norm(z, w["nextn.shared_head_norm.weight"], self.eps) @ self.embed.T


# ---------------------------------------------------------------------------------------- export


def write_sidecar(path: Path, trunk: Path, head: MtpHead, tensors: dict) -> None:
    """The head as llama.cpp's --mtp export lays a draft head out: the trunk's metadata with
    block_count + 1 and nextn_predict_layers 1, token_embd and output_norm, then blk.<n_layer>."""
    import gguf

    reader = gguf.GGUFReader(str(trunk))
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.name"):
            continue
        vtype = field.types[0]
        if key == "qwen3moe.block_count":
            writer.add_uint32(key, head.n_layer + 1)
            continue
        if vtype == gguf.GGUFValueType.ARRAY:
            sub = field.types[1]
            if sub == gguf.GGUFValueType.STRING:
                value = [bytes(field.parts[i]).decode("utf-8", errors="surrogateescape") for i in field.data]
            else:
                value = [field.parts[i].tolist()[0] for i in field.data]
            writer.add_array(key, value)
        elif vtype == gguf.GGUFValueType.STRING:
            writer.add_string(key, bytes(field.parts[field.data[0]]).decode())
        else:
            writer.add_key_value(key, field.parts[field.data[0]].tolist()[0], vtype)
    writer.add_uint32("qwen3moe.nextn_predict_layers", 1)
    writer.add_string("general.name", "stdlib-moe MTP head (sharpi tools/train_moe/train_mtp.py)")

    def add(name, array, quantize):
        array = np.ascontiguousarray(np.asarray(array, dtype=np.float32))
        if quantize:
            data = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, array)

    add("token_embd.weight", tensors["token_embd.weight"], True)
    add("output_norm.weight", tensors["output_norm.weight"], False)
    b = f"blk.{head.n_layer}."
    for name, value in head.params.items():
        array = value.detach().numpy()
        add(b + name, array, array.ndim >= 2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# ---------------------------------------------------------------------------------------- evaluation


def evaluate_drafting(trunk: Path, sidecar: Path, n_prompts: int = 16, n_gen: int = 128, n_draft: int = 3) -> dict:
    """Greedy generation with the head drafting (sharpi, draft-mtp, n_draft tokens per step) after
    the first 24 lines of each of the first n_prompts held-out files: draft tokens kept, the rate
    per draft position given the earlier ones were kept, and tokens per verify step."""
    import sharpi
    from sharpi.speculative import open_speculation

    _, heldout = corpus.collect()
    prompts = ["\n".join(f.text.splitlines()[:24]) + "\n" for f in heldout[:n_prompts]]
    s = sharpi.Session(str(trunk), threads=2, mtp=str(sidecar), max_draft_tokens=n_draft)
    spec = open_speculation(s, "draft-mtp", n_max=n_draft)
    reached, kept, steps, tokens = [0] * n_draft, [0] * n_draft, 0, 0
    for prompt in prompts:
        s.reset()
        for _ in s.generate(prompt, max_tokens=n_gen, temperature=0.0, stop_at_eos=False, speculative=spec):
            pass
        st = s.last_stats
        steps += st["spec_steps"]
        tokens += st["n_generated"]
        drafted, accepted = st["spec_drafted_at"], st["spec_accepted_at"]
        for i in range(len(drafted)):
            kept[i] += accepted[i]
            # Position i is examined when a draft had it and every earlier draft token was kept.
            reached[i] += drafted[i] if i == 0 else min(accepted[i - 1], drafted[i])
    return {"prompts": len(prompts), "tokens": tokens, "verify_steps": steps, "n_draft": n_draft,
            "kept_per_position": [round(k / steps, 4) for k in kept],
            "conditional_per_position": [round(k / r, 4) if r else 0.0 for k, r in zip(kept, reached)],
            "tokens_per_step": round(tokens / steps, 3)}


def write_card(path: Path, result: dict, drafting: dict, size: int) -> None:
    lines = [
        "# stdlib-moe-mtp-q8_0.gguf",
        "",
        "The multi-token-prediction (MTP) head of the shipped model `stdlib-moe-q8_0.gguf`: one qwen3moe",
        "decoder layer (as the trunk's, 16 experts top-2) with DeepSeek-V3's MTP projection, predicting the",
        "token after next from the trunk's hidden state and the next token (docs/speculative.md). Trained",
        "with the trunk frozen on the same train files, written as a file holding only the block beside",
        "the trunk's metadata, embeddings and norm (llama.cpp's `--mtp` export layout). `sharpi run",
        "--spec-type draft-mtp` uses it for the shipped model. Written by tools/train_moe/train_mtp.py",
        "(nothing typed by hand).",
        "",
        f"- file: {size / 2**20:.2f} MiB (matrices Q8_0, norms F32)",
        (f"- training: {result['steps']} steps of {result.get('batch', 8)} x {result.get('seq_len', 256)} tokens in "
        f"{result['train_minutes']} min on this machine's CPU (`python tools/train_moe/train_mtp.py --out "
        "runs/stdlib-moe-mtp --time-budget-min 25`)"),
        (f"- held-out, teacher-forced ({result['heldout_tokens']} positions): cross-entropy of the token after "
        f"next {result['heldout_ce_token_after_next']} nats, top-1 {result['heldout_top1_token_after_next']:.1%}"),
        "",
        (f"Drafting in sharpi (greedy, {drafting['n_draft']} draft tokens per step, {drafting['prompts']} held-out "
        f"files' first 24 lines as prompts, {drafting['tokens']} tokens generated):"),
        "",
        "| draft position | kept (of all verify steps) | kept when reached |",
        "|---|---|---|",
    ]
    for i, (k, c) in enumerate(zip(drafting["kept_per_position"], drafting["conditional_per_position"])):
        lines.append(f"| {i + 1} | {k:.1%} | {c:.1%} |")
    lines += ["", f"Tokens per verify step: {drafting['tokens_per_step']}.", ""]
    path.write_text("\n".join(lines), encoding="utf-8")


# ---------------------------------------------------------------------------------------- main


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    sidecar = args.out / "stdlib-moe-mtp-q8_0.gguf"
    if args.eval_only:
        result = json.loads((args.out / "result.json").read_text())
        drafting = evaluate_drafting(args.trunk, sidecar)
        (args.out / "drafting.json").write_text(json.dumps(drafting, indent=1))
        write_card(args.card, result, drafting, sidecar.stat().st_size)
        print(json.dumps(drafting), flush=True)
        return
    import sharpi

    session = sharpi.Session(str(args.trunk), threads=args.threads)
    tok = session.tokenizer
    eot = tok.eos_id
    train_path, heldout_path = args.out / "tokens_train.npy", args.out / "tokens_heldout.npy"
    if train_path.exists() and heldout_path.exists():
        train_tokens, heldout_tokens = np.load(train_path), np.load(heldout_path)
    else:
        train_files, heldout_files = corpus.collect()
        train_tokens, heldout_tokens = encode(session, train_files, eot), encode(session, heldout_files, eot)
        np.save(train_path, train_tokens)
        np.save(heldout_path, heldout_tokens)
    print(f"train {len(train_tokens)} tokens, held-out {len(heldout_tokens)}", flush=True)

    tensors = gguf_weights.read_tensors(args.trunk)
    meta = gguf_weights.read_metadata(args.trunk)
    trunk, _ = gguf_weights.load_model(args.trunk)
    for p in trunk.parameters():
        p.requires_grad_(False)
    head = MtpHead(tensors, meta)
    opt = torch.optim.AdamW(list(head.params.values()), lr=args.lr, weight_decay=0.0)
    t0 = time.time()
    budget = args.time_budget_min * 60
    log_path = args.out / "train_log.jsonl"

    def hidden(windows):
        with torch.no_grad():
            return trunk.model(input_ids=windows).last_hidden_state  # after the output norm

    step = 0
    while step < args.max_steps and time.time() - t0 < budget:
        frac = (time.time() - t0) / budget
        for g in opt.param_groups:
            g["lr"] = args.lr * (min(1.0, (step + 1) / 100) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        windows = batch_windows(train_tokens, args.seed, step, args.batch, args.seq_len + 2)
        h = hidden(windows[:, :-2])
        logits = head.forward(h, windows[:, 1:-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 2:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0:
            line = {"step": step, "loss": round(loss.item(), 4), "elapsed_s": round(time.time() - t0, 1)}
            print(json.dumps(line), flush=True)
            with log_path.open("a") as log:
                log.write(json.dumps(line) + "\n")
        step += 1

    # Held-out: the head's cross-entropy and its top-1 agreement with the token after next.
    with torch.no_grad():
        n, ce, hits = 0, 0.0, 0
        for i in range(0, len(heldout_tokens) - args.seq_len - 2, args.seq_len):
            w = torch.from_numpy(heldout_tokens[i : i + args.seq_len + 2].astype(np.int64))[None]
            logits = head.forward(hidden(w[:, :-2]), w[:, 1:-1])[0]
            target = w[0, 2:]
            ce += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
            hits += int((logits.argmax(-1) == target).sum())
            n += target.numel()
    result = {"steps": step, "batch": args.batch, "seq_len": args.seq_len,
              "train_minutes": round((time.time() - t0) / 60, 1),
              "heldout_ce_token_after_next": round(ce / n, 4), "heldout_top1_token_after_next": round(hits / n, 4),
              "heldout_tokens": n}
    print(json.dumps(result), flush=True)
    (args.out / "result.json").write_text(json.dumps(result, indent=1))
    write_sidecar(args.out / "stdlib-moe-mtp-q8_0.gguf", args.trunk, head, tensors)
    print(f"wrote {args.out / 'stdlib-moe-mtp-q8_0.gguf'}", flush=True)


if __name__ == "__main__":
    main()
