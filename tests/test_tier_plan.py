"""The tier planner (cpp/src/tier_plan.h) and the miss cost model (cpp/src/moe/miss_cost.h), on the host.

Every expectation is computed here from the stated rules, not read back from the planner: VRAM holds
dense + KV + buffers, then every expert if they fit, else (budget - fixed) // largest-expert slots less
the staging slots, of which a pin share (of those beyond top-k) goes to the prior's hottest experts;
RAM holds its buffers plus slots for the rest; an impossible budget is sharpi.InvalidArgument naming
the minimum. The file-level plan is checked against the device and RAM planners' own charges and the
expert bytes the gguf package reads from the file.
"""

import numpy as np
import pytest
import sharpi
from sharpi import DeviceError, InvalidArgument, _internal
from test_session import models  # noqa: F401  (fixture: tiny files of every plain MoE arch)

MIB = 1 << 20


def synthetic(n_layer=4, n_expert=8, k=2, expert_mib=(1, 1, 1, 1), dense=100, kv=10, buf=5, host=20):
    expert_bytes = [int(m * MIB) for m in expert_mib]
    return {
        "n_layer": n_layer,
        "n_moe_layer": sum(1 for b in expert_bytes if b > 0),
        "n_expert": n_expert,
        "n_expert_used": k,
        "expert_bytes": expert_bytes,
        "host_slot_bytes": max(expert_bytes) + 3 * 8192,
        "vram_slot_bytes": max(expert_bytes),  # the arithmetic below in whole MiB
        "device_dense_bytes": dense * MIB,
        "device_kv_bytes": kv * MIB,
        "device_buffer_bytes": buf * MIB,
        "host_fixed_bytes": host * MIB,
    }


def fixed(s):
    return s["device_dense_bytes"] + s["device_kv_bytes"] + s["device_buffer_bytes"]


def test_everything_fits_is_resident():
    s = synthetic()
    all_experts = 4 * 8 * MIB
    p = _internal.tier_plan(s, fixed(s) + all_experts)
    assert p["experts_resident"] and p["n_vram_slots"] == 0 and p["vram_pinned"] == []
    assert p["vram_bytes"] == fixed(s) + all_experts
    assert p["n_experts_on_disk_only"] == 0
    assert "every expert (32," in p["summary"]


