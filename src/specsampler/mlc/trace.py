"""MLC-LLM's ``EventTraceRecorder``: per-request events of the Sampler's calls, as a Chrome trace (Perfetto)."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Sequence

from ..validation import fail

_TRACE_PID = 1


class EventTraceRecorder:
    """Per-request events, written as a Chrome trace JSON (opens in Perfetto or chrome://tracing).

    An event ``"start X"`` opens a duration named ``X`` on the request's track and
    ``"finish X"`` closes it (trace phases ``"B"`` / ``"E"``); any other event is an instant
    (``"i"``). Each request id has its own track: a thread id, named after the request with a
    ``thread_name`` metadata event. Timestamps are microseconds of :func:`time.perf_counter`
    since the recorder was created. Thread-safe.
    """

    _START, _FINISH = "start ", "finish "

    def __init__(self):
        self._origin = time.perf_counter()
        self._events: list[tuple[str, str, float]] = []  # (request id, event, microseconds)
        self._lock = threading.Lock()

    def add_event(self, request_id: str, event: str) -> None:
        """Record ``event`` for one request now."""
        self.add_event_batch([request_id], event)

    def add_event_batch(self, request_ids: Sequence[str], event: str) -> None:
        """Record ``event`` for each of ``request_ids``, at one timestamp."""
        if not isinstance(event, str):
            fail("EventTraceRecorder.add_event", "event", "a str", type(event).__name__)
        ts = (time.perf_counter() - self._origin) * 1e6
        with self._lock:
            self._events.extend((str(r), event, ts) for r in request_ids)

    def dump_json(self) -> str:
        """The trace: a JSON object ``{"traceEvents": [...], "displayTimeUnit": "ms"}``."""
        with self._lock:
            events = list(self._events)
        tids: dict[str, int] = {}
        trace = []
        for request_id, event, ts in events:
            if request_id not in tids:
                tids[request_id] = len(tids) + 1
                trace.append({"name": "thread_name", "ph": "M", "pid": _TRACE_PID, "tid": tids[request_id],
                              "args": {"name": request_id}})
            if event.startswith(self._START):
                name, phase = event[len(self._START):], "B"
            elif event.startswith(self._FINISH):
                name, phase = event[len(self._FINISH):], "E"
            else:
                name, phase = event, "i"
            entry = {"name": name, "ph": phase, "ts": round(ts, 3), "pid": _TRACE_PID, "tid": tids[request_id]}
            if phase == "i":
                entry["s"] = "t"  # an instant on the request's track
            trace.append(entry)
        return json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"})

    def save(self, path: str | os.PathLike) -> None:
        """Write :meth:`dump_json` to ``path`` (UTF-8)."""
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.dump_json())

