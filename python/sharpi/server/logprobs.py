"""Log-probabilities of generated tokens in OpenAI's shapes: the chat shape per token
(token_logprobs, computed on the worker thread from the token's logits) and the legacy
completions shape of a list of them (completion_logprobs)."""

from __future__ import annotations

import numpy as np


def token_logprobs(tok, token: int, logits, n_top: int) -> dict:
    """One generated token's entry in OpenAI's chat shape, {"token", "logprob", "bytes",
    "top_logprobs": [{"token", "logprob", "bytes"}]}: log-probabilities under the model's own
    distribution, the float64 log-softmax of the raw logits before temperature or any sampling
    filter (as OpenAI's API and llama.cpp's server report them), floored at -9999 as OpenAI does
    so JSON never sees -inf. The n_top most likely tokens come most likely first, ties by lower id.
    A token's text is its bytes as UTF-8 (U+FFFD for part of a character; `bytes` is exact)."""
    x = np.asarray(logits, dtype=np.float64)
    m = x.max()
    lp = x - (m + np.log(np.exp(x - m).sum()))

    def entry(i: int) -> dict:
        b = tok.token_to_bytes(i)
        return {"token": b.decode("utf-8", errors="replace"), "logprob": max(float(lp[i]), -9999.0),
                "bytes": list(b)}

    top: list = []
    if n_top:
        kth = np.partition(lp, len(lp) - n_top)[len(lp) - n_top]
        cand = np.flatnonzero(lp >= kth)
        top = [int(i) for i in cand[np.lexsort((cand, -lp[cand]))][:n_top]]
    return {**entry(int(token)), "top_logprobs": [entry(i) for i in top]}


def completion_logprobs(entries: list) -> dict:
    """The legacy completions shape of (text offset, chat-shaped entry) pairs. An echoed prompt's
    first token has logprob and top_logprobs None (nothing predicts it), as OpenAI writes it."""
    return {"tokens": [e["token"] for _, e in entries], "token_logprobs": [e["logprob"] for _, e in entries],
            "top_logprobs": [None if e["top_logprobs"] is None else {t["token"]: t["logprob"] for t in e["top_logprobs"]}
                             for _, e in entries],
            "text_offset": [off for off, _ in entries]}

