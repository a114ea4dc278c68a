"""The page `sharpi serve` answers at / and the live expert-cache view behind it (GET
/v1/sharpi/stats, sharpi.server.live), issue 20.

Oracles: for the view's arithmetic, counters written out here with the rates worked by hand; for a
served request, an in-process Session with the same RAM budget and reader decoding the same prompt
(its expert_stats() divided here: the demand path without a predictor is deterministic, so the
per-layer counts must agree exactly); for the page, its own script run under node (a small DOM
stand-in, tests/web_page_harness.js) against the live server, whose answer must be the Session's
greedy text; and the page in a real headless Chromium (Debian's chromium and chromium-driver, which
.ci/run installs, driven by Selenium from the test extra; Selenium Manager is never asked to fetch
a browser or driver), typed into like a person would, whose answer must be the same greedy text and
whose plots must hold drawn data afterwards, read back from the canvases' pixels.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import sharpi
from browser_policy import CHROMEDRIVER, CHROMIUM, chromium_or_skip
from ci_policy import prerequisite_missing
from sharpi.models import default_model_path
from sharpi.server.live import LiveStats
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
        prerequisite_missing("node is not installed: the page's script cannot run (apt-get install nodejs)")
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


def test_page_offers_completion_mode_for_a_model_without_a_template(budget):
    """The shipped model has no chat template: the page says so, and in completion mode a message is
    continued as raw text through /v1/completions, exactly Session.generate's greedy continuation of
    the message's own tokens (no ChatML around it)."""
    node = shutil.which("node")
    if node is None:
        prerequisite_missing("node is not installed: the page's script cannot run (apt-get install nodejs)")
    message = "def is_prime(n):"
    oracle = sharpi.Session(default_model_path(), threads=1, n_ctx=N_CTX)
    assert oracle.tokenizer.chat_template is None, "the premise: the shipped model has no template"
    want, n_gen = expected(oracle, oracle.tokenizer.encode(message), max_tokens=24, temperature=0.0)
    chat_want, _ = expected(oracle, chatml_ids(oracle, message), max_tokens=24, temperature=0.0)
    assert want != chat_want, "completion and chat must differ for the test to tell them apart"
    harness = Path(__file__).with_name("web_page_harness.js")
    for port in start_server("--ram-budget", str(budget), "--reader", "pread"):
        done = subprocess.run([node, str(harness), f"http://127.0.0.1:{port}", message, "0", "24", "completion"],
                              check=False, capture_output=True, text=True, timeout=300, env=child_env())
        assert done.returncode == 0, done.stderr
        shown = json.loads(done.stdout)
    assert "no chat template" in shown["notice"] and "completion mode" in shown["notice"]
    assert shown["user"] == message
    assert shown["answer"] == want
    assert f"{n_gen} generated" in shown["status"]


# Every canvas's pixels in series colours (not white, not the grey of the "max ..." / "no data" label):
# what the plots drew from data. Returned per canvas id.
COLOURED_PIXELS_JS = """
const out = {};
for (const c of document.querySelectorAll("canvas")) {
  const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
  let n = 0;
  for (let i = 0; i < d.length; i += 4) {
    const [r, g, b, a] = [d[i], d[i + 1], d[i + 2], d[i + 3]];
    if (a > 0 && Math.max(r, g, b) - Math.min(r, g, b) > 40) n++;
  }
  out[c.id] = n;
}
return out;
"""

# Records the length of the answer's text each time the page rewrites it (the page replaces the
# assistant message's text node once per streamed piece).
WATCH_ANSWER_JS = """
window.answerLengths = [];
new MutationObserver(() => {
  const answers = document.querySelectorAll("#log .assistant");
  if (answers.length) window.answerLengths.push(answers[answers.length - 1].textContent.length);
}).observe(document.getElementById("log"), { childList: true, subtree: true, characterData: true });
"""


def test_page_in_headless_chromium(budget, tmp_path, monkeypatch):
    chromium_or_skip()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    # The driver is given by path, so Selenium Manager is skipped; offline in case it ever runs.
    monkeypatch.setenv("SE_OFFLINE", "true")
    message = "Write a function that checks for primes."
    oracle = sharpi.Session(default_model_path(), threads=1, n_ctx=N_CTX)
    want, n_gen = expected(oracle, chatml_ids(oracle, message), max_tokens=24, temperature=0.0)
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1280,800", f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(flag)
    service = Service(CHROMEDRIVER, log_output=str(tmp_path / "chromedriver.log"))
    for port in start_server("--ram-budget", str(budget), "--reader", "pread"):
        driver = webdriver.Chrome(service=service, options=options)
        try:
            driver.set_script_timeout(60)
            driver.get(f"http://127.0.0.1:{port}/")
            wait = WebDriverWait(driver, 240)
            wait.until(lambda d: d.find_element(By.ID, "model").text == MODEL_ID)
            # The first poll of the stats has drawn the empty plots.
            wait.until(lambda d: d.execute_script("return document.body.dataset.samples") == "0")
            before = driver.execute_script(COLOURED_PIXELS_JS)
            driver.execute_script(WATCH_ANSWER_JS)
            for field, value in (("temperature", "0"), ("max-tokens", "24")):
                box = driver.find_element(By.ID, field)
                box.clear()
                box.send_keys(value)
            driver.find_element(By.ID, "input").send_keys(message, Keys.ENTER)
            wait.until(lambda d: "generated" in d.find_element(By.ID, "status").text)
            final = raw("GET", port, "/v1/sharpi/stats")[1]["live"]
            # The page polls every second when idle: wait for the poll that drew the final numbers.
            drawn = str(final["samples"])
            wait.until(lambda d, drawn=drawn: d.execute_script("return document.body.dataset.samples") == drawn)
            after = driver.execute_script(COLOURED_PIXELS_JS)
            answers, user = driver.execute_script(
                'const text = (q) => [...document.querySelectorAll(q)].map((e) => e.textContent);'
                'return [text("#log .assistant"), text("#log .user")];')
            status = driver.find_element(By.ID, "status").text
            cache = driver.find_element(By.ID, "cache").text
            lengths = driver.execute_script("return window.answerLengths")
            screenshot = tmp_path / "sharpi-serve-page.png"
            assert driver.save_screenshot(str(screenshot))
            print(f"screenshot: {screenshot}")
        finally:
            driver.quit()
    assert user == [message]
    assert answers == [want]
    # Lengths in the page's own units (UTF-16), growing piece by piece up to the whole answer.
    assert len(set(lengths)) > 2 and lengths == sorted(lengths), f"the answer did not stream: {lengths}"
    assert lengths[-1] == len(want.encode("utf-16-le")) // 2
    assert f"{n_gen} generated" in status and "tokens/s" in status
    assert "slots of" in cache and "1 requests" in cache
    assert final["samples"] >= 2 and final["tokens"] > 0
    # Before the request every plot was empty; after it the hit-rate bars, MiB read and tokens/s
    # lines hold data (no predictor: recall stays empty; stall may be all zero, a line on the axis).
    assert all(n == 0 for n in before.values()), before
    assert min(after["plot-hit"], after["plot-bytes"], after["plot-tps"]) > 0, after
    assert after["plot-recall"] == 0, after
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def raw_text(port: int, path: str) -> tuple[int, str]:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()
