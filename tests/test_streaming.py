"""Expert streaming under a RAM budget (issue 3): the streamed engine must produce exactly the
resident engine's logits (bit-identical on the CPU) for every budget from the minimum to "all
resident", with both readers; IO faults become typed errors; memory stays within the budget.

The oracle is the resident engine (every expert memory-mapped), which test_model_vs_reference.py
ties to a float64 numpy reference and to transformers.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import sharpi
from reader_policy import URING_REQUIRED, uring_unavailable
from reference.engine_checks import greedy_logits
from sharpi import _core, _internal
from sharpi.cache_eval import write_prior
from sharpi.make_model import write_model

ARCHS = ["llama", "qwen2moe", "qwen3moe", "olmoe", "deepseek2", "glm4moe", "llama4", "minimax-m2", "deepseek4",
         "deepseek32", "nemotron_h_moe"]
READERS = ["pread", "uring"]


def reader_available(kind: str, path: str) -> bool:
    """True when `kind` can stream `path`; an io_uring reader that cannot fails the test on Linux
    (reader_policy.py) rather than returning False."""
    if kind == "pread":
        return True
    try:
        sharpi.Session(path, threads=1, n_ctx=64, ram_budget="1GiB", reader=kind)
        return True
    except (sharpi.UnsupportedError, sharpi.IoError) as e:
        uring_unavailable(str(e))
        return False


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("stream_models")
    out = {}
    for arch in ARCHS:
        path = str(d / f"{arch}.gguf")
        # q4_k_m mixes types per layer (q6_K ffn_down in some layers): slots must fit the largest.
        write_model(path, arch=arch, preset="tiny", quant="q4_k_m", seed=11)
        out[arch] = path
    return out


def plan(path: str, n_ctx: int = 128):
    """(fixed bytes, slot bytes, total experts, top-k) of a streamed session on this file."""
    s = sharpi.Session(path, threads=1, n_ctx=n_ctx, ram_budget="4GiB", reader="pread")
    st = s.expert_stats()
    info = s.info
    # The layers with routed experts (deepseek2's leading layers and llama4's interleaved ones are dense).
    # The nextn (MTP) blocks after the trunk are never streamed: blocks >= n_layer do not count.
    n_moe_layer = len({t["name"].split(".")[1] for t in _core.GgufFile(path).tensors()
                       if t["name"].endswith(".ffn_down_exps.weight")  # every arch has it (nemotron: no gate)
                       and int(t["name"].split(".")[1]) < info["n_layer"]})  # fmt: skip
    return st["fixed_bytes"], st["slot_bytes"], n_moe_layer * info["n_expert"], info["n_expert_used"]


run_tokens = greedy_logits  # all-position prompt logits, then greedy token-by-token logits


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("reader", READERS)
def test_streamed_equals_resident_for_every_budget(models, arch, reader):
    path = models[arch]
    if not reader_available(reader, path):
        pytest.skip(f"{reader} reader unavailable here")
    fixed, slot, total, k = plan(path)
    prompt = list(range(5, 25))
    resident = run_tokens(sharpi.Session(path, threads=2, n_ctx=128), prompt, 24)
    for n_slots in sorted({k, k + 1, 2 * k, total // 2, total - 1, total, total + 3}):
        s = sharpi.Session(path, threads=2, n_ctx=128, ram_budget=fixed + n_slots * slot, reader=reader)
        st = s.expert_stats()
        assert st["n_slots"] == min(n_slots, total)
        assert st["reader"] == ("io_uring" if reader == "uring" else "pread")
        assert st["reader_detail"].startswith("io_uring: O_DIRECT, " if reader == "uring" else "pread: ")
        streamed = run_tokens(s, prompt, 24)
        np.testing.assert_array_equal(streamed, resident, err_msg=f"{arch} {reader} {n_slots} slots")
        st = s.expert_stats()
        layers = st["layers"]
        assert all(lay["accesses"] == lay["hits"] + lay["misses"] for lay in layers)
        misses = sum(lay["misses"] for lay in layers)
        if n_slots >= total:
            # Everything fits: each expert is read at most once, never evicted.
            assert misses <= total and sum(lay["evictions"] for lay in layers) == 0
        if n_slots == k:
            assert sum(lay["evictions"] for lay in layers) > 0


def test_budget_too_small_names_the_minimum(models):
    path = models["qwen3moe"]
    fixed, slot, _total, k = plan(path)
    with pytest.raises(sharpi.InvalidArgument, match=r"too small.*need at least"):
        sharpi.Session(path, n_ctx=128, ram_budget=fixed + (k - 1) * slot + slot // 2)
    with pytest.raises(sharpi.InvalidArgument, match="invalid byte size"):
        sharpi.Session(path, ram_budget="12 parsecs")
    assert _core.parse_byte_size("6GiB") == 6 * 2**30
    assert _core.parse_byte_size("1.5GB") == 1_500_000_000
    assert _core.parse_byte_size("512M") == 512 * 2**20


LONG_PROMPT = [(7 * i + 3) % 50 + 1 for i in range(300)]  # two chunks of the engine's 256-token batches


@pytest.mark.parametrize("reader", READERS)
def test_long_prompt_reads_each_expert_once_per_layer(models, reader, tmp_path):
    # A prompt longer than one 256-token chunk runs layer-major: every chunk computes layer il before
    # any computes layer il + 1, so with room for one layer's experts each expert a layer's tokens
    # select is read once for the whole prompt (chunk-major order read it once per chunk, since the
    # other layers evicted it in between). Output stays bit-identical to resident for every budget
    # from the minimum, every policy and with a predictor.
    path = models["qwen3moe"]
    if not reader_available(reader, path):
        pytest.skip(f"{reader} reader unavailable here")
    n_ctx = 320
    fixed, slot, total, k = plan(path, n_ctx=n_ctx)
    info = sharpi.Session(path, threads=1, n_ctx=n_ctx).info
    n_layer, n_expert = info["n_layer"], info["n_expert"]
    prior = str(tmp_path / "prior.gguf")
    write_prior(prior, np.random.default_rng(2).random((n_layer, n_expert)).astype(np.float32), source="test")
    resident = run_tokens(sharpi.Session(path, threads=2, n_ctx=n_ctx), LONG_PROMPT, 4)
    for policy in sharpi.cache_policies():
        for predictor in ("none", "prev_token"):
            staging = k if predictor != "none" else 0
            for n_slots in (k, n_expert, total):
                s = sharpi.Session(path, threads=2, n_ctx=n_ctx, reader=reader, predictor=predictor,
                                   ram_budget=fixed + (n_slots + staging) * slot,
                                   cache_policy=f"prior:{prior}" if policy == "prior" else policy)
                what = f"{policy} {predictor} {n_slots} slots"
                prefill = s.decode(LONG_PROMPT, all_logits=True)
                layers = s.expert_stats()["layers"]
                # Reads of experts the layer used: demand misses plus reads ahead it then used.
                reads = [lay["misses"] + lay["prefetch_used"] for lay in layers]
                selected = [len(np.unique(ids)) for ids in s.last_routing()]
                if n_slots >= n_expert:
                    assert reads == selected, what
                else:
                    assert all(r >= u for r, u in zip(reads, selected)), what
                if n_slots == total:  # room for every layer: the second layer's experts were read ahead
                    assert layers[0]["prefetch_issued"] == 0 and layers[1]["prefetch_used"] > 0, what
                np.testing.assert_array_equal(prefill, resident[: len(LONG_PROMPT)], err_msg=what)
                s.reset()
                np.testing.assert_array_equal(run_tokens(s, LONG_PROMPT, 4), resident, err_msg=what)


def test_stats_count_bytes_and_experts(models):
    path = models["olmoe"]
    fixed, slot, total, _k = plan(path)
    s = sharpi.Session(path, threads=2, n_ctx=128, ram_budget=fixed + total * slot, reader="pread")
    s.decode(list(range(3, 11)))
    st = s.expert_stats()
    f = _core.GgufFile(path)
    n_expert = s.info["n_expert"]
    for il, lay in enumerate(st["layers"]):
        per_expert = sum(f.tensor(f"blk.{il}.ffn_{p}_exps.weight")["nbytes"] // n_expert for p in ("gate", "up", "down"))
        # Demand misses and the prompt's reads ahead (the next layer's guessed experts).
        assert lay["bytes_read"] == (lay["misses"] + lay["prefetch_issued"]) * per_expert
        acc = st["expert_accesses"].reshape(s.info["n_layer"], n_expert)[il]
        assert acc.sum() == lay["accesses"]
    assert st["layers"][0]["prefetch_issued"] == 0  # nothing runs before layer 0 to read it ahead
    # The first prefill reads each distinct expert exactly once (on demand or ahead).
    reads = sum(lay["misses"] + lay["prefetch_used"] for lay in st["layers"])
    assert reads == int((st["expert_accesses"] > 0).sum())


def _expert_offset(path: str, il: int, e: int) -> int:
    off, _ = _core.GgufFile(path).expert_range(f"blk.{il}.ffn_up_exps.weight", e)
    return int(off) + 100


@pytest.mark.concurrency
@pytest.mark.parametrize("reader", READERS)
def test_injected_eio_is_a_clear_error_and_the_session_survives(models, tmp_path, reader, monkeypatch):
    path = models["qwen2moe"]
    if not reader_available(reader, path):
        pytest.skip(f"{reader} reader unavailable here")
    fixed, slot, total, _k = plan(path)
    bad_offset = _expert_offset(path, 1, 3)
    monkeypatch.setenv("SHARPI_FAULT_EIO_AT", str(bad_offset))
    s = sharpi.Session(path, threads=2, n_ctx=256, ram_budget=fixed + total * slot, reader=reader)
    monkeypatch.delenv("SHARPI_FAULT_EIO_AT")
    rng = np.random.default_rng(0)
    failed = False
    for _ in range(60):  # random tokens until expert 3 of layer 1 is selected
        before = s.n_past
        try:
            s.decode([int(rng.integers(0, s.info["n_vocab"]))])
        except sharpi.IoError as e:
            msg = str(e)
            assert path in msg and "blk.1.ffn_up_exps.weight" in msg and "expert 3" in msg, msg
            assert s.n_past == before  # nothing appended
            failed = True
            break
    assert failed, "expert 3 of layer 1 was never selected"
    # Still usable: after reset(), a token whose routing avoids the bad expert decodes to exactly the
    # resident engine's logits (the resident probe's dump says which experts layer 1 picks).
    probe = sharpi.Session(path, threads=2, n_ctx=8, dump_activations=True)
    s.reset()
    for t in range(s.info["n_vocab"]):
        probe.reset()
        expected = probe.decode([t])
        if 3 not in probe.dump()["ffn_moe_topk-1"].astype(int).ravel():
            np.testing.assert_array_equal(s.decode([t]), expected)
            break
    else:
        pytest.fail("no token avoids expert 3 of layer 1")


@pytest.mark.parametrize("reader", READERS)
def test_file_truncated_while_open(models, tmp_path, reader):
    src = models["llama"]
    path = str(tmp_path / "victim.gguf")
    shutil.copy(src, path)
    if not reader_available(reader, path):
        pytest.skip(f"{reader} reader unavailable here")
    fixed, slot, _total, k = plan(path)
    s = sharpi.Session(path, threads=2, n_ctx=128, ram_budget=fixed + k * slot, reader=reader)
    s.decode([1, 2, 3])
    f = _core.GgufFile(path)
    first_expert = min(t["file_offset"] for t in f.tensors() if "_exps." in t["name"])
    os.truncate(path, first_expert + 10)  # every expert range now ends past end of file
    with pytest.raises(sharpi.IoError, match=r"victim\.gguf.*(end of file|beyond)"):
        for t in range(4, 40):
            s.decode([t])
    # The session is still an object we can use and drop without crashing.
    s.reset()
    del s


RSS_SCRIPT = r"""
import json, sys, numpy as np, sharpi
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) * 1024
path, budget, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
base = rss()
s = sharpi.Session(path, threads=2, n_ctx=n + 16, ram_budget=budget, reader="auto")
peak = rss()
rng = np.random.default_rng(0)
token = 1
for i in range(n):
    logits = s.decode([token])
    token = int(rng.integers(0, len(logits)))  # random tokens: routing that keeps missing
    if i % 16 == 0:
        peak = max(peak, rss())
