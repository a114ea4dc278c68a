"""DeepSeek-V4 (GGUF arch deepseek4) in float64 numpy, straight from a GGUF file's dequantized
weights (the gguf package dequantizes; nothing of sharpi is used). The whole prompt in one
stateless pass, as transformers runs it without a cache: every closed window's compressed entry,
a query at position t seeing entries w < (t + 1) / ratio; the indexer keeps the top_k by score
(equal scores: the lower entry). docs/design.md §12 has the architecture; transformers'
modeling_deepseek_v4.py is the other oracle (tests/test_deepseek4.py holds this one to it).
"""

from __future__ import annotations

import math

import numpy as np


def sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


class Deepseek4Reference:
    def __init__(self, path):
        import gguf

        reader = gguf.GGUFReader(str(path))
        md = {name: f.contents() for name, f in reader.fields.items() if f.types}
        a = "deepseek4."
        self.md = md
        self.n_embd = int(md[a + "embedding_length"])
        self.n_head = int(md[a + "attention.head_count"])
        self.head_dim = int(md[a + "attention.key_length"])
        self.n_rot = int(md[a + "rope.dimension_count"])
        self.eps = float(md[a + "attention.layer_norm_rms_epsilon"])
        self.window = int(md[a + "attention.sliding_window"])
        # Per-block arrays also hold the MTP blocks' entries (a --mtp sidecar's, and a trunk file's
        # when the checkpoint's config lists them): the trunk is block_count - nextn_predict_layers.
        self.ratios = [int(r) for r in md[a + "attention.compress_ratios"]]
        self.n_layer = int(md[a + "block_count"]) - int(md.get(a + "nextn_predict_layers", 0))
        self.n_hc = int(md[a + "hyper_connection.count"])
        self.sinkhorn = int(md[a + "hyper_connection.sinkhorn_iterations"])
        self.hc_eps = float(md[a + "hyper_connection.epsilon"])
        self.o_groups = int(md[a + "attention.output_group_count"])
        self.o_rank = int(md[a + "attention.output_lora_rank"])
        self.idx_heads = int(md.get(a + "attention.indexer.head_count", 0))
        self.idx_dim = int(md.get(a + "attention.indexer.key_length", 0))
        self.top_k = int(md.get(a + "attention.indexer.top_k", 0))
        self.n_hash = int(md.get(a + "hash_layer_count", 0))
        self.k = int(md[a + "expert_used_count"])
        self.scale = float(md.get(a + "expert_weights_scale", 1.0))
        self.norm_topk = bool(md.get(a + "expert_weights_norm", True))
        self.clamp_exp = [float(v) for v in md.get(a + "swiglu_clamp_exp", [0.0] * self.n_layer)]
        self.clamp_shexp = [float(v) for v in md.get(a + "swiglu_clamp_shexp", self.clamp_exp)]
        self.base = float(md.get(a + "rope.freq_base", 10000.0))
        self.compress_base = float(md[a + "attention.compress_rope_freq_base"])
        self.yarn = None
        if md.get(a + "rope.scaling.type") == "yarn":
            self.yarn = (float(md[a + "rope.scaling.factor"]), int(md[a + "rope.scaling.original_context_length"]),
                         float(md.get(a + "rope.scaling.yarn_beta_fast", 32.0)),
                         float(md.get(a + "rope.scaling.yarn_beta_slow", 1.0)))  # fmt: skip
        self.t = {}
        for t in reader.tensors:
            if t.tensor_type == gguf.GGMLQuantizationType.I32:
                self.t[t.name] = np.array(t.data, dtype=np.int64)
            else:
                self.t[t.name] = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float64)

    # -- pieces ------------------------------------------------------------------------------------

    def rms(self, x, weight=None):
        y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return y if weight is None else y * weight

    def angles(self, positions, compress: bool):
        """[n, n_rot / 2] rotation angles (YaRN on the compressed branches only)."""
        base = self.compress_base if compress else self.base
        i = np.arange(self.n_rot // 2, dtype=np.float64)
        inv_freq = base ** (-2.0 * i / self.n_rot)
        pos = np.asarray(positions, dtype=np.float64)[:, None]
        theta = pos * inv_freq
        if compress and self.yarn is not None:
            factor, n_orig, beta_fast, beta_slow = self.yarn

            def corr(n_rotations):
                return self.n_rot * math.log(n_orig / (n_rotations * 2 * math.pi)) / (2 * math.log(base))

            low = max(0.0, math.floor(corr(beta_fast)))
            high = min(self.n_rot - 1.0, math.ceil(corr(beta_slow)))
            mix = 1.0 - np.clip((i - low) / max(0.001, high - low), 0.0, 1.0)
            theta = (pos * inv_freq / factor) * (1 - mix) + theta * mix
        return theta

    def rope(self, x, positions, compress: bool):
        """RoPE on the trailing n_rot dims of x [n, ..., d], adjacent pairs, position per row."""
        theta = self.angles(positions, compress)
        shape = (theta.shape[0],) + (1,) * (x.ndim - 2) + (theta.shape[1],)
        cos, sin = np.cos(theta).reshape(shape), np.sin(theta).reshape(shape)
        out = x.copy()
        r = out[..., x.shape[-1] - self.n_rot :]
        x0, x1 = r[..., 0::2].copy(), r[..., 1::2].copy()
        r[..., 0::2] = x0 * cos - x1 * sin
        r[..., 1::2] = x0 * sin + x1 * cos
        return out

    def compress(self, kv, gate, ratio, coff, d, norm):
        """Entries of every closed window: kv / gate [T, coff * d] (gate with ape added)."""
        n_win = kv.shape[0] // ratio
        out = np.zeros((n_win, d))
        for w in range(n_win):
            cur = slice(w * ratio, (w + 1) * ratio)
            if coff == 2:
                vals, gates = [kv[cur, d:]], [gate[cur, d:]]
                if w > 0:
                    prev = slice((w - 1) * ratio, w * ratio)
                    vals.insert(0, kv[prev, :d])
                    gates.insert(0, gate[prev, :d])
                v, g = np.concatenate(vals), np.concatenate(gates)
            else:
                v, g = kv[cur], gate[cur]
            p = np.exp(g - g.max(axis=0))
            out[w] = (v * (p / p.sum(axis=0))).sum(axis=0)
        out = self.rms(out, norm)
        return self.rope(out, np.arange(n_win) * ratio, compress=True)

    def hyper(self, X, prefix, block):
        T, N = X.shape[0], self.n_hc
        flat = self.rms(X.reshape(T, -1))
        m = flat @ self.t[prefix + "_fn.weight"].T
        base, s = self.t[prefix + "_base.weight"], self.t[prefix + "_scale.weight"]
        pre = sigmoid(m[:, :N] * s[0] + base[:N]) + self.hc_eps
        post = 2.0 * sigmoid(m[:, N : 2 * N] * s[1] + base[N : 2 * N])
        c = m[:, 2 * N :].reshape(T, N, N) * s[2] + base[2 * N :].reshape(N, N)
        c = np.exp(c - c.max(axis=-1, keepdims=True))
        c = c / c.sum(axis=-1, keepdims=True) + self.hc_eps
        c = c / (c.sum(axis=-2, keepdims=True) + self.hc_eps)
        for _ in range(self.sinkhorn - 1):
            c = c / (c.sum(axis=-1, keepdims=True) + self.hc_eps)
            c = c / (c.sum(axis=-2, keepdims=True) + self.hc_eps)
        out = block((pre[:, :, None] * X).sum(axis=1))
        return post[:, :, None] * out[:, None, :] + np.einsum("tjk,tjd->tkd", c, X)

    def attention(self, il, x, pos0=0):
        b = f"blk.{il}."
        T, H, D = x.shape[0], self.n_head, self.head_dim
        ratio = self.ratios[il]
        compressed = ratio > 0
        assert pos0 == 0 or not compressed, "compressed windows close at absolute positions"
        pos = pos0 + np.arange(T)
        qr = self.rms(x @ self.t[b + "attn_q_a.weight"].T, self.t[b + "attn_q_a_norm.weight"])
        q = self.rms((qr @ self.t[b + "attn_q_b.weight"].T).reshape(T, H, D))
        q = self.rope(q, pos, compressed)
        kv = self.rope(self.rms(x @ self.t[b + "attn_kv.weight"].T, self.t[b + "attn_kv_a_norm.weight"]), pos,
                       compressed)  # fmt: skip
        entries = scores = None
        if compressed:
            coff = 2 if ratio == 4 else 1
            ape = self.t[b + "attn_compressor_ape.weight"]
            ckv = x @ self.t[b + "attn_compressor_kv.weight"].T
            cg = x @ self.t[b + "attn_compressor_gate.weight"].T + ape[pos % ratio]
            entries = self.compress(ckv, cg, ratio, coff, D, self.t[b + "attn_compressor_norm.weight"])
        if ratio == 4:
            Hi, Di = self.idx_heads, self.idx_dim
            iape = self.t[b + "indexer_compressor_ape.weight"]
            ikv = x @ self.t[b + "indexer_compressor_kv.weight"].T
            ig = x @ self.t[b + "indexer_compressor_gate.weight"].T + iape[pos % ratio]
            ik = self.compress(ikv, ig, ratio, 2, Di, self.t[b + "indexer_compressor_norm.weight"])
            iq = self.rope((qr @ self.t[b + "indexer.attn_q_b.weight"].T).reshape(T, Hi, Di), pos, True)
            iw = (x @ self.t[b + "indexer.proj.weight"].T) / math.sqrt(Hi)
            dots = np.maximum(np.einsum("thd,wd->thw", iq, ik), 0.0) / math.sqrt(Di)
            scores = np.einsum("th,thw->tw", iw, dots)
        sinks = self.t[b + "attn_sinks.weight"]
        o = np.zeros((T, H, D))
        for t in range(T):
            keys = [kv[max(0, t - self.window + 1) : t + 1]]
            if compressed:
                n = (t + 1) // ratio
                chosen = np.arange(n)
                if ratio == 4 and n > self.top_k:
                    order = sorted(range(n), key=lambda w: (-scores[t, w], w))
                    chosen = np.array(sorted(order[: self.top_k]))
                keys.append(entries[chosen])
            K = np.concatenate(keys)
            logits = q[t] @ K.T / math.sqrt(D)  # [H, n_keys]
            mx = np.maximum(logits.max(axis=1), sinks)
            p = np.exp(logits - mx[:, None])
            p = p / (p.sum(axis=1) + np.exp(sinks - mx))[:, None]
            o[t] = p @ K
        o = self.rope(o, -pos, compressed)  # V carried RoPE: rotate back by the query's position
        G, R = self.o_groups, self.o_rank
        og = o.reshape(T, G, -1)
        wa = self.t[b + "attn_output_a.weight"].reshape(G, R, -1)
        y = np.einsum("tgi,gri->tgr", og, wa).reshape(T, G * R)
        return y @ self.t[b + "attn_output_b.weight"].T

    def moe(self, il, x, tokens):
        b = f"blk.{il}."
        T = x.shape[0]
        logits = x @ self.t[b + "ffn_gate_inp.weight"].T
        scores = np.sqrt(np.logaddexp(0.0, logits))
        if il < self.n_hash:
            ids = self.t[b + "ffn_gate_tid2eid.weight"][np.asarray(tokens)]
        else:
            sel = scores + self.t[b + "exp_probs_b.bias"]
            ids = np.array([sorted(range(sel.shape[1]), key=lambda e: (-sel[t, e], e))[: self.k] for t in range(T)])
        w = np.take_along_axis(scores, ids, axis=1)
        if self.norm_topk:
            w = w / w.sum(axis=1, keepdims=True)
        w = w * self.scale

        def glu(x, g, u, d, limit):
            gate, up = x @ g.T, x @ u.T
            if limit > 0:
                gate, up = np.minimum(gate, limit), np.clip(up, -limit, limit)
            return (gate / (1.0 + np.exp(-gate)) * up) @ d.T

        gate_e, up_e, down_e = (self.t[b + f"ffn_{p}_exps.weight"] for p in ("gate", "up", "down"))
        out = np.zeros_like(x)
        for t in range(T):
            for j in range(self.k):
                e = ids[t, j]
                out[t] += w[t, j] * glu(x[t], gate_e[e], up_e[e], down_e[e], self.clamp_exp[il])
        shared = glu(x, self.t[b + "ffn_gate_shexp.weight"], self.t[b + "ffn_up_shexp.weight"],
                     self.t[b + "ffn_down_shexp.weight"], self.clamp_shexp[il])  # fmt: skip
        return out + shared

    def layer(self, il, X, tokens, pos0=0):
        """Block il on the streams X [T, n_hc, n_embd] (positions pos0..)."""
        b = f"blk.{il}."
        attn_norm, ffn_norm = self.t[b + "attn_norm.weight"], self.t[b + "ffn_norm.weight"]
        X = self.hyper(X, b + "hc_attn", lambda c: self.attention(il, self.rms(c, attn_norm), pos0))
        return self.hyper(X, b + "hc_ffn", lambda c: self.moe(il, self.rms(c, ffn_norm), tokens))

    def streams(self, tokens) -> np.ndarray:
        """[n_tokens, n_hc, n_embd]: the trunk's last layer output (what the MTP block takes)."""
        e = self.t["token_embd.weight"][np.asarray(tokens)]
        X = np.repeat(e[:, None, :], self.n_hc, axis=1)
        for il in range(self.n_layer):
            X = self.layer(il, X, tokens)
        return X

    def head(self, X, norm) -> np.ndarray:
        """The hc head (this file's output_hc_*), `norm` and the lm_head on streams X."""
        T = X.shape[0]
        m = self.rms(X.reshape(T, -1)) @ self.t["output_hc_fn.weight"].T
        pre = sigmoid(m * self.t["output_hc_scale.weight"][0] + self.t["output_hc_base.weight"]) + self.hc_eps
        h = self.rms((pre[:, :, None] * X).sum(axis=1), norm)
        head = self.t["output.weight"] if "output.weight" in self.t else self.t["token_embd.weight"]
        return h @ head.T

    def logits(self, tokens) -> np.ndarray:
        """[n_tokens, n_vocab] float64 logits of one pass from position 0."""
        return self.head(self.streams(tokens), self.t["output_norm.weight"])

    def mtp(self, streams, next_tokens) -> tuple:
        """The first MTP block (blk.<n_layer>) as llama.cpp's deepseek4 graph_mtp and DeepSeek's MTP
        module define it, on the pairs (streams[i] [n_hc, n_embd], next_tokens[i]), pair i at
        position i + 1, causal over the pairs: per stream z = eh_proj([enorm(embed(x)) | hnorm(h)]);
        the hyper-connected layer; the head with this file's output_hc_* and the block's
        shared_head_norm. Returns (logits [n, n_vocab], the block's streams [n, n_hc, n_embd])."""
        il = self.n_layer
        b = f"blk.{il}.nextn."
        tokens = np.asarray(next_tokens)
        embed = self.t.get(b + "embed_tokens.weight", self.t["token_embd.weight"])
        e = self.rms(embed[tokens], self.t[b + "enorm.weight"])
        h = self.rms(np.asarray(streams, dtype=np.float64), self.t[b + "hnorm.weight"])
        e = np.repeat(e[:, None, :], self.n_hc, axis=1)
        X = np.concatenate([e, h], axis=-1) @ self.t[b + "eh_proj.weight"].T
        X = self.layer(il, X, tokens, pos0=1)
        norm = self.t.get(b + "shared_head_norm.weight", self.t["output_norm.weight"])
        return self.head(X, norm), X
