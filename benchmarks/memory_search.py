"""The search of the memory dimensions: how far each search lands from the exact optimum.

    python benchmarks/memory_search.py              # the table, into RESULTS.md
    python benchmarks/memory_search.py --no-write
    python benchmarks/search.py --memory-dimensions # the same

Small GPTs (1 and 2 blocks, each a recompute candidate) on 4 and 8 devices, planned under
auto_parallel with ``set_algo_parameters(memory_dimensions="search")`` (optimizer level,
recomputed blocks and 1, 2 or 4 micro-batches chosen with the cuts, simpar's cost model on
cpu-local, Adam, threshold 0) under three memory caps per configuration: none binding, and
the caps 1/3 and 2/3 of the way from the least memory any combination reaches (the least
cap under which dynamic programming finds a plan, by bisection) to what the plan of the cuts
alone needs. search_mode "exact" plans every combination with its ILP (every subset of the blocks),
so its choice is the proven optimum of the extended problem: the baseline, in the same
process, of dynamic_programming, recursive_programming and sharding_propagation. The gap is
the search's step objective over exact's, minus one.
"""

# ruff: noqa: E402, I001
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np

import simpar
from simpar import graph, nn
from simpar.cost.interface import SimparCostModel
from simpar.cost_model_context import reset_cost_model_context, set_cost_model_context
from simpar.search import plan_request, request_from_context
from simpar.search.pricing import NoAvailableCost

from _common import host_line, markdown_table, today, write_section

SCRIPT = "benchmarks/memory_search.py"
MODES = ("exact", "dynamic_programming", "recursive_programming", "sharding_propagation")
CONFIGS = ((1, 4), (2, 4), (1, 8), (2, 8))   # (blocks, devices)
MICRO = (1, 2, 4)
BATCH, SEQ, D_MODEL, HEADS, VOCAB = 16, 8, 16, 2, 64


def _request(blocks: int, devices: int, mode: str, capacity: float | None,
             dimensions: str = "search") -> Any:
    simpar.reset_auto_parallel_context()
    simpar.reset_algo_parameters()
    reset_cost_model_context()
    graphs, net = {}, None
    for m in MICRO:
        gpt = nn.GPT(VOCAB, SEQ, D_MODEL, blocks, HEADS, dtype=np.float32)
        for block in gpt.blocks:
            block.recompute()
        net = nn.WithLossCell(gpt, nn.SoftmaxCrossEntropyWithLogits())
        ids = ((BATCH // m, SEQ), np.dtype(np.int32))
        graphs[m] = graph.trace(net, [ids, ids], ["data", "label"])
    simpar.set_algo_parameters(memory_dimensions=dimensions)
    simpar.set_auto_parallel_context(parallel_optimizer_config={
        "parallel_optimizer_threshold": 0})
    if capacity is not None:
        set_cost_model_context(device_memory_capacity=float(capacity))
    return request_from_context(graphs[1], cell=net, device_num=devices, mode="auto_parallel",
                                search_mode=mode, cost_model=SimparCostModel("cpu-local", "adam"),
                                micro_graphs=graphs)


def _fits(blocks: int, devices: int, dimensions: str, cap: float) -> bool:
    try:
        plan_request(_request(blocks, devices, "dynamic_programming", cap, dimensions))
    except NoAvailableCost:
        return False
    return True


def _least(blocks: int, devices: int, dimensions: str) -> float:
    """The least cap under which dynamic programming finds a plan, within 1/64 of the
    least memory of the arrays alone (its "No available cost" under a one-byte cap): the
    plan must fit its largest transient too, a maximum that error does not bound."""
    try:
        plan_request(_request(blocks, devices, "dynamic_programming", 1.0, dimensions))
    except NoAvailableCost as e:
        assert e.memory is not None
        low = float(e.memory)
    else:
        raise AssertionError("a one-byte cap fitted")
    high = low * 1.5
    while not _fits(blocks, devices, dimensions, high):
        low, high = high, high * 1.5
    while high - low > low / 64:
        mid = (low + high) / 2
        low, high = (low, mid) if _fits(blocks, devices, dimensions, mid) else (mid, high)
    return high


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--no-write", action="store_true", help="print only")
    args = p.parse_args(argv)
    rows = []
    gaps: dict[str, list[float]] = {m: [] for m in MODES[1:]}
    missed: dict[str, int] = {m: 0 for m in MODES[1:]}   # no plan where exact has one
    for blocks, devices in CONFIGS:
        low, high = _least(blocks, devices, "search"), _least(blocks, devices, "fixed")
        for label, cap in (("none", None), ("2/3", low + (high - low) * 2 / 3),
                           ("1/3", low + (high - low) / 3)):
            best = None
            for mode in MODES:
                t = time.perf_counter()
                try:
                    found = plan_request(_request(blocks, devices, mode, cap)).dimensions
                    chosen = found.chosen
                    what, seconds = chosen.describe(), chosen.seconds
                except NoAvailableCost as e:
                    what, seconds = f"no plan: {str(e)[:60]}", None
                took = time.perf_counter() - t
                if mode == "exact":
                    best = seconds
                gap = "-"
                if mode != "exact" and seconds is None and best is not None:
                    missed[mode] += 1
                if mode != "exact" and seconds is not None and best is not None:
                    g = seconds / best - 1
                    gaps[mode].append(g)
                    gap = f"{100 * g:+.1f}%"
                rows.append([blocks, devices, label if cap is None else
                             f"{label} ({cap:.0f} B)", mode, what,
                             "-" if seconds is None else f"{seconds * 1e3:.3f}", gap,
                             f"{took:.1f}"])
                print(" | ".join(map(str, rows[-1])), flush=True)
    table = markdown_table(["blocks", "devices", "cap", "search", "chosen", "step objective ms",
                            "gap to exact", "planning s"], rows)
    summary = "; ".join(
        f"{mode}: reaches exact's optimum in {sum(g <= 1e-9 for g in v)} of "
        f"{len(v) + missed[mode]} cases, worst gap {100 * max(v):+.1f}%"
        + (f", no plan in {missed[mode]} where exact has one" if missed[mode] else "")
        for mode, v in gaps.items() if v)
    print(table)
    print(summary)
    if not args.no_write:
        write_section("the memory dimensions searched: each search against exact", "\n\n".join([
            f"`python {SCRIPT}` ({today()}; GPT vocab {VOCAB}, sequence {SEQ}, d_model "
            f"{D_MODEL}, {HEADS} heads, batch {BATCH}, float32; optimizer level, recomputed "
            f"blocks and {'/'.join(map(str, MICRO))} micro-batches searched with the cuts; "
            "cpu-local, Adam, threshold 0). Caps: none, and 2/3 and 1/3 of the way from the "
            "least memory any combination reaches to the least of the cuts alone. exact plans "
            "every combination with its ILP: the proven optimum.",
            table, summary, host_line()]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
