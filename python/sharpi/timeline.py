"""Chrome / Perfetto trace-event JSON from the engine's timeline spans (docs/design.md §7).

What it owns: turning a list of spans {track, name, start_us, dur_us} (Session.timeline_events())
into the JSON Object Format of the Trace Event Format, which ui.perfetto.dev and chrome://tracing
open directly. It only writes the file it is given; it never reads the engine.

Layout: one process ("sharpi"), one thread lane (tid) per track name: "token", "compute", "compute stream",
"copy stream", "stall", "reader" first when present, then the others in order of first appearance, named
by "thread_name" metadata and ordered by "thread_sort_index". The two stream tracks come from a device
session (cuda/device_forward.cu: each layer's span on the compute stream, each expert fill's on the copy
stream, device times placed on the host clock), so overlap of copies with compute shows directly. Each span
is a complete ("X") event; times stay in microseconds, as the format expects.

Perfetto draws the slices of one thread as a stack, so they must nest: a span that starts inside
another must also end inside it. Expert reads overlap without nesting (the reader keeps several in
flight), so a track whose spans cross is spread over extra lanes named "reader #2", "reader #3", ...
(first fit: a span goes to the first lane where it nests or follows). Nested spans such as a layer
and its attention stay on one lane.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping

_PID = 1
_TRACK_ORDER = ("token", "compute", "compute stream", "copy stream", "stall", "reader")


def _lanes_for_track(spans: list) -> list:
    """Splits one track's spans (sorted by start, longer first) into lanes where spans nest."""
    lanes: list = []  # each: (list of spans, stack of open end times)
    for span in spans:
        start, end = span["start_us"], span["start_us"] + span["dur_us"]
        for events, open_ends in lanes:
            while open_ends and open_ends[-1] <= start:
                open_ends.pop()
            if not open_ends or end <= open_ends[-1]:
                events.append(span)
                open_ends.append(end)
                break
        else:
            lanes.append(([span], [end]))
    return [events for events, _ in lanes]


def chrome_trace(events: Iterable[Mapping], process_name: str = "sharpi") -> dict:
    """The trace-event document for `events` (dicts with track, name, start_us, dur_us)."""
    by_track: dict = {}
    for i, e in enumerate(events):
        try:
            track, name = str(e["track"]), str(e["name"])
            start, dur = float(e["start_us"]), float(e["dur_us"])
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"timeline event {i} lacks a valid track/name/start_us/dur_us: {e!r}") from err
        if dur < 0:
            raise ValueError(f"timeline event {i} ({track} {name!r}) has negative duration {dur}")
        by_track.setdefault(track, []).append({"name": name, "start_us": start, "dur_us": dur})

    tracks = [t for t in _TRACK_ORDER if t in by_track] + [t for t in by_track if t not in _TRACK_ORDER]
    trace_events: list = [
        {"ph": "M", "pid": _PID, "tid": 0, "name": "process_name", "args": {"name": process_name}},
    ]
    tid = 0
    for track in tracks:
        spans = sorted(by_track[track], key=lambda s: (s["start_us"], -s["dur_us"]))
        for lane_index, lane in enumerate(_lanes_for_track(spans)):
            tid += 1
            lane_name = track if lane_index == 0 else f"{track} #{lane_index + 1}"
            trace_events.append(
                {"ph": "M", "pid": _PID, "tid": tid, "name": "thread_name", "args": {"name": lane_name}}
            )
            trace_events.append(
                {"ph": "M", "pid": _PID, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}}
            )
            for s in lane:
                trace_events.append(
                    {
                        "ph": "X",
                        "pid": _PID,
                        "tid": tid,
                        "name": s["name"],
                        "cat": track,
                        "ts": s["start_us"],
                        "dur": s["dur_us"],
                    }
                )
    return {"traceEvents": trace_events, "displayTimeUnit": "ms"}


def write_chrome_trace(events: Iterable[Mapping], path, process_name: str = "sharpi") -> dict:
    """Writes the trace-event JSON of `events` to `path`; returns a summary {path, n_events, lanes}."""
    doc = chrome_trace(events, process_name)
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f)
    lanes = [e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"]
    return {"path": path, "n_events": sum(1 for e in doc["traceEvents"] if e["ph"] == "X"), "lanes": lanes}
