"""`sharpi bench`: decode speed of expert streaming under RAM budgets, against the IO lower bound.

What it measures (docs/design.md §7, §9). For a synthetic model (default: Qwen3-30B-A3B's shapes at q4_k_m,
built once and reused from --model-dir) and, when the recorded trace is at hand, for DeepSeek-V2-Lite's
real architecture (the deepseek-v2-lite preset: deepseek2, MLA, a dense first layer and 26 MoE layers)
replaying its real routing (shared/traces/deepseek_v2_lite_train.npz), it runs:
  - a probe, which reads the engine's own plan: fixed bytes (dense weights, KV cache, buffers) and
    the size of one expert slot;
  - the reader's sequential bandwidth on this file (O_DIRECT, page cache dropped), expert-sized
    reads back to back through the expert tensors;
  - the resident engine (every expert memory-mapped) decoding the same tokens twice: the second pass
    is the all-in-RAM TPOT;
  - one streamed run per budget share s: n_slots = s x n_layer x n_expert (n_layer counts the MoE
    layers, as the traces do), ram_budget = fixed +
    n_slots x slot, each in a fresh subprocess under a cgroup-v1 memory cap of budget + a stated
    overhead (when running as root with the memory controller mounted), page cache dropped first.
Every run decodes the same tokens one at a time: a warm-up of --warmup tokens, then --tokens measured
tokens. From the measured part: TPOT, tok/s, hit rate, stall fraction (stall / decode wall time), IO
GB/s (bytes read over decode wall time and over stall time), bytes read per token.

The lower bound. Each run records its exact expert-access sequence (Session.last_routing() after
every token: layer by layer, the set of experts). Belady's optimal replacement (sharpi.belady) on
that sequence with capacity n_slots, starting from the best content the warm-up could have left,
gives the fewest misses any demand cache can have; their bytes over the sequential bandwidth is the
least IO time any reactive engine needs. TPOT / that bound (per token) is the headline ratio; the
bound ignores compute, so TPOT / (bound + resident TPOT) is reported beside it. LRU's simulated
misses on the same sequence are reported for comparison with the engine's cache (its replacement
policy, --cache-policy; docs/cache_policies.md).

Predictors (--predictors none,prev_token,cooc,trajectory,next_gate,learned, --lookahead D): every
budget is run once per predictor with the same RAM budget (prefetch staging slots come out of it),
default budgets 25% and 50%. The trace workload replays the evaluation split of the trace (its last
30% of sequences); its cooc / trajectory sidecars are trained, through sharpi.predict.train, on the
first 70% (restricted to the model's layers), or given with --predictor-file NAME=PATH. Hidden-state
predictors (next_gate, learned) are not run there: the hidden states belong to the random-weight
model whose router the trace overrides. The random workload's sidecars are trained on a trace
harvested from the model itself (sharpi.harvest, random token ids). Per run: TPOT, stall fraction,
hit rate, recall@k / precision, prefetch issued / used / late / wasted bytes, predict_ms / decode_ms,
and the lossless check; per workload and budget: the stall reduction of the best predictor vs none.
--rounds N runs every configuration N times, each budget's order rotated per round so that every
predictor (none included) runs in every position; the report adds medians over rounds and each
predictor's stall cut against the same round's none. When predictors are compared or rounds repeat,
the first configuration runs once before the measured runs, unrecorded (the first streamed run after
the resident one was often far slower than its repeats; docs/predictors.md, session 34).
Random-weight models route unlike trained ones (docs/design.md §6): the report says so beside their numbers.

Process layout: this process only plans, launches and summarises; each configuration runs in a
child (`python -m sharpi.bench --worker CONFIG RESULT`), so one run's memory, page cache and cache
state never leak into the next. The children write JSON; the parent computes policies and ratios.
Output: a table on stdout (also saved as bench.txt) and every raw number in bench.json under --out,
plus a Chrome/Perfetto trace of a few tokens of the smallest-budget run (timeline.json) and, with
matplotlib installed (the plots extra), one PNG of plots per workload (bench-WORKLOAD.png).

Modules (data flows down the list; each imports only those above it):
  isolation.py   subprocess workers, the cgroup-v1 memory cap, page-cache dropping
  workloads.py   the synthetic models, their expert layout and read bandwidth, the trace and its split
  predictors.py  the predictor axis: which predictors run, sidecars trained for the bench
  worker.py      the child process: one configuration decoded, raw numbers written as JSON
  report.py      metrics, bounds and verdicts of each run; the table and bench.json
  plots.py       the PNG plots of a finished report (optional matplotlib)
  arguments.py   the command line and the options it resolves to
  runner.py      the parent: plans, launches and summarises every run; writes the outputs
"""

from .arguments import add_arguments
from .runner import main, run

__all__ = ["add_arguments", "main", "run"]
