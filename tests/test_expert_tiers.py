"""One expert cache, two tiers (moe/expert_tier.h): the RAM tier (the file reader into RAM slots) and the
copy tier (the VRAM tier's fill path -- queued copies from the mapped file, demand before prefetch --
with host memory standing in for device memory). The slot bookkeeping, replacement policy, staging and
counters are the same code in both, so on the same access sequence:
- every expert handed to compute holds the file's bytes (read here from the file with numpy, at the
  offsets the gguf package gives), in both tiers;
- the counters (docs/design.md §7 names) are equal between the tiers, and the misses equal the engine's
  offline policy replay (_internal.replay_policy, moe/policy_replay.h) of the same steps.
The CUDA tier's copies and events run only on a GPU: tests/test_cuda_gpu.py.
"""

import numpy as np
import pytest
from gguf import GGUFReader
from sharpi import InvalidArgument, _internal
from test_session import models  # noqa: F401  (fixture: tiny files of every plain MoE arch)

COUNTERS = (
    "accesses",
    "hits",
    "misses",
    "evictions",
    "bytes_read",
    "prefetch_issued",
    "prefetch_used",
    "prefetch_timely",
    "prefetch_late",
    "prefetch_wasted_bytes",
)


def file_experts(path):
    """{layer: (n_expert, [(offset, bytes_per_expert) for gate, up, down])} from the gguf package."""
    parts = {}
    n_expert = 0
    for t in GGUFReader(path).tensors:
        for i, name in enumerate(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")):
            if f".{name}." in t.name:
                il = int(t.name.split(".")[1])
                n_expert = int(t.shape[-1])
                parts.setdefault(il, [None] * 3)[i] = (int(t.data_offset), int(t.n_bytes) // n_expert)
    return n_expert, parts


def expert_bytes(data, parts, il, e):
    return b"".join(bytes(data[off + e * nb : off + (e + 1) * nb]) for off, nb in parts[il])


def routing(layers, n_expert, k, n_tokens, seed):
    """Skewed routing (a few hot experts per layer) so every policy sees hits and misses."""
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(n_expert, 0.3))
    steps = []
    for _ in range(n_tokens):
        for il in layers:
            steps.append((il, [int(e) for e in rng.choice(n_expert, size=k, replace=False, p=p)]))
    return steps


def run(path, tier, steps, n_slots, policy, data, parts, prefetch=None, n_staging=0):
    cache = _internal.TierCacheTest(path, tier, n_slots, n_staging=n_staging, policy=policy)
    for i, (il, experts) in enumerate(steps):
        got = cache.step(il, experts)
        for e, blob in zip(experts, got):
            assert blob == expert_bytes(data, parts, il, e), f"{tier}: layer {il} expert {e} bytes differ"
        for pl, pe in (prefetch or {}).get(i, []):
            cache.prefetch(pl, pe)
        cache.drain()  # settle the fills so both tiers see every prefetch ready at the gate
    return cache.stats()


def totals(stats):
    return {c: sum(layer[c] for layer in stats["layers"]) for c in COUNTERS}


@pytest.mark.parametrize("policy", ["slru", "lru", "lfu", "arc", "s3fifo"])
def test_ram_and_copy_tiers_share_policy_and_counters(models, policy):  # noqa: F811
    path = models["qwen3moe", "q4_k_m"]
    n_expert, parts = file_experts(path)
    layers = sorted(parts)
    k = 2 if n_expert > 2 else 1
    data = np.memmap(path, dtype=np.uint8, mode="r")
    steps = routing(layers, n_expert, k, n_tokens=12, seed=5)
    for n_slots in (k, k + 3, len(layers) * n_expert // 2):
        ram = run(path, "ram", steps, n_slots, policy, data, parts)
        copy = run(path, "copy", steps, n_slots, policy, data, parts)
        assert (ram["tier"], copy["tier"]) == ("ram", "copy")
        assert copy["reader"] == "host copy"
        assert [[layer[c] for c in COUNTERS] for layer in ram["layers"]] == [
            [layer[c] for c in COUNTERS] for layer in copy["layers"]
        ]
        # The engine's offline replay of the same steps through the same policy misses as often.
        layer_of = np.array([il for il, _ in steps], np.int32)
        offsets = np.cumsum([0] + [len(x) for _, x in steps]).astype(np.int64)
        flat = np.array([e for _, x in steps for e in x], np.int32)
        replay = _internal.replay_policy(
            _internal.ReplacementPolicy(policy, n_slots), n_slots, layer_of, offsets, flat
        )
        assert totals(copy)["misses"] == int(replay.sum())
        assert totals(copy)["accesses"] == len(flat)


def test_copy_tier_staging_adoption_and_waste_match_the_ram_tier(models):  # noqa: F811
    path = models["qwen2moe", "q4_k_m"]
    n_expert, parts = file_experts(path)
    layers = sorted(parts)
    k = 2
    data = np.memmap(path, dtype=np.uint8, mode="r")
    steps = routing(layers, n_expert, k, n_tokens=8, seed=11)
    # After each step, prefetch the next step's first expert (adopted when selected) and one it will
    # not select (dropped at its gate, its bytes wasted).
    prefetch = {}
    for i in range(len(steps) - 1):
        il, chosen = steps[i + 1]
        unused = next(e for e in range(n_expert) if e not in chosen)
        prefetch[i] = [(il, chosen[0]), (il, unused)]
    ram = run(path, "ram", steps, k + 2, "slru", data, parts, prefetch, n_staging=2)
    copy = run(path, "copy", steps, k + 2, "slru", data, parts, prefetch, n_staging=2)
    t = totals(copy)
    assert t["prefetch_issued"] > 0 and t["prefetch_used"] > 0 and t["prefetch_wasted_bytes"] > 0
    assert t["prefetch_used"] == t["prefetch_timely"]  # drained: every prefetch was ready at its gate
    assert totals(ram) == t


def test_unknown_tier_is_invalid_argument(models):  # noqa: F811
    with pytest.raises(InvalidArgument, match="tier must be 'ram' or 'copy'"):
        _internal.TierCacheTest(models["qwen3moe", "f32"], "vram-on-host", 4)
