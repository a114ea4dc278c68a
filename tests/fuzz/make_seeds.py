"""Writes the fuzzer's seed corpus (tests/fuzz/corpus/): small valid files of every architecture and
a few malformed headers, so mutations start from what real files look like. Checked in; rerun after
a change to the GGUF writer:  PYTHONPATH=python:tests python tests/fuzz/make_seeds.py
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from gguf_helpers import ARRAY, STRING, UINT32, build_gguf, pack_kv
from sharpi.make_model import write_model

# The smallest shapes the writer accepts: rows of 32 (one q8_0 block), one layer, four experts, the
# smallest byte-level BPE vocabulary (~50 KiB a file, mostly tokenizer).
MICRO = {
    "n_embd": 32,
    "n_layer": 1,
    "n_head": 1,
    "n_head_kv": 1,
    "n_ff": 32,
    "n_expert": 4,
    "n_expert_used": 2,
    "n_ff_exp": 32,
    "n_ctx_train": 64,
}


def main(out: str = os.path.join(HERE, "corpus")) -> None:
    os.makedirs(out, exist_ok=True)
    for arch in ("qwen3moe", "qwen2moe", "llama", "olmoe"):
        for quant in ("q8_0",):
            write_model(os.path.join(out, f"{arch}-{quant}.gguf"), arch=arch, preset="tiny", quant=quant, seed=1,
                        vocab_size=300, n_ff_shexp=32 if arch == "qwen2moe" else 0, **MICRO)  # fmt: skip
    header_only = build_gguf(
        [
            pack_kv("general.architecture", STRING, "qwen3moe"),
            pack_kv("qwen3moe.block_count", UINT32, 1),
            pack_kv("tokenizer.ggml.tokens", ARRAY, ["a", "b"], STRING),
            pack_kv("nested", ARRAY, [(UINT32, [1, 2]), (STRING, ["x"])], ARRAY),
        ],
        [],
    )
    with open(os.path.join(out, "header-only.gguf"), "wb") as f:
        f.write(header_only.data)


if __name__ == "__main__":
    main(*sys.argv[1:])