@pytest.mark.parametrize("n_staging", [0, 2, 4])
def test_slots_for_every_budget_from_the_minimum_up(n_staging):
    s = synthetic()
    slot = MIB
    minimum = fixed(s) + (2 + n_staging) * slot
    previous = 0
    for budget in range(minimum, fixed(s) + 32 * slot, MIB // 3):
        p = _internal.tier_plan(s, budget, n_staging=n_staging)
        assert not p["experts_resident"]
        assert p["vram_minimum_bytes"] == minimum
        assert p["n_vram_slots"] == (budget - fixed(s)) // slot - n_staging
        assert p["n_vram_slots"] >= 2 and p["n_vram_slots"] >= previous
        assert p["n_vram_staging"] == n_staging
        assert p["vram_bytes"] <= budget
        assert p["ram_holds_all"] and p["ram_expert_bytes"] == 32 * MIB  # no RAM budget: the mapped file
        previous = p["n_vram_slots"]


@pytest.mark.parametrize("n_staging", [0, 3])
def test_vram_budget_below_the_minimum_is_invalid_argument(n_staging):
    s = synthetic()
    minimum = fixed(s) + (2 + n_staging) * MIB
    with pytest.raises(
        InvalidArgument, match=r"--vram-budget .* is below the minimum %.1f MiB" % (minimum / MIB)
    ):
        _internal.tier_plan(s, minimum - 1, n_staging=n_staging)
    with pytest.raises(sharpi.InvalidArgument, match=r"dense weights 100.0 MiB \+ KV cache 10.0 MiB"):
        _internal.tier_plan(s, 50 * MIB)  # not even the dense weights
    _internal.tier_plan(s, minimum, n_staging=n_staging)  # the minimum itself runs


def test_slot_is_the_largest_expert_and_dense_layers_hold_none():
    # Layer 1 is dense (no experts); layer 3's down projection is a wider type (Q6_K beside Q4_K).
    s = synthetic(expert_mib=(1, 0, 1, 1.5))
    assert s["n_moe_layer"] == 3
    p = _internal.tier_plan(s, fixed(s) + 10 * MIB)
    assert p["vram_slot_bytes"] == int(1.5 * MIB)
    assert p["n_experts_total"] == 3 * 8
    assert p["n_vram_slots"] == (10 * MIB) // int(1.5 * MIB)
    resident = fixed(s) + 8 * int(3.5 * MIB)
    assert _internal.tier_plan(s, resident)["experts_resident"]
    assert not _internal.tier_plan(s, resident - 1)["experts_resident"]


@pytest.mark.parametrize("pin_share", [0.0, 0.25, 0.5, 1.0])
def test_prior_pins_the_hottest_experts(pin_share):
    rng = np.random.default_rng(3)
    s = synthetic(expert_mib=(1, 0, 1, 1))
    prior = rng.random((4, 8)).astype(np.float32)
    prior[1] = 5.0  # a dense layer's row is never pinned, however hot
    prior[2, :3] = 0.0  # never used: never pinned
    budget = fixed(s) + 14 * MIB
    p = _internal.tier_plan(s, budget, prior=prior.ravel(), pin_share=pin_share)
    capacity = 14
    n_pinned = int(pin_share * (capacity - 2))
    candidates = [(il, e) for il in (0, 2, 3) for e in range(8) if prior[il, e] > 0]
    expected = sorted(candidates, key=lambda k: (-prior[k], k))[:n_pinned]
    assert [tuple(k) for k in p["vram_pinned"]] == expected
    assert p["n_vram_slots"] == capacity - n_pinned >= 2
    assert p["vram_bytes"] <= budget
    # The experts RAM holds are those VRAM does not pin.
    assert p["ram_expert_bytes"] == (24 - n_pinned) * MIB


def test_prior_of_the_wrong_shape_and_bad_pin_share_are_invalid():
    s = synthetic()
    with pytest.raises(InvalidArgument, match=r"prior has 5 entries, the model 4 layers x 8 experts"):
        _internal.tier_plan(s, fixed(s) + 8 * MIB, prior=np.ones(5, np.float32))
    with pytest.raises(InvalidArgument, match=r"pin share must be in \[0, 1\]"):
        _internal.tier_plan(s, fixed(s) + 8 * MIB, prior=np.ones(32, np.float32), pin_share=1.5)


def test_ram_budget_slots_disk_and_minimum():
    s = synthetic()
    slot = s["host_slot_bytes"]
    vram = fixed(s) + 10 * MIB
    ram_min = s["host_fixed_bytes"] + 2 * slot
    with pytest.raises(
        InvalidArgument,
        match=r"--ram-budget .* is below the minimum %.1f MiB: host buffers 20.0 MiB" % (ram_min / MIB),
    ):
        _internal.tier_plan(s, vram, ram_budget=ram_min - 1)
    for n in (2, 5, 31):
        p = _internal.tier_plan(s, vram, ram_budget=s["host_fixed_bytes"] + n * slot + slot // 2)
        assert p["n_ram_slots"] == n and not p["ram_holds_all"]
        assert p["n_experts_on_disk_only"] == 32 - n
        assert p["ram_expert_bytes"] == n * slot
    p = _internal.tier_plan(s, vram, ram_budget=s["host_fixed_bytes"] + 100 * slot)
    assert p["ram_holds_all"] and p["n_ram_slots"] == 32 and p["n_experts_on_disk_only"] == 0


def test_auto_vram_budget_margin_and_no_device():
    gib = 1 << 30
    a = _internal.vram_budget_auto(vram_free=12 * gib)
    assert a["margin"] == max(512 * MIB, 12 * gib // 20) and a["budget"] == 12 * gib - a["margin"]
    a = _internal.vram_budget_auto(vram_free=4 * gib)
    assert a["margin"] == 512 * MIB
    with pytest.raises(InvalidArgument, match=r"leaves nothing above the 512.0 MiB margin"):
        _internal.vram_budget_auto(vram_free=100 * MIB)
    if not sharpi.cuda_available():
        with pytest.raises(DeviceError, match=r"--vram-budget auto needs a CUDA device"):
            _internal.vram_budget_auto()


def gguf_expert_bytes(path):
    """Per layer, bytes of one expert (gate + up + down) by the gguf package."""
    from gguf import GGUFReader

    per_layer = {}
    for t in GGUFReader(path).tensors:
        if "_exps." in t.name:
            il = int(t.name.split(".")[1])
            per_layer[il] = per_layer.get(il, 0) + int(t.n_bytes) // int(t.shape[-1])
    return per_layer


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe"])
def test_file_plan_uses_the_device_and_ram_planners_sizes(models, arch):  # noqa: F811
    path = models[arch, "q4_k_m"]
    device = _internal.cuda_device_plan(path, n_ctx=512)
    host = _internal.memory_plan(path, n_ctx=512, cache_type_k="f32", cache_type_v="f32")
    per_layer = gguf_expert_bytes(path)
    slot = host["slot_bytes"]  # the VRAM tier is the same cache: the same slot layout
    assert slot >= max(per_layer.values())
    fixed_vram = device["dense_bytes"] + device["kv_bytes"] + device["buffer_bytes"]
    budget = fixed_vram + 5 * slot
    p = _internal.tier_plan_file(path, budget, n_ctx=512, lookahead=1)
    sz = p["sizes"]
    assert sz["expert_bytes"] == [per_layer.get(il, 0) for il in range(sz["n_layer"])]
    assert (sz["device_dense_bytes"], sz["device_kv_bytes"]) == (device["dense_bytes"], device["kv_bytes"])
    assert sz["device_buffer_bytes"] == device["buffer_bytes"]
    assert sz["host_slot_bytes"] == sz["vram_slot_bytes"] == host["slot_bytes"] and sz["host_fixed_bytes"] == host["buffer_bytes"]
    k = sz["n_expert_used"]
    assert p["n_vram_staging"] == k and p["n_vram_slots"] == 5 - k
    everything = fixed_vram + sum(per_layer.values()) * sz["n_expert"]
    assert _internal.tier_plan_file(path, everything, n_ctx=512)["experts_resident"]
    assert device["expert_bytes"] == sum(per_layer.values()) * sz["n_expert"]


def test_inspect_plan_prints_the_tiers_and_refuses_impossible_budgets(models, tmp_path, capsys):  # noqa: F811
    from sharpi import cli

    path = models["qwen3moe", "q4_k_m"]
    p = _internal.tier_plan_file(path, 1 << 40, n_ctx=256)
    tight = p["vram_minimum_bytes"] + 3 * p["vram_slot_bytes"]
    assert (
        cli.main(
            ["inspect", path, "--plan", "--vram-budget", str(tight), "-c", "256", "--ram-budget", "64MiB"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "tier plan (n_ctx 256" in out
    assert f"+ 0 pinned hottest experts + {2 + 3} expert slots + 0 staging slots" in out
    assert "\n  RAM: " in out and "\n  disk: " in out
    assert cli.main(["inspect", path, "--plan", "--vram-budget", "1MiB"]) == 1
    assert "sharpi: error: [plan] --vram-budget 1.0 MiB is below the minimum" in capsys.readouterr().err
    if not sharpi.cuda_available():
        assert cli.main(["inspect", path, "--plan"]) == 1  # default auto: needs a device
        assert "--vram-budget auto needs a CUDA device" in capsys.readouterr().err


# ---- the miss cost model ------------------------------------------------------------------------

EXPERT = 2_654_208  # a Qwen3-30B-A3B Q4_K_M expert: 3 x 768 x 2048 at 4.5 bits/weight
N_EMBD = 2048


def break_even_rows(bytes_, n_embd, copy_bw, lat, cpu_bw):
    """Rows below which the CPU path is faster, solving the model's equality for n (float)."""
    return (bytes_ / copy_bw - lat) / (bytes_ / cpu_bw + 2 * n_embd * 4 / copy_bw)


@pytest.mark.parametrize(
    "copy_bw, cpu_bw, expect_one_row",
    [
        (25e9, 20e9, "copy"),  # PCIe 4 x16 beside a desktop's DRAM: copying is cheaper
        (6e9, 20e9, "cpu"),  # a laptop's PCIe 3 x4: computing where the bytes are wins
        (12e9, 12e9, "copy"),  # equal speeds: the CPU also pays both activation transfers
    ],
)
def test_miss_route_single_row(copy_bw, cpu_bw, expect_one_row):
    c = _internal.miss_route(EXPERT, N_EMBD, 1, copy_bw, 10e-6, cpu_bw)
    assert c["route"] == expect_one_row
    assert c["copy_s"] == pytest.approx(10e-6 + EXPERT / copy_bw, rel=1e-12)
    assert c["cpu_s"] == pytest.approx(2 * 10e-6 + 2 * N_EMBD * 4 / copy_bw + EXPERT / cpu_bw, rel=1e-12)


@pytest.mark.parametrize("copy_bw, cpu_bw", [(6e9, 20e9), (3e9, 40e9), (8e9, 60e9)])
def test_miss_route_flips_to_copy_at_the_break_even_batch(copy_bw, cpu_bw):
    n_star = break_even_rows(EXPERT, N_EMBD, copy_bw, 10e-6, cpu_bw)
    assert n_star > 1
    below, above = int(np.ceil(n_star)) - 1, int(np.floor(n_star)) + 1
    assert _internal.miss_route(EXPERT, N_EMBD, below, copy_bw, 10e-6, cpu_bw)["route"] == "cpu"
    assert _internal.miss_route(EXPERT, N_EMBD, above, copy_bw, 10e-6, cpu_bw)["route"] == "copy"
    # A prefill batch of 256 rows always copies: the GPU then computes every row at once.
    assert _internal.miss_route(EXPERT, N_EMBD, 256, copy_bw, 10e-6, cpu_bw)["route"] == "copy"


def test_miss_route_bad_inputs_are_invalid_argument():
    for args in [
        (EXPERT, N_EMBD, 1, 0.0, 0.0, 1e9),
        (EXPERT, N_EMBD, 1, 1e9, 0.0, -1.0),
        (EXPERT, N_EMBD, 0, 1e9, 0.0, 1e9),
        (EXPERT, N_EMBD, 1, 1e9, -1e-6, 1e9),
    ]:
        with pytest.raises(InvalidArgument, match=r"\[miss cost\]"):
            _internal.miss_route(*args)