peak = max(peak, rss())
st = s.expert_stats()
print(json.dumps({"base": base, "peak": peak, "misses": sum(l["misses"] for l in st["layers"]),
                  "reader": st["reader"], "n_slots": st["n_slots"]}))
"""


@pytest.mark.slow
def test_rss_stays_within_budget(tmp_path):
    # Experts ~4x the budget: 4 layers x 32 experts of OLMoE-1B-7B shape at q4_k (~450 MiB of experts).
    path = str(tmp_path / "mid.gguf")
    write_model(path, preset="olmoe-1b-7b", quant="q4_k", seed=0, n_layer=4, n_expert=32, vocab_size=4096)
    info = sharpi.Session(path, threads=1, n_ctx=272, ram_budget="8GiB", reader="pread")
    st = info.expert_stats()
    total_experts = 4 * 32
    budget = st["fixed_bytes"] + total_experts * st["slot_bytes"] // 4
    del info
    out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, path, str(budget), "256"], check=True,
                         capture_output=True, text=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    overhead = 48 * 2**20  # thread stacks, allocator slack, the Python objects of the loop
    assert r["n_slots"] * 4 <= total_experts + 4
    assert r["misses"] > 256, "the budget should force reads"
    assert r["peak"] - r["base"] <= budget + overhead, r




def test_route_trace_replay_forces_the_recorded_experts(models, tmp_path):
    path = models["qwen3moe"]
    s = sharpi.Session(path, threads=2, n_ctx=128)
    info = s.info
    rng = np.random.default_rng(5)
    n_tok, n_layer, k, n_expert = 16, info["n_layer"], info["n_expert_used"], info["n_expert"]
    trace = np.stack([[rng.choice(n_expert, size=k, replace=False) for _ in range(n_layer)] for _ in range(n_tok)])
    trace[3, 1, 0] = -1  # a missing cell is filled by the router's own choice
    npz = str(tmp_path / "trace.npz")
    np.savez(npz, experts=trace.astype(np.int16), seq_start=np.array([0]), num_experts=n_expert, top_k=k)
    s.set_route_trace(npz)
    s.decode(list(range(20, 20 + n_tok)))
    routing = s.last_routing()
    for il in range(n_layer):
        for t in range(n_tok):
            got = set(routing[il][t].tolist())
            want = {int(e) for e in trace[t, il] if e >= 0}
            assert want <= got and len(got) == k, (il, t, got, want)
    # Streamed with the same trace: bit-identical to resident with the same trace.
    fixed, slot, _total, _ = plan(path)
    st = sharpi.Session(path, threads=2, n_ctx=128, ram_budget=fixed + k * slot, route_trace=npz)
    s.reset()
    np.testing.assert_array_equal(st.decode(list(range(20, 36)), all_logits=True),
                                  s.decode(list(range(20, 36)), all_logits=True))


def test_route_trace_shape_mismatch_is_clear(models, tmp_path):
    s = sharpi.Session(models["olmoe"], threads=1, n_ctx=64)
    with pytest.raises(sharpi.InvalidArgument, match=r"does not match the model: 2 MoE layers, top-2"):
        s.set_route_trace(np.zeros((4, 3, 2), dtype=np.int16))
    with pytest.raises(sharpi.InvalidArgument, match=r"expert id 8 .* outside \[0, 8\)"):
        s.set_route_trace(np.full((4, 2, 2), 8, dtype=np.int16))
    with pytest.raises(sharpi.InvalidArgument, match="3-D"):
        s.set_route_trace(np.zeros((4, 2), dtype=np.int16))


def test_real_mixtral_trace_drives_a_matching_model(tmp_path, shared_traces):
    trace_path = str(shared_traces / "mixtral_8x7b_small.npz")
    with np.load(trace_path) as z:
        experts = z["experts"]
    path = str(tmp_path / "mixtral-shape.gguf")
    write_model(path, arch="llama", preset="tiny", quant="q8_0", seed=2, n_layer=experts.shape[1],
                n_expert=8, n_expert_used=2)
    fixed, slot, _total, _k = plan(path)
    s = sharpi.Session(path, threads=2, n_ctx=64, ram_budget=fixed + 4 * slot, route_trace=trace_path)
    s.decode(list(range(1, 33)))
    routing = s.last_routing()
    for il in range(experts.shape[1]):
        for t in range(32):
            want = {int(e) for e in experts[t, il] if e >= 0}
            assert want <= set(routing[il][t].tolist())
    assert s.expert_stats()["layers"][0]["accesses"] > 0


def test_cli_streamed_run_writes_expert_stats(models, tmp_path):
    path = models["qwen2moe"]
    fixed, slot, _total, _k = plan(path, n_ctx=256)
    stats_file = str(tmp_path / "stats.json")
    budget = str(fixed + 3 * slot)
    cmd = [sys.executable, "-m", "sharpi.cli", "run", "-m", path, "-p", "def f(x):", "-n", "16", "--temp", "0",
           "-c", "256", "--ignore-eos", "--ram-budget", budget, "--expert-stats", stats_file]
    streamed = subprocess.run(cmd, check=True, capture_output=True, text=True)
    resident = subprocess.run(cmd[: cmd.index("--ram-budget")], check=True, capture_output=True, text=True)
    assert streamed.stdout == resident.stdout  # same greedy text
    assert "hit rate" in streamed.stderr and "slots" in streamed.stderr
    with open(stats_file) as f:
        doc = json.load(f)
    assert doc["n_slots"] == 3 and len(doc["layers"]) == 2
    for lay in doc["layers"]:
        assert lay["accesses"] == lay["hits"] + lay["misses"] == sum(lay["expert_accesses"])
        assert lay["misses"] == sum(lay["expert_misses"]) > 0


def test_cli_run_says_which_reader_runs_and_why(models, tmp_path):
    """A streamed `sharpi run` names its reader on stderr and in --expert-stats: io_uring on Linux
    (no liburing needed); when io_uring_setup is refused (SHARPI_FAULT_URING_SETUP, as a seccomp
    filter would) the same command streams with pread, says why and prints the same text."""
    path = models["qwen3moe"]
    fixed, slot, _total, k = plan(path, n_ctx=128)
    stats_file = str(tmp_path / "stats.json")
    cmd = [sys.executable, "-m", "sharpi.cli", "run", "-m", path, "-p", "hello", "-n", "6", "--temp", "0",
           "-c", "128", "--ignore-eos", "--ram-budget", str(fixed + k * slot), "--expert-stats", stats_file]
    env = {k: v for k, v in os.environ.items() if k != "SHARPI_FAULT_URING_SETUP"}
    auto = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    with open(stats_file) as f:
        doc = json.load(f)
    if URING_REQUIRED:
        assert doc["reader"] == "io_uring", doc
        assert "(io_uring: O_DIRECT, registered buffers" in auto.stderr, auto.stderr
    assert doc["reader_detail"] in auto.stderr
    if not _internal.uring_compiled():
        return  # nothing to refuse
    refused = subprocess.run(cmd, check=True, capture_output=True, text=True,
                             env=dict(env, SHARPI_FAULT_URING_SETUP="EPERM"))
    with open(stats_file) as f:
        doc = json.load(f)
    assert doc["reader"] == "pread"
    assert doc["reader_detail"].endswith(f"(io_uring unavailable: io_uring_setup: {os.strerror(1)})")
    assert doc["reader_detail"] in refused.stderr
    assert refused.stdout == auto.stdout


def test_timeline_records_compute_and_reads(models):
    path = models["olmoe"]
    fixed, slot, _total, k = plan(path)
    s = sharpi.Session(path, threads=2, n_ctx=128, ram_budget=fixed + k * slot, timeline=True)
    s.decode([1, 2, 3])
    for t in range(4, 12):
        s.decode([t])
    events = s.timeline_events()
    tracks = {e["track"] for e in events}
    assert {"compute", "reader"} <= tracks
    assert all(e["dur_us"] >= 0 for e in events)
    misses = sum(lay["misses"] for lay in s.expert_stats()["layers"])
    assert sum(e["track"] == "reader" for e in events) == misses  # one span per expert read
    n_layer_spans = sum(e["name"].startswith("layer ") for e in events)
    assert n_layer_spans == s.info["n_layer"] * 9  # one prefill + 8 decode steps
    stall_ms = sum(lay["stall_ms"] for lay in s.expert_stats()["layers"])
    stall_spans = sum(e["dur_us"] for e in events if e["track"] == "stall") / 1e3
    assert abs(stall_spans - stall_ms) < 1e-3 * max(1.0, stall_ms)
    s.clear_timeline()
    assert s.timeline_events() == []
    # Off by default.
    assert sharpi.Session(path, threads=1, n_ctx=16).timeline_events() == []


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe"])
@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("sizing", ["topk", "bytes"])
def test_prev_token_prefetch_is_lossless_and_counted(models, arch, reader, sizing):
    path = models[arch]
    if not reader_available(reader, path):
        pytest.skip(f"{reader} reader unavailable here")
    fixed, slot, total, k = plan(path)
    prompt = list(range(30, 40))
    resident = run_tokens(sharpi.Session(path, threads=2, n_ctx=128), prompt, 30)
    with pytest.raises(sharpi.InvalidArgument, match=r"\+2 staging"):
        sharpi.Session(path, n_ctx=128, ram_budget=fixed + (2 * k - 1) * slot, predictor="prev_token")
    for n_slots in (k, k + 2, total // 2):
        s = sharpi.Session(path, threads=2, n_ctx=128, ram_budget=fixed + (n_slots + k) * slot, reader=reader,
                           predictor="prev_token", prefetch_sizing=sizing)
        st = s.expert_stats()
        assert (st["n_slots"], st["n_staging"]) == (n_slots, k)
        np.testing.assert_array_equal(run_tokens(s, prompt, 30), resident, err_msg=f"{arch} {reader} {n_slots}")
        layers = s.expert_stats()["layers"]
        issued = sum(lay["prefetch_issued"] for lay in layers)
        used = sum(lay["prefetch_used"] for lay in layers)
        assert used <= issued
        assert used == sum(lay["prefetch_timely"] + lay["prefetch_late"] for lay in layers)
        if n_slots == k:
            # The cache cannot keep a token's experts for the next: the prefetcher must work.
            assert issued > 0 and used > 0
        per_expert_max = slot  # a slot holds any one expert
        assert sum(lay["prefetch_wasted_bytes"] for lay in layers) <= (issued - used) * per_expert_max
    with pytest.raises(sharpi.InvalidArgument, match="unknown predictor 'oracle'"):
        sharpi.Session(path, n_ctx=128, ram_budget="1GiB", predictor="oracle")


STRESS_SCRIPT = r"""
import sys, numpy as np, sharpi
path, budget, reader = sys.argv[1], int(sys.argv[2]), sys.argv[3]
# skip_late_prefetch=False: the delayed prefetch reads would otherwise make the scheduler stop issuing.
s = sharpi.Session(path, threads=2, n_ctx=512, ram_budget=budget, reader=reader, predictor="prev_token",
                   skip_late_prefetch=False)
