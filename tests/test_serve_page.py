"""The page `sharpi serve` answers at / and the live expert-cache view behind it (GET
/v1/sharpi/stats, sharpi.serve_live), issue 20.

Oracles: for the view's arithmetic, counters written out here with the rates worked by hand; for a
served request, an in-process Session with the same RAM budget and reader decoding the same prompt
(its expert_stats() divided here: the demand path without a predictor is deterministic, so the
per-layer counts must agree exactly); for the page, its own script run under node (a small DOM
stand-in, tests/web_page_harness.js) against the live server, whose answer must be the Session's
greedy text. A real headless browser is not used: the project installs nothing beyond PyPI, and no
PyPI package ships a browser binary (Playwright and Selenium drive one installed separately).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import sharpi
from sharpi.models import default_model_path
from sharpi.serve_live import LiveStats
from subprocess_env import child_env
from test_serve import MODEL_ID, N_CTX, chatml_ids, client, expected, raw, start_server


def stats_of(layers: list) -> dict:
    keys = ("accesses", "hits", "bytes_read", "stall_ms", "predictions", "predicted_correct")
    return {"layers": [dict(zip(keys, layer)) for layer in layers], "reader": "pread", "n_slots": 6,
            "slot_bytes": 100, "budget_bytes": 1000}


def test_live_rates_by_hand():
    live = LiveStats(top_k=2, interval_s=0.0)
    live.begin_request(stats_of([(10, 5, 1000, 2.0, 4, 6), (0, 0, 0, 0.0, 0, 0)]))
    live.add_tokens(4)
    live.observe(stats_of([(18, 11, 1800, 6.0, 8, 10), (8, 2, 600, 1.0, 0, 0)]))
    v = live.view()
    assert v["tokens"] == 4 and v["samples"] == 1
    assert v["cache"] == {"streaming": True, "reader": "pread", "n_slots": 6, "slot_bytes": 100,
                          "budget_bytes": 1000, "n_layer": 2, "top_k": 2}
    # Layer 0: 6 of 8 new demands hit; 4 correct of 4 predictions x top-2; 800 bytes, 4 ms over 4 tokens.
    assert v["layers"] == {"hit_rate": [0.75, 0.25], "recall": [0.5, None], "stall_ms_per_token": [1.0, 0.25],
                           "bytes_per_token": [200.0, 150.0]}
    (point,) = v["series"]
    assert point["tokens"] == 4 and point["hit_rate"] == (6 + 2) / 16 and point["recall"] == 0.5
    assert point["stall_ms_per_token"] == 1.25 and point["bytes_per_token"] == 350.0
    # No new positions: no point. A second request's layers count from its own start.
    live.observe(stats_of([(18, 11, 1800, 6.0, 8, 10), (8, 2, 600, 1.0, 0, 0)]))
    live.begin_request(stats_of([(18, 11, 1800, 6.0, 8, 10), (8, 2, 600, 1.0, 0, 0)]))
    live.add_tokens(2)
    live.observe(stats_of([(20, 13, 1900, 6.0, 10, 12), (10, 2, 800, 1.0, 0, 0)]))
    v = live.view()
    assert v["samples"] == 2 and len(v["series"]) == 2
    assert v["layers"]["hit_rate"] == [1.0, 0.0] and v["layers"]["bytes_per_token"] == [50.0, 100.0]


@pytest.fixture(scope="module")
def budget():
    """A RAM budget of three tokens' worth of expert slots: most demands miss and are read."""
    probe = sharpi.Session(default_model_path(), threads=1, n_ctx=N_CTX, ram_budget="8GiB", reader="pread")
    st, k = probe.expert_stats(), probe.info["n_expert_used"]
    return st["fixed_bytes"] + 3 * k * st["slot_bytes"]


def test_live_view_matches_the_sessions_counters(budget):
    messages = [{"role": "user", "content": "Write a function that merges two sorted lists."}]
    oracle = sharpi.Session(default_model_path(), threads=1, n_ctx=N_CTX, ram_budget=budget, reader="pread")
    ids = chatml_ids(oracle, messages[0]["content"])
    want = "".join(oracle.generate(ids, max_tokens=64, temperature=0.0))
    n_tokens, layers = oracle.n_past, oracle.expert_stats()["layers"]
    for port in start_server("--ram-budget", str(budget), "--reader", "pread", "--predictor", "none"):
        polls = []
        stream = client(port).chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=64,
                                                      temperature=0, stream=True)
        text = ""
        for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            polls.append(raw("GET", port, "/v1/sharpi/stats")[1])
        assert text == want
        final = raw("GET", port, "/v1/sharpi/stats")[1]
    # Updated while the answer streamed, not only at its end (which adds one sample): the first
    # token is always sampled. (Whether a poll lands mid-request depends on the machine's load.)
    assert all(set(p["live"]) == {"cache", "tokens", "samples", "layers", "series"} for p in polls)
    assert final["busy"] is False and len(final["live"]["series"]) >= 2
    live = final["live"]
    assert live["cache"]["streaming"] and live["cache"]["n_layer"] == len(layers)
    assert live["tokens"] == n_tokens == sum(p["tokens"] for p in live["series"])
    assert live["layers"]["hit_rate"] == [la["hits"] / la["accesses"] if la["accesses"] else None for la in layers]
    assert live["layers"]["bytes_per_token"] == [la["bytes_read"] / n_tokens for la in layers]
    assert live["layers"]["recall"] == [None] * len(layers)  # no predictor, no predictions
    assert sum(la["misses"] for la in layers) > 0


def test_page_chats_and_plots(budget):
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed: the page's script cannot run (apt-get install nodejs)")
    message = "Write a function that checks for primes."
    oracle = sharpi.Session(default_model_path(), threads=1, n_ctx=N_CTX)
    want, n_gen = expected(oracle, chatml_ids(oracle, message), max_tokens=24, temperature=0.0)
    harness = Path(__file__).with_name("web_page_harness.js")
    for port in start_server("--ram-budget", str(budget), "--reader", "pread"):
        status, page = raw_text(port, "/")
        assert status == 200 and page.startswith("<!doctype html>")
        done = subprocess.run([node, str(harness), f"http://127.0.0.1:{port}", message, "0", "24"],
                              check=False, capture_output=True, text=True, timeout=300, env=child_env())
        assert done.returncode == 0, done.stderr
        shown = json.loads(done.stdout)
    assert shown["user"] == message
    assert shown["answer"] == want
    assert shown["answer_updates"] > 2, "the answer did not stream"
    assert f"{n_gen} generated" in shown["status"] and "tokens/s" in shown["status"]
    assert "slots of" in shown["cache"] and "1 requests" in shown["cache"]
    assert 0 < shown["hit_bars"] <= oracle.info["n_layer"] and shown["recall_bars"] == 0
    assert min(shown["stall_lines"], shown["bytes_lines"], shown["tps_lines"]) >= 1


def raw_text(port: int, path: str) -> tuple[int, str]:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()
