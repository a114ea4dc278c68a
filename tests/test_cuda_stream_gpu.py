"""Experts streamed through VRAM slots on a device (marker `gpu`; skipped without a device).

Session(device="cuda", vram_budget=B): the tier planner keeps dense weights, KV cache and buffers in VRAM
and, when B does not hold every expert, a pool of VRAM expert slots filled from the pinned mapping on a
copy stream (cuda/device_forward.cu's streamed path, cuda/device_tier.cu). The kernels are the resident
ones reading each expert through a slot table, so the oracle is the resident device session itself:
- logits equal the resident session's bit for bit, prompt (every row) and every greedy step, for every
  budget from the planner's minimum (top-k slots) to one that holds every expert, with and without a
  predictor (staging slots, prefetches on the copy stream), in exact and fast mode;
- the counters say the experts streamed (tier "vram", misses at the minimum, hits once they fit);
- `vram_budget="auto"` runs and equals the resident output.

NOT YET RUN ON A DEVICE: no session that wrote these tests was lent a GPU.
"""

import numpy as np
import pytest
import sharpi
from sharpi import _core
from test_cuda_gpu import e2e_files, prompt_tokens  # noqa: F401  (fixture: tiny files per arch and quant)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not sharpi.cuda_available(), reason="no CUDA device"),
]

N_CTX = 256
N_GREEDY = 8
ARCHES = ("qwen3moe", "qwen2moe", "olmoe", "llama")  # llama with experts: Mixtral's layout


def streamed_budgets(path, lookahead):
    """(n_slots, budget) for every slot count from the minimum (top-k) up to every expert in a slot."""
    plan = _core.tier_plan_file(path, 1 << 40, 0, n_ctx=N_CTX, lookahead=lookahead)
    low, slot, total = plan["vram_minimum_bytes"], plan["vram_slot_bytes"], plan["n_experts_total"]
    k = sharpi.Session(path, n_ctx=N_CTX).info["n_expert_used"]
    return [(n, low + (n - k) * slot) for n in range(k, total + 1)]


def bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


def run(session, prompt):
    """Every prompt row's logits, then N_GREEDY greedy steps' logits (one array of float32 bits)."""
    session.reset()
    rows = [np.asarray(session.decode(prompt, all_logits=True))]
    token = int(np.argmax(rows[0].reshape(len(prompt), -1)[-1]))
    for _ in range(N_GREEDY):
        logits = np.asarray(session.decode([token]))
        rows.append(logits)
        token = int(np.argmax(logits))
    return np.concatenate([bits(r).ravel() for r in rows])


@pytest.mark.parametrize("predictor,lookahead", [("none", 0), ("prev_token", 1), ("next_gate", 2)])
@pytest.mark.parametrize("exact", [True, False], ids=["exact", "fast"])
@pytest.mark.parametrize("arch", ARCHES)
def test_gpu_streamed_logits_equal_resident_for_every_budget(e2e_files, arch, exact, predictor, lookahead):  # noqa: F811
    path = e2e_files(arch, "q4_k_m")
    prompt = prompt_tokens(20, seed=21)
    want = run(sharpi.Session(path, device="cuda", n_ctx=N_CTX, exact=exact), prompt)
    options = {} if predictor == "none" else {"predictor": predictor, "lookahead": lookahead}
    budgets = streamed_budgets(path, lookahead)
    for n_slots, budget in budgets:
        s = sharpi.Session(path, device="cuda", n_ctx=N_CTX, exact=exact, vram_budget=budget, **options)
        got = run(s, prompt)
        assert np.array_equal(got, want), f"{arch} {predictor}: {n_slots} slots ({budget} B) differ from resident"
        stats = s.expert_stats()
        assert stats["tier"] == "vram" and stats["n_slots"] == n_slots, stats
        misses = sum(layer["misses"] for layer in stats["layers"])
        if n_slots == budgets[0][0]:
            assert misses > 0, "the minimum budget must stream"
        if predictor != "none":
            assert sum(layer["prefetch_issued"] for layer in stats["layers"]) > 0, stats


@pytest.mark.parametrize("quant", ["f32", "q8_0", "q6_k"])
def test_gpu_streamed_logits_equal_resident_in_other_types(e2e_files, quant):  # noqa: F811
    # The slot table addresses whole rows of any block type: each type's smallest and a middle budget.
    path = e2e_files("qwen3moe", quant)
    prompt = prompt_tokens(12, seed=4)
    want = run(sharpi.Session(path, device="cuda", n_ctx=N_CTX), prompt)
    budgets = streamed_budgets(path, 0)
    for n_slots, budget in (budgets[0], budgets[len(budgets) // 2]):
        got = run(sharpi.Session(path, device="cuda", n_ctx=N_CTX, vram_budget=budget), prompt)
        assert np.array_equal(got, want), f"{quant}: {n_slots} slots"


def test_gpu_vram_budget_auto_and_a_budget_that_holds_everything_are_the_resident_path(e2e_files):  # noqa: F811
    path = e2e_files("olmoe", "q4_k_m")
    prompt = prompt_tokens(10, seed=9)
    want = run(sharpi.Session(path, device="cuda", n_ctx=N_CTX), prompt)
    for budget in ("auto", "64GiB"):
        s = sharpi.Session(path, device="cuda", n_ctx=N_CTX, vram_budget=budget)
        assert np.array_equal(run(s, prompt), want), budget
        # A tiny model fits: every expert resident, no VRAM tier.
        assert s.expert_stats()["tier"] != "vram"
