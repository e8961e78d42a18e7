"""Helpers shared by the benchmarks: an interleaved median timer and the RESULTS.md writer.

Nothing here imports MPI: the timer takes the barrier and the max-over-ranks reduction as
functions, so a benchmark decides which communicator they run on.
"""

from __future__ import annotations

import datetime
import fcntl
import os
import platform
import re
import statistics
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from time import perf_counter

import numpy as np

__all__ = ["RESULTS", "host_line", "interleaved_medians", "interleaved_times", "markdown_table",
           "median", "paired_ratio", "today", "write_section"]

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def interleaved_times(fns: Mapping[str, Callable[[], object]], reps: int, warmup: int,
                      barrier: Callable[[], None],
                      max_over_ranks: Callable[[np.ndarray], np.ndarray]
                      ) -> dict[str, np.ndarray]:
    """Seconds of every rep of each function, the functions interleaved rep by rep.

    Every rep runs each function once, after a barrier, and the starting function rotates from
    rep to rep, so drift (other load, frequency, cache state) hits every variant alike. A rep's
    time is the slowest rank's time for it: per-rank times are reduced with ``max_over_ranks``
    (one call at the end, outside every timed region). Called on every rank, it returns the
    same times everywhere: ``{name: array of reps}``, rep ``i`` of every name measured
    side by side.
    """
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            barrier()
            fns[name]()
    times = np.zeros((len(names), reps), dtype=np.float64)
    for rep in range(reps):
        shift = rep % len(names)
        for i in [*range(shift, len(names)), *range(shift)]:
            barrier()
            start = perf_counter()
            fns[names[i]]()
            times[i, rep] = perf_counter() - start
    slowest = max_over_ranks(times)
    return {name: slowest[i] for i, name in enumerate(names)}


def interleaved_medians(fns: Mapping[str, Callable[[], object]], reps: int, warmup: int,
                        barrier: Callable[[], None],
                        max_over_ranks: Callable[[np.ndarray], np.ndarray]) -> dict[str, float]:
    """Median seconds per call of each function (see :func:`interleaved_times`)."""
    times = interleaved_times(fns, reps, warmup, barrier, max_over_ranks)
    return {name: float(np.median(t)) for name, t in times.items()}


def paired_ratio(numerator: np.ndarray, denominator: np.ndarray) -> float:
    """Median over reps of the per-rep ratio: robust to load that changes between reps."""
    return float(np.median(numerator / denominator))


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table; floats keep the formatting the caller gave them (pass str)."""
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def today() -> str:
    return datetime.date.today().isoformat()


def host_line() -> str:
    """One line naming the machine and its load, for the notes under a table."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"host: {platform.machine()} {platform.system()}, {cores} usable cores, "
            f"load average at start {load}; Python {platform.python_version()}, "
            f"numpy {np.__version__}")


def publish(heading: str, body: str, write: bool) -> None:
    """Print ``body``, and (``write``) put it under ``## heading`` in RESULTS.md, saying so."""
    print(body)
    if write:
        write_section(heading, body)
        print(f"written to benchmarks/RESULTS.md (## {heading})")


def write_section(heading: str, body: str, subheading: str | None = None,
                  path: Path = RESULTS) -> None:
    """Put ``body`` under ``## heading`` (or under ``### subheading`` inside it) in RESULTS.md.

    An existing section or subsection of that name is replaced; anything else in the file is
    kept. A new one is appended at the end of the file (of the section). The file is replaced
    atomically, under a lock on its directory, so benchmarks that finish at the same time do
    not lose each other's sections and a crash never leaves a half-written file.
    """
    if not re.fullmatch(r"[^\n#]+", heading) or (subheading is not None
                                                 and not re.fullmatch(r"[^\n#]+", subheading)):
        raise ValueError(f"headings must be one line without '#', got {heading!r}, "
                         f"{subheading!r}")
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(directory, fcntl.LOCK_EX)
        text = path.read_text() if path.exists() else "# simpar benchmark results\n"
        block = body.strip("\n") + "\n"
        if subheading is None:
            new = _replace(text, 2, heading, block)
        else:
            section = _find(text, 2, heading)
            inner = text[section[0]:section[1]] if section else f"## {heading}\n\n"
            inner = _replace(inner, 3, subheading, block)
            new = (text[:section[0]] + inner + text[section[1]:] if section
                   else _append(text, inner))
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".RESULTS.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(new)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        os.close(directory)


def _find(text: str, level: int, title: str) -> tuple[int, int] | None:
    """(start, end) of the ``level``-heading ``title`` up to the next heading of that level or
    higher, or None."""
    marks = "#" * level
    start = re.search(rf"^{marks} {re.escape(title)}[ \t]*$", text, flags=re.M)
    if start is None:
        return None
    after = re.compile(rf"^#{{1,{level}}} ", flags=re.M).search(text, start.end())
    return start.start(), after.start() if after else len(text)


def _replace(text: str, level: int, title: str, block: str) -> str:
    piece = f"{'#' * level} {title}\n\n{block}\n"
    found = _find(text, level, title)
    if found is None:
        return _append(text, piece)
    return text[:found[0]] + piece + text[found[1]:]


def _append(text: str, piece: str) -> str:
    return text.rstrip("\n") + "\n\n" + piece
