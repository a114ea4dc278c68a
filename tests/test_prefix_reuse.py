"""Prompt-prefix reuse (issue 20): Session.truncate() cuts the KV cache back to a prefix, and
sharpi.server.prompt.reuse_prefix() keeps the longest prefix a new prompt shares with what the cache holds.

Oracle: a fresh session decoding the whole new prompt. Decoding only the rest after a reused prefix
must give the same logits bit for bit, for plain attention (qwen3moe, llama, the shipped model),
MLA (deepseek2, whose cache holds the latent) and streamed experts under a small RAM budget. The
hybrid archs (qwen3next, qwen35moe) cannot rewind their recurrent state: truncate() refuses, and
reuse_prefix() falls back to a full re-prefill, with the same logits.
"""

from __future__ import annotations

import numpy as np
import pytest
import sharpi
from sharpi.make_model import write_model
from sharpi.models import default_model_path
from sharpi.server.prompt import reuse_prefix

N_CTX = 256
PLAIN = ("qwen3moe", "llama", "deepseek2")
HYBRID = ("qwen3next", "qwen35moe")


@pytest.fixture(scope="module")
def files(model_dir):
    out = {}
    for arch in PLAIN + HYBRID:
        path = model_dir / f"prefix-{arch}.gguf"
        if not path.exists():
            write_model(path, arch=arch, preset="tiny", quant="q8_0", seed=3)
        out[arch] = str(path)
    out["shipped"] = default_model_path()
    return out


def prompts(n_vocab: int, n_shared: int, seed: int = 0) -> tuple[list, list]:
    """Two prompts sharing exactly their first n_shared ids (40 and 30 ids long)."""
    rng = np.random.default_rng(seed)
    a = [int(t) for t in rng.integers(3, n_vocab, 40)]
    b = a[:n_shared] + [int(t) for t in rng.integers(3, n_vocab, 30 - n_shared)]
    if n_shared < 30 and b[n_shared] == a[n_shared]:
        b[n_shared] = 3 + (a[n_shared] - 2) % (n_vocab - 3)
    return a, b


def fresh_logits(path: str, ids: list, **options) -> np.ndarray:
    s = sharpi.Session(path, threads=1, n_ctx=N_CTX, **options)
    return np.asarray(s.decode(ids, all_logits=True))


@pytest.mark.parametrize("arch", [*PLAIN, "shipped"])
def test_divergent_prompt_decodes_only_the_rest(files, arch):
    s = sharpi.Session(files[arch], threads=1, n_ctx=N_CTX)
    a, b = prompts(s.info["n_vocab"], 17)
    s.decode(a)
    assert reuse_prefix(s, a, b) == 17
    assert s.n_past == 17
    got = np.asarray(s.decode(b[17:], all_logits=True))
    np.testing.assert_array_equal(got, fresh_logits(files[arch], b)[17:])


@pytest.mark.parametrize("arch", PLAIN)
def test_reuse_prefix_edge_cases(files, arch):
    s = sharpi.Session(files[arch], threads=1, n_ctx=N_CTX)
    a, _ = prompts(s.info["n_vocab"], 0)
    want = fresh_logits(files[arch], a)
    # The same prompt again: everything but its last id, decoded again for its logits.
    s.decode(a)
    assert reuse_prefix(s, a, a) == len(a) - 1
    np.testing.assert_array_equal(np.asarray(s.decode(a[-1:])), want[-1])
    # A prompt that is a prefix of what is held: cut back to all but its last id.
    assert reuse_prefix(s, a, a[:10]) == 9 and s.n_past == 9
    np.testing.assert_array_equal(np.asarray(s.decode(a[9:10])), want[9])
    # Nothing shared: the cache starts over.
    other = [(t + 1) % s.info["n_vocab"] for t in a]
    assert reuse_prefix(s, a[:10], other) == 0 and s.n_past == 0


def test_streamed_experts_reuse_bit_identical(files):
    """Under a RAM budget of a few expert slots the reused decode is the resident fresh one."""
    path = files["qwen3moe"]
    probe = sharpi.Session(path, threads=1, n_ctx=N_CTX, ram_budget="8GiB", reader="pread")
    st, k = probe.expert_stats(), probe.info["n_expert_used"]
    budget = st["fixed_bytes"] + 2 * k * st["slot_bytes"]
    s = sharpi.Session(path, threads=1, n_ctx=N_CTX, ram_budget=budget, reader="pread", predictor="prev_token")
    a, b = prompts(s.info["n_vocab"], 23, seed=1)
    s.decode(a)
    assert reuse_prefix(s, a, b) == 23
    got = np.asarray(s.decode(b[23:], all_logits=True))
    assert sum(layer["misses"] for layer in s.expert_stats()["layers"]) > 0, "nothing was streamed"
    np.testing.assert_array_equal(got, fresh_logits(path, b)[23:])


@pytest.mark.parametrize("arch", HYBRID)
def test_hybrid_archs_reprefill_instead_of_rewinding(files, arch):
    s = sharpi.Session(files[arch], threads=1, n_ctx=N_CTX)
    a, b = prompts(s.info["n_vocab"], 17)
    s.decode(a)
    with pytest.raises(sharpi.UnsupportedError, match="recurrent"):
        s.truncate(17)
    assert s.n_past == len(a)  # the refusal changed nothing
    s.truncate(len(a))  # keeping everything is fine
    assert reuse_prefix(s, a, b) == 0 and s.n_past == 0
    np.testing.assert_array_equal(np.asarray(s.decode(b, all_logits=True)), fresh_logits(files[arch], b))
    # A prompt that extends what is held still decodes only its new ids.
    longer = b + a[:5]
    assert reuse_prefix(s, b, longer) == len(b)
    np.testing.assert_array_equal(np.asarray(s.decode(longer[len(b) :], all_logits=True)),
                                  fresh_logits(files[arch], longer)[len(b) :])


def test_truncate_refuses_bad_lengths(files):
    s = sharpi.Session(files["qwen3moe"], threads=1, n_ctx=N_CTX)
    s.decode([5, 6, 7])
    for bad in (-1, 4):
        with pytest.raises(sharpi.InvalidArgument, match="truncate"):
            s.truncate(bad)
    assert s.n_past == 3
    s.truncate(0)
    assert s.n_past == 0
