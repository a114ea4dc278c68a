#!/usr/bin/env python3
"""Speculative decoding, measured (docs/speculative.md). Two parts:

  e2e          decode tok/s with and without speculation on held-out code prompts, sharpi beside
               llama.cpp (llama-cpp-python's prompt lookup, LlamaPromptLookupDecoding) on the same
               file, greedy, engines alternating, median of --repeats; sharpi's acceptance per
               draft position. Optionally sharpi under a RAM budget (--budget-fraction 0.25).

      PYTHONPATH=python python benchmarks/speculative.py e2e [-m FILE] --threads 2 --repeats 3

  verify-cost  the cost of one verify step of k = 1..K draft tokens (a rewindable step of k + 1
               tokens, then the cut back) against one single-token step, resident and under a
               budget, and the speedup that follows at per-position acceptance rates a: a step then
               yields E = (1 - a^(k+1)) / (1 - a) tokens, so speedup = E * t_1 / t_verify(k).

      PYTHONPATH=python python benchmarks/speculative.py verify-cost -m FILE --budget-fraction 0,0.25
      PYTHONPATH=python python benchmarks/speculative.py verify-cost --text --budget-fraction 0.25 \
          --predictor none,next_gate          (the shipped model: the draft rows' experts prefetched)

  vs-server    sharpi's speculation against llama-server's (prompt lookup and the file's MTP block;
               the llama.cpp inside the llama-cpp-python sdist, built with --target llama-server) on
               the same file and prompts, each engine's speedup over its own plain decoding,
               alternating, median of --repeats; llama-server runs with --no-repack, one slot.

      PYTHONPATH=python python benchmarks/speculative.py vs-server -m glm.gguf --llama-server PATH

  staging-ab   echo staging (SHARPI_ECHO_PREFETCH) on against off, two sessions alternating on the
               same text under a budget (docs/speculative.md: why it ships off).

      PYTHONPATH=python python benchmarks/speculative.py staging-ab -m olmoe.gguf --predictor echo

Prompts: the first --prompt-lines lines of held-out standard-library files (tools/train_moe/corpus.py's
split, never trained on by the shipped model). Times are wall clock per request, prefill included
(the prompts are short), measured the same way for every engine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def heldout_prompts(n: int, lines: int) -> list:
    spec = importlib.util.spec_from_file_location("corpus", ROOT / "tools/train_moe/corpus.py")
    corpus = importlib.util.module_from_spec(spec)
    sys.modules["corpus"] = corpus  # dataclasses look their module up there
    spec.loader.exec_module(corpus)
    _, heldout = corpus.collect()
    out = []
    for f in heldout:
        text = "\n".join(f.text.splitlines()[:lines]) + "\n"
        if len(text) > 200:
            out.append(text)
        if len(out) == n:
            break
    return out


def budget_for(sharpi, path: str, fraction: float, threads: int, **kw) -> int:
    probe = sharpi.Session(path, threads=threads, ram_budget="64GiB", reader="pread", **kw)
    st, info = probe.expert_stats(), probe.info
    probe.close()
    n_slots = max(int(fraction * (info["n_layer"] - info["n_layer_dense_lead"]) * info["n_expert"]),
                  info["n_expert_used"])
    return st["fixed_bytes"] + n_slots * st["slot_bytes"]


# ---------------------------------------------------------------------------------------------- e2e


def sharpi_run(session, spec, prompts, n_gen) -> dict:
    """Decode tok/s: the tokens after the first (which the prefill yields) over the time from the
    first token to the last, summed over the prompts, as for llama.cpp below."""
    n, seconds, drafted, accepted, at_d, at_a = 0, 0.0, 0, 0, [], []
    for p in prompts:
        session.reset()
        for _ in session.generate(p, max_tokens=n_gen, temperature=0.0, stop_at_eos=False, speculative=spec):
            pass
        st = session.last_stats
        n += st["n_generated"] - 1
        seconds += st["decode_s"] - (st["ttft_s"] - st["prefill_s"])
        drafted += st.get("spec_drafted", 0)
        accepted += st.get("spec_accepted", 0)
        for i, a in enumerate(st.get("spec_acceptance_at", [])):
            while len(at_d) <= i:
                at_d.append(0)
                at_a.append(0.0)
            at_d[i] += 1
            at_a[i] += a
    return {"tok_s": n / seconds, "tokens": n, "drafted": drafted, "accepted": accepted,
            "acceptance_at": [a / d for a, d in zip(at_a, at_d)]}


def llama_run(llm, prompts, n_gen) -> dict:
    n, seconds = 0, 0.0
    for p in prompts:
        llm.reset()
        t_first, count = None, 0
        for _ in llm.create_completion(p, max_tokens=n_gen, temperature=0.0, top_k=1, stream=True):
            count += 1
            if t_first is None:
                t_first = time.perf_counter()
        n += count - 1
        seconds += time.perf_counter() - t_first
    return {"tok_s": n / seconds, "tokens": n}


def cmd_e2e(args) -> None:
    import sharpi
    from sharpi.models import default_model_path
    from sharpi.speculative import open_speculation

    path = args.model or str(default_model_path())
    # The MTP block: --mtp FILE, the shipped head for the shipped model, the file's own if it has one.
    mtp = args.mtp
    if mtp is None and path == str(default_model_path()):
        from sharpi.models import default_mtp_path

        mtp = default_mtp_path()
    prompts = heldout_prompts(args.prompts, args.prompt_lines)
    engines = {}
    for fraction in args.budget_fraction:
        label = "sharpi" if fraction == 0 else f"sharpi {fraction:.0%}"
        kw = {"n_ctx": args.ctx, "max_draft_tokens": args.draft, **({"mtp": mtp} if mtp else {})}
        if fraction > 0:
            kw.update(ram_budget=budget_for(sharpi, path, fraction, args.threads, **kw), reader="pread")
        # Streamed, each --predictor at the same RAM budget (its staging slots come out of it): the
        # verify step's draft rows are predicted and prefetched layer by layer (docs/predictors.md).
        variants = [(p, e) for p in (args.predictor if fraction > 0 else ["none"])
                    for e in (args.echo if p != "none" else ["off"])]
        for predictor, echo in variants:
            name = label if predictor == "none" else f"{label} +{predictor}"
            if echo == "on":
                name += " echo-on"
            # SHARPI_ECHO_PREFETCH is read when the session opens: on, a step's first MoE layers are
            # staged from its rows' earlier occurrences (the draft tokens' own experts).
            os.environ["SHARPI_ECHO_PREFETCH"] = "1" if echo == "on" else "0"
            s = sharpi.Session(path, threads=args.threads, predictor=predictor, **kw)
            os.environ.pop("SHARPI_ECHO_PREFETCH")
            engines[name] = lambda s=s: sharpi_run(s, None, prompts, args.n_gen)
            for kind, suffix in (("ngram-simple", " ngram"), ("draft-mtp", " mtp")):
                if kind == "draft-mtp" and not mtp:
                    continue
                # --sweep: every fixed length 1..--draft and the automatic one (DraftLength), to
                # hold the automatic choice against the best fixed k.
                lengths = list(range(1, args.draft + 1)) if args.sweep else [args.draft]
                for k in lengths + (["auto"] if args.sweep else []):
                    sp = open_speculation(s, kind, n_max=args.draft if k == "auto" else k,
                                          ngram_size_n=args.ngram, auto=k == "auto")
                    tag = suffix if not args.sweep else f"{suffix} k={k}"
                    engines[name + tag] = lambda s=s, sp=sp: sharpi_run(s, sp, prompts, args.n_gen)
    if not args.no_llama:
        try:
            from llama_cpp import Llama
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        except ImportError as e:
            print(f"llama-cpp-python not installed: {e}", file=sys.stderr)
        else:
            common = {"model_path": path, "n_ctx": args.ctx, "n_threads": args.threads, "n_threads_batch": args.threads,
                          "verbose": False, "logits_all": False}
            plain = Llama(**common)
            lookup = Llama(**common, draft_model=LlamaPromptLookupDecoding(max_ngram_size=args.ngram,
                                                                         num_pred_tokens=args.draft))
            engines["llama.cpp"] = lambda: llama_run(plain, prompts, args.n_gen)
            engines["llama.cpp lookup"] = lambda: llama_run(lookup, prompts, args.n_gen)
    for run in engines.values():  # warm: page cache, thread pools
        run()
    results = {name: [] for name in engines}
    for _ in range(args.repeats):
        for name, run in engines.items():  # alternating
            results[name].append(run())
    rows = {}
    for name, rs in results.items():
        rows[name] = {"tok_s": statistics.median(r["tok_s"] for r in rs), "runs": rs}
    print(f"file {path}, {len(prompts)} held-out prompts x {args.n_gen} tokens, {args.threads} threads, "
          f"draft {args.draft}, n-gram {args.ngram}, median of {args.repeats}")
    print("| engine | tok/s | x own baseline | acceptance per draft position |")
    print("|---|---|---|---|")
    for name, row in rows.items():
        base = name.split(" k=")[0].removesuffix(" ngram").removesuffix(" lookup").removesuffix(" mtp")
        ratio = row["tok_s"] / rows[base]["tok_s"] if base in rows else 1.0
        acc = row["runs"][-1].get("acceptance_at")
        acc_text = " / ".join(f"{a:.2f}" for a in acc) if acc else ""
        print(f"| {name} | {row['tok_s']:.1f} | {ratio:.2f} | {acc_text} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


# ---------------------------------------------------------------------------------- vs-server


def llama_server_run(port: int, prompts, n_gen) -> dict:
    """Decode tok/s from llama-server's own timings (tokens generated over generation time, the
    prompt's evaluation excluded), summed over the prompts; drafted / accepted from the same."""
    import urllib.request

    n, ms, drafted, accepted = 0, 0.0, 0, 0
    for p in prompts:
        body = json.dumps({"prompt": p, "n_predict": n_gen, "temperature": 0.0, "top_k": 1, "cache_prompt": False,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=3600) as r:
            t = json.loads(r.read())["timings"]
        n += t["predicted_n"]
        ms += t["predicted_ms"]
        drafted += t.get("draft_n", 0)
        accepted += t.get("draft_n_accepted", 0)
    return {"tok_s": n / ms * 1e3, "tokens": n, "drafted": drafted, "accepted": accepted}


def start_llama_server(binary: str, path: str, port: int, args, extra: list):
    import subprocess
    import urllib.request

    cmd = [binary, "-m", path, "-t", str(args.threads), "-tb", str(args.threads), "-c", str(args.ctx), "-np", "1",
           "--no-repack", "--host", "127.0.0.1", "--port", str(port), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        time.sleep(0.5)
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
    proc.kill()
    raise RuntimeError(f"llama-server did not come up: {' '.join(cmd)}")


def cmd_vs_server(args) -> None:
    """sharpi's speculation and llama-server's (the llama.cpp in the llama-cpp-python sdist, which
    has prompt lookup and MTP) on the same file and prompts, each against its own plain decoding."""
    import sharpi
    from sharpi.speculative import open_speculation

    prompts = heldout_prompts(args.prompts, args.prompt_lines)
    plain = sharpi.Session(args.model, threads=args.threads, n_ctx=args.ctx)
    engines, servers = {"sharpi": lambda: sharpi_run(plain, None, prompts, args.n_gen)}, []
    extra = {"ngram-simple": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(args.ngram)],
             "draft-mtp": ["--spec-type", "draft-mtp"]}
    try:
        port = args.port
        servers.append(start_llama_server(args.llama_server, args.model, port, args, []))
        engines["llama-server"] = lambda port=port: llama_server_run(port, prompts, args.n_gen)
        for kind in args.spec_types:
            # draft-mtp runs the file's block beside every step; plain decoding above does not.
            s = sharpi.Session(args.model, threads=args.threads, n_ctx=args.ctx, mtp=True) if kind == "draft-mtp" \
                else plain
            sp = open_speculation(s, kind, n_max=args.draft, ngram_size_n=args.ngram)
            engines[f"sharpi {kind}"] = lambda s=s, sp=sp: sharpi_run(s, sp, prompts, args.n_gen)
            port += 1
            servers.append(start_llama_server(args.llama_server, args.model, port, args,
                                              extra[kind] + ["--spec-draft-n-max", str(args.draft)]))
            engines[f"llama-server {kind}"] = lambda port=port: llama_server_run(port, prompts, args.n_gen)
        for run in engines.values():  # warm
            run()
        results = {name: [] for name in engines}
        for _ in range(args.repeats):
            for name, run in engines.items():  # alternating
                results[name].append(run())
    finally:
        for proc in servers:
            proc.kill()
            proc.wait()
    print(f"file {args.model}, {len(prompts)} held-out prompts x {args.n_gen} tokens, {args.threads} threads, "
          f"draft {args.draft}, n-gram {args.ngram}, median of {args.repeats}, engines alternating")
    print("| engine | decode tok/s | ÷ own plain | draft tokens accepted |")
    print("|---|---|---|---|")
    med = {name: statistics.median(r["tok_s"] for r in rs) for name, rs in results.items()}
    for name, rs in results.items():
        base = "sharpi" if name.startswith("sharpi") else "llama-server"
        d, a = rs[-1].get("drafted", 0), rs[-1].get("accepted", 0)
        print(f"| {name} | {med[name]:.2f} | {med[name] / med[base]:.2f} | {f'{a}/{d}' if d else ''} |")


# ------------------------------------------------------------------------------------ verify-cost


def step_times(session, stream, k: int, iters: int) -> tuple:
    """(median seconds, MiB read, stall ms, demand hit rate, per step) of steps of k + 1 tokens
    (rewindable, all logits) each followed by the cut back to one kept token; k = 0 is a plain
    one-token step. Tokens come from `stream` (an iterator of lists of k + 1 tokens)."""
    out = []
    before = _expert_totals(session)
    for _ in range(iters):
        tokens = stream(k + 1)
        n0 = session.n_past
        t0 = time.perf_counter()
        session.decode(tokens, all_logits=k > 0, rewindable=k > 0)
        if k:
            session.truncate(n0 + 1)
        out.append(time.perf_counter() - t0)
    after = _expert_totals(session)
    d = [a - b for a, b in zip(after, before)]
    return (statistics.median(out), d[0] / iters / 2**20, d[1] / iters, d[3] / d[2] if d[2] else 1.0)


def _expert_totals(session) -> tuple:
    layers = session.expert_stats()["layers"]
    return tuple(sum(la[key] for la in layers) for key in ("bytes_read", "stall_ms", "accesses", "hits"))


def token_stream(session, text: bool, rng):
    """Steps' tokens: random ids, or (--text) held-out text in order, a step taking the next k + 1
    tokens and keeping one, so its draft rows are the text's real continuation."""
    if not text:
        n_vocab = session.info["n_vocab"]
        return lambda n: [int(t) for t in rng.integers(0, n_vocab, n)]
    ids = [t for p in heldout_prompts(64, 400) for t in session.tokenize(p)]
    pos = [0]

    def take(n):
        if pos[0] + n > len(ids):
            pos[0] = 0
        out = ids[pos[0]:pos[0] + n]
        pos[0] += 1
        return out

    return take


def cmd_verify_cost(args) -> None:
    import sharpi
    from sharpi.models import default_model_path

    path = args.model or str(default_model_path())
    for fraction in args.budget_fraction:
        variants = [(True, "none", False)]
        if fraction > 0:
            variants += [(False, "none", False)]
            for p in args.predictor:
                if p != "none":
                    variants += [(True, p, False), (True, p, True)]
        for read_ahead, predictor, echo in variants:
            rng = np.random.default_rng(1)
            # The verify step's draft rows: each next layer's experts guessed and read while a layer
            # computes (the engine's multi-token read-ahead, steps of 32 rows and more), or not
            # (SHARPI_READ_AHEAD=0); with a predictor, each draft row's experts predicted layer by
            # layer, and with echo the step's first MoE layers staged from each row's earlier
            # occurrence before the step's first gate (SHARPI_ECHO_PREFETCH).
            os.environ["SHARPI_READ_AHEAD"] = "1" if read_ahead else "0"
            os.environ["SHARPI_ECHO_PREFETCH"] = "1" if echo else "0"
            kw = {"threads": args.threads, "n_ctx": args.ctx, "max_draft_tokens": args.draft}
            if fraction > 0:
                kw.update(ram_budget=budget_for(sharpi, path, fraction, args.threads, n_ctx=args.ctx,
                                                max_draft_tokens=args.draft), reader="auto",
                          predictor=predictor)
            s = sharpi.Session(path, **kw)
            stream = token_stream(s, args.text, rng)
            s.decode(stream(32))
            for _ in range(3):  # warm
                step_times(s, stream, 0, 2)
            per_round = {k: [] for k in range(args.draft + 1)}
            for _ in range(args.repeats):
                for k in range(args.draft + 1):  # alternating k within each round
                    per_round[k].append(step_times(s, stream, k, args.iters))
            t, mib, stall, hit = ({k: statistics.median(r[i] for r in v) for k, v in per_round.items()}
                                  for i in range(4))
            label = ("resident" if fraction == 0 else
                     f"{fraction:.0%} of experts, read-ahead {'on' if read_ahead else 'off'}, predictor {predictor}"
                     + (f", echo {'on' if echo else 'off'}" if predictor != "none" else ""))
            print(f"\n{path} {label}: one token {t[0] * 1e3:.1f} ms, {mib[0]:.0f} MiB read, "
                  f"stall {stall[0]:.1f} ms, hit rate {hit[0]:.2f}")
            print("| k | verify ms | ÷ one token | MiB read | stall ms | hit rate | speedup a=0.6 | a=0.8 | a=0.9 |")
            print("|---|---|---|---|---|---|---|---|---|")
            for k in range(1, args.draft + 1):
                cells = []
                for a in (0.6, 0.8, 0.9):
                    expected = (1 - a ** (k + 1)) / (1 - a)
                    cells.append(f"{expected * t[0] / t[k]:.2f}")
                print(f"| {k} | {t[k] * 1e3:.1f} | {t[k] / t[0]:.2f} | {mib[k]:.0f} | {stall[k]:.1f} | {hit[k]:.2f} | "
                      + " | ".join(cells) + " |")
            s.close()
    os.environ.pop("SHARPI_READ_AHEAD", None)
    os.environ.pop("SHARPI_ECHO_PREFETCH", None)


def cmd_staging_ab(args) -> None:
    """Echo staging on against off (SHARPI_ECHO_PREFETCH), two sessions open at once and
    alternating block by block on the same held-out text, so the disk's drift between runs cancels:
    median ms, stall ms and demand hit rate of one-token steps and verify steps of k drafts."""
    import os

    import sharpi

    budget = budget_for(sharpi, args.model, args.budget_fraction, args.threads, n_ctx=args.ctx,
                        max_draft_tokens=args.draft)
    sessions = {}
    for echo in ("1", "0"):
        os.environ["SHARPI_ECHO_PREFETCH"] = echo
        s = sharpi.Session(args.model, threads=args.threads, n_ctx=args.ctx, max_draft_tokens=args.draft,
                           ram_budget=budget, reader="auto", predictor=args.predictor)
        stream = token_stream(s, True, np.random.default_rng(1))
        s.decode(stream(32))
        sessions["on" if echo == "1" else "off"] = (s, stream)
    os.environ.pop("SHARPI_ECHO_PREFETCH")
    ks = sorted({0, *args.k})
    results = {(name, k): [] for name in sessions for k in ks}
    for _ in range(args.rounds):
        for k in ks:
            for name, (s, stream) in sessions.items():  # alternating
                if s.n_past + k + 1 > args.ctx - 8:
                    s.reset()
                    s.decode(stream(32))
                results[(name, k)].append(step_times(s, stream, k, args.iters))
    print(f"{args.model}, {args.budget_fraction:.0%} of experts, predictor {args.predictor}, "
          f"{args.rounds} rounds x {args.iters} steps, sessions alternating")
    print("| step | staging on: ms / stall ms / hit rate | staging off: ms / stall ms / hit rate |")
    print("|---|---|---|")
    for k in ks:
        cells = []
        for name in ("on", "off"):
            r = results[(name, k)]
            cells.append(" / ".join(f"{statistics.median(x[i] for x in r) * m:.{d}f}"
                                    for i, m, d in ((0, 1e3, 1), (2, 1.0, 1), (3, 1.0, 2))))
        print(f"| {'one token' if k == 0 else f'verify, {k} drafts'} | {cells[0]} | {cells[1]} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("e2e", "verify-cost"):
        q = sub.add_parser(name)
        q.add_argument("-m", "--model", default=None)
        q.add_argument("--threads", type=int, default=2)
        q.add_argument("--ctx", type=int, default=2048)
        q.add_argument("--draft", type=int, default=4)
        q.add_argument("--repeats", type=int, default=3)
        q.add_argument("--budget-fraction", type=lambda s: [float(x) for x in s.split(",")], default=[0.0])
    e2e = sub.choices["e2e"]
    e2e.add_argument("--prompts", type=int, default=8)
    e2e.add_argument("--prompt-lines", type=int, default=24)
    e2e.add_argument("--n-gen", type=int, default=96)
    e2e.add_argument("--ngram", type=int, default=3)
    e2e.add_argument("--no-llama", action="store_true")
    e2e.add_argument("--sweep", action="store_true", help="each fixed draft length 1..--draft and the automatic one")
    e2e.add_argument("--mtp", default=None, help="a file holding the model's MTP block (default: the shipped head "
                     "for the shipped model, else none)")
    e2e.add_argument("--json", default=None)
    e2e.add_argument("--echo", type=lambda s: s.split(","), default=["off"],
                     help="streamed runs with a predictor: staging echo guesses off (the default), on, or "
                     "off,on (side by side)")
    sub.choices["verify-cost"].add_argument("--iters", type=int, default=8)
    sub.choices["verify-cost"].add_argument("--text", action="store_true",
                                            help="steps take held-out text in order (a trained model), not random ids")
    for name in ("e2e", "verify-cost"):
        sub.choices[name].add_argument(
            "--predictor", type=lambda s: s.split(","), default=["none"],
            help="streamed runs: also with these predictors (comma-separated, e.g. none,next_gate)")
    vs = sub.add_parser("vs-server")
    vs.add_argument("-m", "--model", required=True, help="a file both engines run (with an MTP block for draft-mtp)")
    vs.add_argument("--llama-server", required=True, help="llama-server built from the llama-cpp-python sdist")
    vs.add_argument("--spec-types", type=lambda s: s.split(","), default=["ngram-simple", "draft-mtp"])
    vs.add_argument("--threads", type=int, default=2)
    vs.add_argument("--ctx", type=int, default=2048)
    vs.add_argument("--draft", type=int, default=3)
    vs.add_argument("--ngram", type=int, default=3)
    vs.add_argument("--prompts", type=int, default=4)
    vs.add_argument("--prompt-lines", type=int, default=24)
    vs.add_argument("--n-gen", type=int, default=64)
    vs.add_argument("--repeats", type=int, default=3)
    vs.add_argument("--port", type=int, default=18431)
    ab = sub.add_parser("staging-ab")
    ab.add_argument("-m", "--model", required=True)
    ab.add_argument("--predictor", default="echo")
    ab.add_argument("--budget-fraction", type=float, default=0.25)
    ab.add_argument("--threads", type=int, default=2)
    ab.add_argument("--ctx", type=int, default=512)
    ab.add_argument("--draft", type=int, default=4)
    ab.add_argument("-k", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4])
    ab.add_argument("--rounds", type=int, default=5)
    ab.add_argument("--iters", type=int, default=4)
    args = p.parse_args()
    {"e2e": cmd_e2e, "verify-cost": cmd_verify_cost, "vs-server": cmd_vs_server,
     "staging-ab": cmd_staging_ab}[args.cmd](args)


if __name__ == "__main__":
    main()
