"""The main job's timeline in Chrome's trace-event format (``--trace FILE``), as PyTorch's
profiler writes it: open it in Perfetto (ui.perfetto.dev) or ``chrome://tracing``.

One process per rank (``pid`` = the rank), with three threads: ``steps`` (each training step,
and the barrier that lines the ranks up before it, a wait), ``collectives`` (every collective
the rank ran, from simpar.comm's trace: kind, group, bytes, what ran it; a collective's time
includes waiting for the slowest member of its group) and ``kernels`` (the time between
collectives inside a step: the local kernels the program ran there). One more process,
``predicted``, holds the cost model's timeline of the step, laid from the start of each
measured step of rank 0, so a reader sees where the run and the prediction part: the slowest
rank's steps one thread per kind (:func:`simpar.cost.model.predicted_timeline`), or, for a
pipelined run, every stage's forward and backward tasks one thread per stage.

Times are microseconds from the first step's start on each rank, which starts right after a
barrier, so the ranks' clocks line up to within that barrier's skew.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from simpar import comm
from simpar.comm import CommEvent

__all__ = ["Placed", "pipelined", "predicted_events", "rank_events", "sequential",
           "write_trace"]

_STEPS, _COLLECTIVES, _KERNELS = 0, 1, 2
_THREADS = {_STEPS: "steps", _COLLECTIVES: "collectives", _KERNELS: "kernels"}


def _meta(pid: int, name: str, threads: Mapping[int, str]) -> list[dict[str, Any]]:
    out = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "ts": 0,
            "args": {"name": name}},
           {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "ts": 0,
            "args": {"sort_index": pid}}]
    out += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "ts": 0,
             "args": {"name": tname}} for tid, tname in threads.items()]
    return out


def _span(name: str, cat: str, pid: int, tid: int, start: float, seconds: float,
          args: Mapping[str, Any] | None = None) -> dict[str, Any]:
    event: dict[str, Any] = {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid,
                             "ts": round(start * 1e6, 3), "dur": round(max(seconds, 0) * 1e6, 3)}
    if args:
        event["args"] = dict(args)
    return event


def rank_events(rank: int, steps: Sequence[tuple[int, float, float, float]],
                events: Sequence[CommEvent]) -> list[dict[str, Any]]:
    """This rank's trace events: ``steps`` are ``(number, barrier start, step start, step
    end)`` in ``time.perf_counter()`` seconds, ``events`` the collectives traced meanwhile."""
    if not steps:
        return _meta(rank, f"rank {rank}", _THREADS)
    origin = steps[0][2]
    out = _meta(rank, f"rank {rank}", _THREADS)
    ordered = sorted(events, key=lambda e: e.finished)
    for number, barrier, start, end in steps:
        out.append(_span("barrier before the step", "wait", rank, _STEPS, barrier - origin,
                         start - barrier))
        out.append(_span(f"step {number}", "step", rank, _STEPS, start - origin, end - start))
        inside = [e for e in ordered if start <= e.finished <= end]
        at = start
        for e in inside:
            began = e.finished - e.seconds
            if began > at:
                out.append(_span("kernels", "compute", rank, _KERNELS, at - origin, began - at,
                                 {"before": e.label}))
            out.append(_span(e.kind, "collective", rank, _COLLECTIVES, began - origin,
                             e.seconds, {"group": list(e.group), "bytes_sent": e.bytes_sent,
                                         "bytes_recv": e.bytes_recv, "label": e.label,
                                         "program_step": e.step}))
            at = max(at, e.finished)
        if end > at:
            out.append(_span("kernels", "compute", rank, _KERNELS, at - origin, end - at,
                             {"before": "the step's end (the optimizer's update too)"}))
    return out


#: A predicted event: (thread, name, category, start, seconds), start from the step's start.
Placed = tuple[str, str, str, float, float]


def sequential(timeline: Sequence[tuple[str, str, float]]) -> list[Placed]:
    """A one-rank timeline (:func:`simpar.cost.model.predicted_timeline`: name, kind,
    seconds) laid end to end, one thread per kind of step."""
    out, at = [], 0.0
    for name, kind, seconds in timeline:
        out.append((kind, name, kind, at, seconds))
        at += seconds
    return out


def pipelined(tasks: Sequence[tuple[int, str, int, int, float, float]], chunks: int
              ) -> list[Placed]:
    """A pipelined step's predicted tasks (:attr:`simpar.pipeline.PipelineCost.tasks`), one
    thread per stage: ``F3`` the forward of micro-batch 3 (of chunk c when interleaved)."""
    return [(f"stage {stage}", f"{kind}{micro}" + (f" chunk {chunk}" if chunks > 1 else ""),
             "forward" if kind == "F" else "backward", start, end - start)
            for stage, kind, chunk, micro, start, end in tasks]


def predicted_events(pid: int, starts: Sequence[float], placed: Sequence[Placed],
                     title: str) -> list[dict[str, Any]]:
    """The ``placed`` predicted events of one step, from each of ``starts`` (seconds from the
    origin), in a process named ``title``."""
    threads = list(dict.fromkeys(thread for thread, *_ in placed))
    tids = {thread: k for k, thread in enumerate(threads)}
    out = _meta(pid, title, {tid: thread for thread, tid in tids.items()})
    for start in starts:
        for thread, name, cat, at, seconds in placed:
            out.append(_span(name, cat, pid, tids[thread], start + at, seconds))
    return out


def _gather_json(events: list[dict[str, Any]]) -> list[list[dict[str, Any]]] | None:
    """Every rank's events, on rank 0 (None elsewhere): each rank's JSON text, its length
    first, packed four bytes to an int32 and gathered."""
    if comm.get_group_size() == 1:
        return [events]
    raw = json.dumps(events).encode()
    longest = int(comm.all_reduce(np.array([len(raw)], dtype=np.int64), op="max")[0])
    words = -(-longest // 4)
    buf = np.zeros(1 + words, dtype=np.int32)
    buf[0] = len(raw)
    buf[1:].view(np.uint8)[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    every = comm.all_gather(buf[None, :]).reshape(comm.get_group_size(), -1)
    if comm.get_rank() != 0:
        return None
    return [json.loads(row[1:].view(np.uint8)[:int(row[0])].tobytes().decode())
            for row in every]


def write_trace(path: str, steps: Sequence[tuple[int, float, float, float]],
                events: Sequence[CommEvent], predicted: tuple[Sequence[Placed], str] | None
                ) -> None:
    """Every rank's timeline (collective: every rank calls) and, if given, ``predicted``
    (``(placed events of one step, the process's title)``: :func:`sequential`,
    :func:`pipelined`) into one trace-event file at ``path``, written by rank 0 (to a
    temporary name first, then renamed: never half a file)."""
    rank = comm.get_rank()
    gathered = _gather_json(rank_events(rank, steps, events))
    if gathered is None:
        return
    trace = [e for per_rank in gathered for e in per_rank]
    if predicted is not None and steps:
        placed, title = predicted
        origin = steps[0][2]
        trace += predicted_events(len(gathered), [start - origin for _, _, start, _ in steps],
                                  placed, title)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"traceEvents": trace, "displayTimeUnit": "ms",
                   "otherData": {"producer": "simpar --trace", "ranks": len(gathered)}}, f)
    os.replace(tmp, path)
