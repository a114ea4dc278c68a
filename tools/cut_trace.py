"""Writes sequences [A, B) of a routing trace (.npz, the layout of shared/traces) to a new trace file,
so `sharpi predictor train/eval --trace`/`--heldout` can train and score on documented sequence
ranges (docs/predictors.md, "Held-out evaluation").

    python tools/cut_trace.py ../shared/traces/deepseek_v2_lite_train.npz 979 1399 ds_held979-1399.npz
"""

from __future__ import annotations

import sys

import numpy as np

KEEP = ("num_experts", "top_k", "moe_layer_ids")  # per-file scalars and layer ids, copied as they are


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        sys.stderr.write(__doc__)
        return 2
    src, first, end, out = argv[0], int(argv[1]), int(argv[2]), argv[3]
    z = np.load(src)
    starts, n_tokens = z["seq_start"], z["experts"].shape[0]
    if not 0 <= first < end <= len(starts):
        sys.stderr.write(f"{src}: sequences [{first}, {end}) outside [0, {len(starts)})\n")
        return 2
    ends = np.append(starts[1:], n_tokens)
    lo, hi = int(starts[first]), int(ends[end - 1])
    arrays = {"experts": z["experts"][lo:hi], "seq_start": starts[first:end] - lo}
    if "hidden" in z.files:
        arrays["hidden"] = z["hidden"][lo:hi]
    arrays.update({name: z[name] for name in KEEP if name in z.files})
    np.savez(out, **arrays)
    print(f"{out}: sequences [{first}, {end}) of {src}, {hi - lo} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
