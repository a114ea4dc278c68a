"""Thread safety of the Python-visible Session (issue 15): threads call every method while another
thread decodes with a Python predictor (which takes the GIL inside the session mutex), under
faulthandler with a deadline so a deadlock fails the test with every thread's stack instead of
hanging CI. Marked `concurrency` so a TSan build can select these tests (-m concurrency).

Oracle: the same generation on a fresh session with no other threads. Predictors and the methods
hammered here never change tokens (prefetch is lossless), so the text must be identical.
"""

from __future__ import annotations

import faulthandler
import sys
import threading

import numpy as np
import pytest
import sharpi
from sharpi.make_model import write_model

pytestmark = pytest.mark.concurrency

DEADLINE_S = 300  # far above a normal run (~10-30 s here); only a deadlock gets there
N_CTX = 256


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("concurrency") / "m.gguf")
    write_model(path, preset="tiny", quant="q4_k_m", seed=8, n_layer=4)
    return path


@pytest.fixture
def deadline():
    faulthandler.dump_traceback_later(DEADLINE_S, exit=True, file=sys.stderr)
    yield
    faulthandler.cancel_dump_traceback_later()


class NextArgmax(sharpi.Predictor):
    """A Python predictor: the current router's argmax for the next layer."""

    def observe(self, layer, hidden, router_logits, history, prev):
        return [(layer + 1, int(np.argmax(router_logits)), float(router_logits.max()))]


def streamed_session(path: str, predictor) -> sharpi.Session:
    probe = sharpi.Session(path, threads=1, n_ctx=N_CTX, ram_budget="8GiB", reader="pread")
    st, k = probe.expert_stats(), probe.info["n_expert_used"]
    budget = st["fixed_bytes"] + 2 * k * st["slot_bytes"]  # minimum: k slots + k staging
    return sharpi.Session(path, threads=2, n_ctx=N_CTX, ram_budget=budget, reader="pread", predictor=predictor,
                          timeline=True, dump_activations=True)


PROMPT = list(range(3, 40))


def generate(s: sharpi.Session) -> list:
    return list(s.generate(PROMPT, max_tokens=24, temperature=0.0, stop_at_eos=False))


def hammer(s: sharpi.Session, stop: threading.Event, errors: list, counts: dict, name: str) -> None:
    """Calls every read-only or output-neutral method in a loop until stop is set."""
    calls = [
        lambda: s.dump(),
        lambda: s.last_routing(),
        lambda: s.timeline_events(),
        lambda: s.clear_timeline(),
        lambda: s.expert_stats(),
        lambda: s.predictor_errors(),
        lambda: s.reset_stats(),
        lambda: s.set_route_trace(None),  # replay stays off: no effect on tokens
        lambda: s._core.set_predictor(NextArgmax()),  # a new predictor object: tokens unchanged
        lambda: s.n_past,
        lambda: s.info,
        lambda: s._core.metadata_string("general.architecture"),
        lambda: s.clear_cancel(),
    ]
    i = 0
    try:
        while not stop.is_set():
            calls[i % len(calls)]()
            i += 1
    except BaseException as e:  # noqa: BLE001 - reported by the main thread
        errors.append(f"{name}: {e!r}")
    counts[name] = i


def test_methods_from_threads_during_generate_match_a_single_threaded_run(model, deadline):
    expected = generate(streamed_session(model, NextArgmax()))
    s = streamed_session(model, NextArgmax())
    stop, errors, counts = threading.Event(), [], {}
    threads = [threading.Thread(target=hammer, args=(s, stop, errors, counts, f"t{i}")) for i in range(4)]
    for t in threads:
        t.start()
    try:
        got = generate(s)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert errors == []
    assert got == expected
    assert all(n > 13 for n in counts.values()), counts  # every method ran at least once per thread
    assert s.expert_stats()["predictor_failures"] == 0


def test_generate_in_a_thread_while_the_main_thread_hammers(model, deadline):
    """The same with the roles swapped: decode off the main thread (no Ctrl-C bridge there)."""
    expected = generate(streamed_session(model, NextArgmax()))
    s = streamed_session(model, NextArgmax())
    out = {}
    worker = threading.Thread(target=lambda: out.setdefault("text", generate(s)))
    stop, errors, counts = threading.Event(), [], {}
    worker.start()
    watcher = threading.Thread(target=lambda: (worker.join(), stop.set()))
    watcher.start()
    hammer(s, stop, errors, counts, "main")
    watcher.join()
    assert errors == []
    assert out["text"] == expected


def test_reset_and_cancel_from_threads_never_break_decode(model, deadline):
    """Methods that do change state (reset, cancel): each decode either completes or raises
    CancelledError / ContextOverflowError, never crashes or deadlocks, and afterwards the session
    gives the fresh session's logits."""
    s = streamed_session(model, NextArgmax())
    stop = threading.Event()

    def disrupt():
        i = 0
        while not stop.is_set():
            (s.reset if i % 2 else s.cancel)()
            i += 1

    threads = [threading.Thread(target=disrupt) for _ in range(2)]
    for t in threads:
        t.start()
    outcomes = {"ok": 0, "cancelled": 0, "overflow": 0}
    try:
        for i in range(150):
            try:
                logits = s.decode([5 + i % 50] if i % 10 else PROMPT)
                assert np.isfinite(logits).all()
                outcomes["ok"] += 1
            except sharpi.CancelledError:
                outcomes["cancelled"] += 1
            except sharpi.ContextOverflowError:
                outcomes["overflow"] += 1
                s.reset()
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert outcomes["cancelled"] > 0, outcomes
    s.reset()
    ref = sharpi.Session(model, threads=1, n_ctx=N_CTX)
    np.testing.assert_array_equal(s.decode(PROMPT, all_logits=True), ref.decode(PROMPT, all_logits=True))
