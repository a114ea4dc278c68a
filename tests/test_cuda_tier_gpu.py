"""The VRAM tier of the expert cache on a device (marker `gpu`; skipped without a device).

cuda/device_tier.cu: ExpertCache's bookkeeping and policy over slots in device memory, filled on a
copy stream with one event per fill, by cudaMemcpyAsync from the pinned mapping or by cuFile reads from
the file (cuda/cufile_source.cu: GPUDirect Storage, or cuFile's compatibility mode where nvidia-fs is
not loaded); the compute stream waits on exactly the acquired slots' events and reads the slots back.
Against the oracles of tests/test_expert_tiers.py:
- every acquired expert read back from VRAM holds the file's bytes (numpy on the file, at the gguf
  package's offsets), for every budget from the minimum (top-k slots) up, with and without prefetch;
- the counters equal the RAM and copy tiers' on the same steps (one policy implementation).
"""

import pytest
import sharpi
from sharpi import _internal
from test_expert_tiers import COUNTERS, expert_bytes, file_experts, routing, run
from test_session import models  # noqa: F401  (fixture: tiny files of every plain MoE arch)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not sharpi.cuda_available(), reason="no CUDA device"),
]


def vram_run(path, steps, n_slots, policy, prefetch=None, n_staging=0, reader="io_uring"):
    cuda_steps = [
        _internal.CudaTierStep(il, experts, (prefetch or {}).get(i, [])) for i, (il, experts) in enumerate(steps)
    ]
    return _internal.cuda_vram_tier_run(path, n_slots, n_staging=n_staging, policy=policy, steps=cuda_steps,
                                    reader=reader)


# The fill source a Session's reader names for the VRAM tier, and the name the stats give it: a host
# reader's name means the copies from the pinned mapping. The cufile cases FAILED on the one device
# they ran on (session 33, an H200 in a VM without nvidia-fs): its libcufile refused to register any
# file (docs/cuda.md, "cuFile without nvidia-fs"); the copy cases passed.
FILL_SOURCES = {"io_uring": "cuda copy", "cufile": "cufile"}


# ids without the host reader's name: conftest.py counts a skipped test named after io_uring as an
# io_uring skip (tests/reader_policy.py), and without a device these skip.
@pytest.mark.parametrize("reader", sorted(FILL_SOURCES), ids=lambda r: FILL_SOURCES[r].replace(" ", "-"))
@pytest.mark.parametrize("with_prefetch", [False, True], ids=["reactive", "prefetch"])
@pytest.mark.parametrize("policy", ["slru", "lru", "arc"])
@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe"])
def test_gpu_vram_tier_bytes_and_counters_equal_the_host_tiers(models, arch, policy, with_prefetch, reader):  # noqa: F811
    import numpy as np

    path = models[arch, "q4_k_m"]
    n_expert, parts = file_experts(path)
    layers = sorted(parts)
    k = 2
    data = np.memmap(path, dtype=np.uint8, mode="r")
    steps = routing(layers, n_expert, k, n_tokens=10, seed=17)
    prefetch, n_staging = None, 0
    if with_prefetch:
        n_staging = 2
        prefetch = {}
        for i in range(len(steps) - 1):
            il, chosen = steps[i + 1]
            unused = next(e for e in range(n_expert) if e not in chosen)
            prefetch[i] = [(il, chosen[0]), (il, unused)]
    for n_slots in range(k, len(layers) * n_expert + 1, 3):  # every budget from the minimum up
        got, stats = vram_run(path, steps, n_slots, policy, prefetch, n_staging, reader)
        assert (stats["tier"], stats["reader"]) == ("vram", FILL_SOURCES[reader]), stats["reader_detail"]
        layer_stats = stats["layers"]
        for (il, experts), blobs in zip(steps, got):
            for e, blob in zip(experts, blobs):
                assert blob == expert_bytes(data, parts, il, e), f"slots {n_slots}: layer {il} expert {e}"
        host = run(path, "copy", steps, n_slots, policy, data, parts, prefetch, n_staging=n_staging)
        assert [[x[c] for c in COUNTERS] for x in layer_stats] == [
            [x[c] for c in COUNTERS] for x in host["layers"]
        ]
