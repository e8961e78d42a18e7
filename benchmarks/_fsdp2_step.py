"""PyTorch FSDP2, the peer of step_memory.py's ZeRO-3 (optimizer parallel level3) step, on CPU.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 8 benchmarks/_fsdp2_step.py
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 8 benchmarks/_fsdp2_step.py \\
        --no-write --rounds 1 --steps 3

It needs torch (2.13) and numpy, not simpar, in its Python: run it from a venv of its own, since
simpar's test venv has no torch. The model is step_memory.py's Part 1 MLP, ``Linear(256,
1024), ReLU, Linear(1024, 1024), ReLU, Linear(1024, 256)`` (``simpar.nn.MLP(256, 1024, 256,
n_hidden=2)``), float32, torch's seeded default init, ``fully_shard`` (ZeRO-3:
``reshard_after_forward=True``) on each Linear and on the root, over gloo on a 1-D mesh of every
rank. It trains with ``torch.optim.Adam`` (lr 1e-3) on softmax cross entropy, the mean over a
global batch of 64 (8 rows per rank on 8 ranks: each rank's mean, averaged by FSDP2's
reduce-scatter), and every step all-reduces its loss, as step_memory.py's steps do. The batches
are drawn with numpy (a seeded linear teacher, like ``simpar.dataset.random_classification``
but not its values): simpar is not imported.

Before timing, FSDP2's first losses must agree within a relative 1e-4 with those of an unsharded
copy of the model trained by one process on the global batch, or the run stops. Timing:
``--rounds`` rounds of ``_common.interleaved_times`` (1 untimed step, then ``--steps`` steps,
each after a barrier, the slowest rank's time). Only rank 0 prints and writes RESULTS.md, in a
subsection of step_memory.py's section, next to its simpar level3 and hand-written ZeRO-3 rows
(those were timed by another job: the comparison is across jobs).
"""

# ruff: noqa: E402  (the thread count must be in the environment before torch starts)
from __future__ import annotations

import argparse
import gc
import itertools
import os
import re
import shlex
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import torch
import torch.distributed as dist
from _common import RESULTS, host_line, interleaved_times, markdown_table, today, write_section
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.debug import CommDebugMode

SCRIPT = "benchmarks/_fsdp2_step.py"
SEED = 0
IN, HIDDEN, OUT, N_HIDDEN, BATCH = 256, 1024, 256, 2, 64
LR, BETA1, BETA2, EPS = 1e-3, 0.9, 0.999, 1e-8     # step_memory.py's Adam
N_BATCHES = 4                                     # step k trains on batch k % N_BATCHES
CHECK_STEPS, LOSS_RTOL = 3, 1e-4
VARIANT = "(c) PyTorch FSDP2, fully_shard per Linear and root"
#: step_memory.py's section and the rows of its table this one is set against.
SECTION = "step time of the memory dimensions (issue 30)"
HAND, LEVEL3 = "(a) numpy + mpi4py ZeRO-3, by hand", "(b) simpar level3"

Batch = tuple[torch.Tensor, torch.Tensor]


def mlp() -> nn.Sequential:
    """``simpar.nn.MLP(IN, HIDDEN, OUT, n_hidden=N_HIDDEN)``: fc1 256 -> 1024, fc2 1024 -> 1024,
    fc3 1024 -> 256, ReLU after all but the last; the same weights on every rank."""
    torch.manual_seed(SEED)
    sizes = [IN] + [HIDDEN] * N_HIDDEN + [OUT]
    layers: list[nn.Module] = []
    for k, (fan_in, fan_out) in enumerate(zip(sizes, sizes[1:])):
        layers.append(nn.Linear(fan_in, fan_out))
        if k < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def global_batch(k: int) -> Batch:
    """Batch ``k`` of the global 64 rows, the same in every process: labels are the argmax of a
    fixed random linear teacher."""
    teacher = np.random.default_rng([SEED, 10**6]).standard_normal((IN, OUT))
    x = np.random.default_rng([SEED, k]).standard_normal((BATCH, IN))
    y = np.argmax(x @ teacher, axis=1)
    return torch.from_numpy(x.astype(np.float32)), torch.from_numpy(y)


def _adam(params: object) -> torch.optim.Adam:
    return torch.optim.Adam(params, lr=LR, betas=(BETA1, BETA2), eps=EPS)  # type: ignore[arg-type]


def reference_losses() -> list[float]:
    """The first CHECK_STEPS losses of the unsharded model, one process, on the global batch."""
    model = mlp()
    opt = _adam(model.parameters())
    losses = []
    for k in range(CHECK_STEPS):
        x, y = global_batch(k % N_BATCHES)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def fsdp2_step() -> Callable[[int], float]:
    """This rank's FSDP2 training step on batch ``k % N_BATCHES``; it returns the global loss."""
    rank, size = dist.get_rank(), dist.get_world_size()
    if BATCH % size:
        raise SystemExit(f"_fsdp2_step: the batch of {BATCH} rows does not split over {size} "
                         "ranks; run it on a rank count that divides it")
    mesh = init_device_mesh("cpu", (size,))
    model = mlp()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    opt = _adam(model.parameters())
    rows = BATCH // size
    local = [(x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows])
             for x, y in map(global_batch, range(N_BATCHES))]

    def step(k: int) -> float:
        x, y = local[k % N_BATCHES]
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        return float(total) / size

    return step


def _checked(losses: list[float], reference: list[float]) -> float:
    """The largest relative difference; stops the run (on every rank alike) beyond LOSS_RTOL."""
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
    if worst > LOSS_RTOL:
        raise SystemExit(f"_fsdp2_step: FSDP2's losses {losses} differ from the unsharded "
                         f"model's {reference} by a relative {worst:.1e} > {LOSS_RTOL}")
    return worst