ref = sharpi.Session(path, threads=2, n_ctx=512)
rng = np.random.default_rng(1)
for t in rng.integers(0, s.info["n_vocab"], size=150).tolist():  # random tokens: prefetches often wrong
    if not np.array_equal(s.decode([t]), ref.decode([t])):
        sys.exit("logits differ")
layers = s.expert_stats()["layers"]
print(sum(l["prefetch_issued"] for l in layers), sum(l["prefetch_used"] for l in layers))
"""


@pytest.mark.concurrency
@pytest.mark.parametrize("delay_us", [0, 30000])
def test_prefetch_drops_and_rerequests_under_stress(models, delay_us):
    # Regression: a prefetch dropped while its reads were in flight must never be adopted by a later
    # demand for the same expert (that slot would never become ready and decode would hang). Slowing
    # prefetch reads only (test hook of the pread reader) makes a dropped prefetch outlive the demand
    # reads after it, as io_uring may complete them out of order under load.
    path = models["olmoe"]
    fixed, slot, _total, k = plan(path, n_ctx=512)
    env = dict(os.environ, SHARPI_FAULT_PREFETCH_DELAY_US=str(delay_us))
    done = subprocess.run([sys.executable, "-c", STRESS_SCRIPT, path, str(fixed + 2 * k * slot), "pread"],
                          check=False, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    issued, used = map(int, done.stdout.split())
    assert issued > used > 0


# DeepSeek-V2-Lite's real architecture (deepseek2: MLA, 1 leading dense layer + 26 MoE layers of 64
# experts, top-6, 2 shared experts) at small widths, so the recorded DeepSeek-V2-Lite trace drives it.
DEEPSEEK_V2_LITE_SMALL = {"n_vocab": 512, "n_embd": 128, "n_head": 2, "head_dim": 64, "n_rot": 32,
                          "n_lora_kv": 64, "head_dim_v": 32, "n_ff": 128, "n_ff_exp": 32, "n_ff_shexp": 64}


@pytest.mark.parametrize("reader", READERS)
def test_deepseek_v2_lite_trace_streamed_equals_resident_at_quarter_budget(tmp_path, reader, shared_traces):
    trace_path = str(shared_traces / "deepseek_v2_lite_train.npz")
    path = str(tmp_path / "deepseek-v2-lite-small.gguf")
    write_model(path, preset="deepseek-v2-lite", quant="q8_0", seed=4, **DEEPSEEK_V2_LITE_SMALL)
    if not reader_available(reader, path):
        pytest.skip(f"{reader} reader unavailable here")
    with np.load(trace_path) as z:
        experts = z["experts"]
    fixed, slot, total, k = plan(path)
    assert (total, k) == (experts.shape[1] * 64, experts.shape[2]) == (26 * 64, 6)
    resident = sharpi.Session(path, threads=2, n_ctx=128, route_trace=trace_path)
    prompt = list(range(3, 35))
    want = run_tokens(resident, prompt, 32)
    routing = resident.last_routing()  # the last decoded token: position 63 follows trace row 63
    assert routing[0].size == 0  # the dense layer routes nothing
    for il in range(1, 27):
        assert {int(e) for e in experts[63, il - 1] if e >= 0} <= set(routing[il][0].tolist())
    s = sharpi.Session(path, threads=2, n_ctx=128, ram_budget=fixed + total // 4 * slot, reader=reader,
                       route_trace=trace_path)
    assert s.expert_stats()["n_slots"] == total // 4
    np.testing.assert_array_equal(run_tokens(s, prompt, 32), want)
    assert sum(lay["misses"] for lay in s.expert_stats()["layers"]) > total // 4  # it really streamed