def _collectives(step: Callable[[int], float], k: int) -> str:
    """``_allgather_base_ x6, ...``: the collectives of one step, as CommDebugMode counts them."""
    with warnings.catch_warnings(), CommDebugMode() as debug:
        # Its module tracker hooks the backward; torch warns that the input needs no gradient.
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        step(k)
    counts = {str(op).rsplit(".", 1)[-1]: n for op, n in debug.get_comm_counts().items()}
    return ", ".join(f"{op} x{n}" for op, n in sorted(counts.items())) or "none"


def _step_memory_row(name: str) -> str | None:
    """The median ms of row ``name`` of step_memory.py's table in RESULTS.md, if it is there."""
    text = RESULTS.read_text() if RESULTS.exists() else ""
    section = re.search(rf"^## {re.escape(SECTION)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    row = section and re.search(rf"^\| {re.escape(name)} \| ([0-9.]+) \|", section.group(1),
                                re.M)
    return row.group(1) if row else None


def _comparison(median_ms: float) -> str:
    found = {name: _step_memory_row(name) for name in (HAND, LEVEL3)}
    if None in found.values():
        return f"step_memory.py's table has no rows {HAND!r} and {LEVEL3!r} to compare with."
    hand, level3 = (float(found[name] or "nan") for name in (HAND, LEVEL3))
    return (f"Against the table above ({SECTION}): simpar level3 {level3:.1f} ms, the "
            f"hand-written numpy + mpi4py ZeRO-3 {hand:.1f} ms; FSDP2 / simpar level3 = "
            f"{median_ms / level3:.2f}, FSDP2 / hand-written = {median_ms / hand:.2f}. Those "
            "rows were timed by a different job (mpirun, 8 MPI processes) at a different "
            "time, not in this job's processes, so the ratios carry the drift of the machine's "
            "load between the two runs.")


def measure(rounds: int, steps: int) -> tuple[list[np.ndarray], str, float]:
    """Per round, the step seconds (the slowest rank's); one step's collectives; the largest
    relative loss difference from the unsharded model."""
    step = fsdp2_step()
    worst = _checked([step(k) for k in range(CHECK_STEPS)], reference_losses())
    calls = _collectives(step, CHECK_STEPS)
    counter = itertools.count(CHECK_STEPS + 1)

    def slowest(a: np.ndarray) -> np.ndarray:
        t = torch.from_numpy(a.copy())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.numpy()

    return [interleaved_times({VARIANT: lambda: step(next(counter))}, steps, 1, dist.barrier,
                              slowest)[VARIANT] for _ in range(rounds)], calls, worst


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20, help="timed steps per round (default 20)")
    p.add_argument("--rounds", type=int, default=8, help="rounds (default 8)")
    p.add_argument("--no-write", action="store_true", help="print only")
    args = p.parse_args()
    if args.steps < 1 or args.rounds < 1:
        p.error(f"--steps and --rounds must be >= 1, got {args.steps} and {args.rounds}")
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    # The root's output, fc3's, reaches FSDP2's root hook as a view; the warning is about
    # in-place ops on it, and the loss makes none.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPSequential\) "
                            "returned a view tensor")
    load = host_line()
    dist.init_process_group("gloo")
    try:
        rank, size, backend = dist.get_rank(), dist.get_world_size(), dist.get_backend()
        rounds, calls, worst = measure(args.rounds, args.steps)
        # FSDP2's modules and gloo's work objects must be gone before the group: left to the
        # interpreter's exit, they abort a rank now and then ("terminate called without an
        # active exception").
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return 0
    medians = [np.median(t) * 1e3 for t in rounds]
    median_ms = float(np.median(np.concatenate(rounds))) * 1e3
    table = markdown_table(["variant", "median ms", "round medians ms", "collectives per step"],
                           [[VARIANT, f"{median_ms:.1f}",
                             f"{min(medians):.1f}–{max(medians):.1f}", calls]])
    command = shlex.join(["torchrun", "--standalone", "--nproc-per-node", str(size), SCRIPT,
                          *sys.argv[1:]])
    body = "\n\n".join([
        f"Command: `OMP_NUM_THREADS=1 {command}` (a Python with torch 2.13, not simpar's "
        f"venv) · date: {today()}. "
        f"{args.rounds} rounds of {args.steps} steps (after 1 untimed step each), each after "
        "a barrier, the slowest rank's time.",
        f"The MLP above ({IN} -> {HIDDEN} -> {HIDDEN} -> {OUT}, ReLU, float32, softmax cross "
        f"entropy, Adam lr {LR}, batch {BATCH} on {size} ranks), as "
        "`torch.distributed.fsdp.fully_shard` on each Linear and on the root, "
        f"reshard_after_forward=True (ZeRO-3), {backend} on CPU; torch's seeded default init "
        "and numpy batches, so the losses are not simpar's.", table,
        _comparison(median_ms),
        f"Correctness: FSDP2's first {CHECK_STEPS} losses agree with those of the unsharded "
        f"model trained by one process on the global batch within {worst:.1e} (relative); the "
        f"run stops beyond {LOSS_RTOL}. Collectives: one step counted by CommDebugMode "
        "(c10d op names; each all-gathers or reduce-scatters a Linear's weight and bias as one "
        "flat buffer; the all-reduce is the step's loss).",
        f"{load}; torch {torch.__version__}, {torch.get_num_threads()} intra-op and "
        f"{torch.get_num_interop_threads()} inter-op thread per rank."])
    print(body)
    if not args.no_write:
        write_section(SECTION, body, subheading="PyTorch FSDP2 peer")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
