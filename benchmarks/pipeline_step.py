"""A pipelined training step, simpar against a hand-written numpy + mpi4py 1F1B (issue 31).

    mpirun -n 8 python benchmarks/pipeline_step.py            # "## pipeline_step", "### 8 ranks"
                                                              # and "### 8 ranks, each schedule"
    mpirun -n 2 python benchmarks/pipeline_step.py            # "### 2 ranks": a core each
    mpirun -n 8 python benchmarks/pipeline_step.py --rounds 2 --steps 3 --no-write

An MLP of 8 equal Dense layers (width 1024, ReLU between, float32, MSE loss, SGD 0.05),
cut into equal stages, the global batch of 256 in 8 micro-batches, trained under 1F1B as:

* on 8 ranks: pp 8 (one rank and one layer per stage), and pp 4 x dp 2 (two ranks per stage
  in data parallel, two layers each);
* on 2 ranks: pp 2 (four layers per stage). This host has 2 cores: on 8 ranks the stages
  share them. simpar's receives then sleep while they wait (the MPI wait policy is "yield"
  there: :class:`~simpar.pipeline.runner.PipelineRunner`), so a stage in its bubble leaves
  the cores to the stages that compute; the hand-written 1F1B waits in MPI's ``Recv``, which
  yields but stays runnable. On 2 ranks each stage has a core, as the schedule's bubble
  assumes, and both wait in MPI.

(a) hand-written: each rank runs its stage's layers in numpy (one BLAS thread, simpar's
wait policy: the same process), receives its input with ``Recv`` and sends its output with
``Isend`` in 1F1B's order, sums its gradients over the micro-batches, AllReduces them over its
stage's data-parallel ranks once per step, and takes the SGD step; (b) simpar:
``nn.MLP`` with ``pipeline_stage`` on its layers, ``PipelineCell(M)``, ``TrainOneStepCell``
in ``data_parallel`` with ``pipeline_stages=S``. Both start from the same weights and train
on the same batches; their first 3 losses must agree within a relative 1e-4 before timing.

Each round runs both for ``--steps`` steps (the order alternating by round), each step after
a barrier; a step's time is the slowest rank's. The bubble: each rank's share of its step
(from its start to its last task's end) spent blocked in receives, averaged over the ranks,
against the schedule's (S - 1) / (M + S - 1).

A second table ("### 8 ranks, each schedule", "### 2 ranks, each schedule") measures simpar's
bubble under every schedule it runs, on equal stages of the same MLP, a global batch of 1024
in 8 micro-batches. On 2 ranks, pp 2 (8 layers) under GPipe, 1F1B and the interleaved 1F1B
with two chunks per stage: each stage has a core, as the formulas assume. On 8 ranks, GPipe
and 1F1B on pp 8 (8 layers) and pp 4 x dp 2 (8 layers), and the interleaved 1F1B with two
chunks per stage on pp 8 (16 layers, one per virtual stage) and pp 4 x dp 2 (8 layers),
against the schedule's
(S - 1) / (M + S - 1), and (S - 1) / (V M + S - 1) with V chunks. The first 3 losses of each
must agree with the hand-written 1F1B's on the same layers within a relative 1e-4. There the
8 stages share 2 cores: a stage that waits leaves its core to the others, which then run
faster than on a core each, so the share of a step spent waiting is not the formula's.
"""

# ruff: noqa: E402, I001  (simpar first: simpar/_env.py must run before numpy's BLAS and MPI)
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import simpar
import simpar.comm as comm

import numpy as np
from _common import host_line, markdown_table, today, write_section

from simpar import nn
from simpar.pipeline import bubble_fraction, schedule

SCRIPT = "benchmarks/pipeline_step.py"
WIDTH, BATCH, LR = 1024, 256, 0.05
#: The global batch of the table of each schedule: tasks 4x longer than the first table's, so
#: that a message's hop (a few ms on 8 ranks over 2 cores, where a waiting receive polls)
#: stays small beside them, as the formulas assume.
SCHEDULE_BATCH = 1024


def weights(layers: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    out = {}
    for k in range(layers):
        out[f"fc{k + 1}.weight"] = (rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)
                                    ).astype(np.float32)
        out[f"fc{k + 1}.bias"] = np.zeros(WIDTH, np.float32)
    return out


def batch(k: int, rows: int = BATCH) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 + k)
    return (rng.standard_normal((rows, WIDTH)).astype(np.float32),
            rng.standard_normal((rows, WIDTH)).astype(np.float32))


class HandPipeline:
    """One rank's stage of the MLP under 1F1B, in numpy and mpi4py."""

    def __init__(self, stages: int, micro: int, layers: int, rows: int = BATCH) -> None:
        world = comm.world()
        self.global_batch = rows
        self.rank, self.size = world.Get_rank(), world.Get_size()
        self.n = self.size // stages
        self.stage, self.local = divmod(self.rank, self.n)
        self.stages, self.micro = stages, micro
        per = layers // stages
        self.mine = list(range(self.stage * per, (self.stage + 1) * per))
        self.last_layer = layers - 1
        self.dp = world.Split(self.stage, self.local)
        self.tasks = schedule("1f1b", self.stage, stages, micro)
        self.w: dict[int, np.ndarray] = {}
        self.b: dict[int, np.ndarray] = {}
        self.busy = self.span = self.waiting = 0.0

    def load(self, w: dict[str, np.ndarray]) -> None:
        for k in self.mine:
            self.w[k] = w[f"fc{k + 1}.weight"].copy()
            self.b[k] = w[f"fc{k + 1}.bias"].copy()

    def _rows(self, x: np.ndarray, k: int) -> np.ndarray:
        m = x.shape[0] // self.micro
        part = m // self.n
        lo = k * m + self.local * part
        return x[lo:lo + part]

    def step(self, x: np.ndarray, y: np.ndarray) -> float:
        from mpi4py import MPI
        world = comm.world()
        rows = self.global_batch // self.micro // self.n
        acts: dict[int, list[np.ndarray]] = {}
        gw = {k: np.zeros_like(self.w[k]) for k in self.mine}
        gb = {k: np.zeros_like(self.b[k]) for k in self.mine}
        sends: list[Any] = []
        loss = 0.0
        self.waiting = 0.0
        start = time.perf_counter()
        for kind, _, k in self.tasks:
            if kind == "F":
                if self.stage == 0:
                    h = self._rows(x, k)
                else:
                    h = np.empty((rows, WIDTH), np.float32)
                    t0 = time.perf_counter()
                    world.Recv(h, source=self.rank - self.n, tag=k)
                    self.waiting += time.perf_counter() - t0
                saved = [h]
                for layer in self.mine:
                    h = h @ self.w[layer].T + self.b[layer]
                    if layer != self.last_layer:
                        np.maximum(h, 0, out=h)
                    saved.append(h)
                acts[k] = saved
                if self.stage < self.stages - 1:
                    sends.append(world.Isend(h, dest=self.rank + self.n, tag=k))
                continue
            if self.stage == self.stages - 1:
                d = acts[k][-1] - self._rows(y, k)
                loss += float(np.vdot(d, d))
                g = d * (2.0 / (self.global_batch * WIDTH))   # the global batch's mean
            else:
                g = np.empty((rows, WIDTH), np.float32)
                t0 = time.perf_counter()
                world.Recv(g, source=self.rank + self.n, tag=10000 + k)
                self.waiting += time.perf_counter() - t0
            saved = acts.pop(k)
            for j in reversed(range(len(self.mine))):
                layer = self.mine[j]
                out, inp = saved[j + 1], saved[j]
                if layer != self.last_layer:
                    g = g * (out > 0)
                gw[layer] += g.T @ inp
                gb[layer] += g.sum(0)
                g = g @ self.w[layer]
            if self.stage > 0:
                sends.append(world.Isend(np.ascontiguousarray(g), dest=self.rank - self.n,
                                         tag=10000 + k))
        self.span = time.perf_counter() - start
        self.busy = self.span - self.waiting
        for layer in self.mine:   # the gradient sum over the stage's data-parallel ranks
            if self.n > 1:
                self.dp.Allreduce(MPI.IN_PLACE, gw[layer])
                self.dp.Allreduce(MPI.IN_PLACE, gb[layer])
            self.w[layer] -= LR * gw[layer]
            self.b[layer] -= LR * gb[layer]
        MPI.Request.Waitall(sends)
        total = np.array([loss])
        world.Allreduce(MPI.IN_PLACE, total)
        return float(total[0]) / (self.global_batch * WIDTH)


def simpar_pipeline(stages: int, micro: int, layers: int, scheduler: str = "1f1b",
                    chunks: int = 1, rows: int = BATCH) -> nn.TrainOneStepCell:
    simpar.reset_auto_parallel_context()
    simpar.set_auto_parallel_context(parallel_mode="data_parallel", gradients_mean=True,
                                     pipeline_stages=stages, pipeline_config={
                                         "pipeline_scheduler": scheduler,
                                         "pipeline_interleave": chunks > 1})
    mlp = nn.MLP(WIDTH, WIDTH, WIDTH, n_hidden=layers - 1, dtype=np.float32)
    for k, layer in enumerate(mlp.layers):   # equal virtual stages, chunk by chunk
        virtual = k * stages * chunks // layers
        layer.pipeline_stage = virtual % stages
        if chunks > 1:
            layer.pipeline_segment = virtual // stages
    cell = nn.WithLossCell(mlp, nn.MSELoss())
    params = cell.trainable_params()
    train = nn.TrainOneStepCell(nn.PipelineCell(cell, micro), nn.SGD(params, LR), seed=0)
    train.build(*batch(0, rows))
    simpar.reset_auto_parallel_context()
    return train


def load(train: nn.TrainOneStepCell, w: dict[str, np.ndarray]) -> None:
    runner = train.pipeline
    assert runner is not None
    for name, (prog, _) in runner.params().items():
        block = tuple(slice(lo, hi) for lo, hi in
                      prog.storage_layout(name).slice_of(runner.local))
        train.params[name][...] = w[name.removeprefix("_backbone.")][block]


def slowest(seconds: float) -> float:
    return float(comm.all_reduce(np.array([seconds]), op="max")[0])


def mean(x: float) -> float:
    return float(comm.all_reduce(np.array([x]))[0]) / comm.get_group_size()


def agreeing(stages: int, micro: int, layers: int, scheduler: str = "1f1b", chunks: int = 1,
             rows: int = BATCH) -> tuple[HandPipeline, nn.TrainOneStepCell, float]:
    """The hand-written 1F1B and simpar under ``scheduler`` (``chunks`` per stage) from the
    same weights, after 3 steps whose losses agree within a relative 1e-4 (else exit), and
    that relative error."""
    w = weights(layers)
    hand = HandPipeline(stages, micro, layers, rows)
    hand.load(w)
    ours = simpar_pipeline(stages, micro, layers, scheduler, chunks, rows)
    load(ours, w)
    first = [hand.step(*batch(k, rows)) for k in range(3)]
    mine = [ours(*batch(k, rows)) for k in range(3)]
    err = max(abs(a - b) / abs(a) for a, b in zip(first, mine))
    if err > 1e-4:
        raise SystemExit(f"{SCRIPT}: simpar's losses under {scheduler} ({chunks} chunks) "
                         f"{mine} differ from the hand-written 1F1B's {first} by {err:.1e}")
    return hand, ours, err


def run(stages: int, micro: int, layers: int, rounds: int, steps: int
        ) -> dict[str, Any]:
    hand, ours, err = agreeing(stages, micro, layers)
    runner = ours.pipeline
    assert runner is not None
    fns: dict[str, Callable[[int], float]] = {"hand": lambda k: hand.step(*batch(k)),
                                               "simpar": lambda k: ours(*batch(k))}
    bubbles: dict[str, list[float]] = {"hand": [], "simpar": []}
    times: dict[str, list[float]] = {"hand": [], "simpar": []}
    ratios = []
    for r in range(rounds):
        medians = {}
        for name in (["hand", "simpar"] if r % 2 == 0 else ["simpar", "hand"]):
            got = []
            for k in range(steps):
                comm.barrier()
                t0 = time.perf_counter()
                fns[name](k)
                got.append(slowest(time.perf_counter() - t0))
                busy, span = (hand.busy, hand.span) if name == "hand" else (
                    runner.busy, runner.span)
                bubbles[name].append(mean(1.0 - busy / span))
            times[name] += got
            medians[name] = float(np.median(got))
        ratios.append(medians["simpar"] / medians["hand"])
    return {"times": times, "bubbles": bubbles, "ratios": ratios,
            "theory": bubble_fraction(stages, micro), "error": err}


def run_schedule(stages: int, micro: int, layers: int, scheduler: str, chunks: int,
                 rounds: int, steps: int) -> dict[str, Any]:
    """simpar alone under ``scheduler`` (``chunks`` per stage), its first losses checked
    against the hand-written 1F1B's on the same layers: its step times and bubbles."""
    _, ours, err = agreeing(stages, micro, layers, scheduler, chunks, SCHEDULE_BATCH)
    runner = ours.pipeline
    assert runner is not None
    times, bubbles = [], []
    for _ in range(rounds):
        for k in range(steps):
            comm.barrier()
            t0 = time.perf_counter()
            ours(*batch(k, SCHEDULE_BATCH))
            times.append(slowest(time.perf_counter() - t0))
            bubbles.append(mean(1.0 - runner.busy / runner.span))
    return {"times": times, "bubbles": bubbles, "error": err,
            "theory": bubble_fraction(stages, micro, chunks)}


#: Per rank count, each schedule: (layout, stages, layers, scheduler, chunks).
SCHEDULES = {8: (("pp 8", 8, 8, "gpipe", 1), ("pp 8", 8, 8, "1f1b", 1),
                 ("pp 8", 8, 16, "1f1b", 2), ("pp 4 x dp 2", 4, 8, "gpipe", 1),
                 ("pp 4 x dp 2", 4, 8, "1f1b", 1), ("pp 4 x dp 2", 4, 8, "1f1b", 2)),
             2: (("pp 2", 2, 8, "gpipe", 1), ("pp 2", 2, 8, "1f1b", 1),
                 ("pp 2", 2, 8, "1f1b", 2))}


def each_schedule(args: argparse.Namespace) -> None:
    """The second table: simpar's bubble under each schedule."""
    rank, n, micro = comm.get_rank(), comm.get_group_size(), 8
    rows, within = [], 0
    for label, stages, layers, scheduler, chunks in SCHEDULES[n]:
        got = run_schedule(stages, micro, layers, scheduler, chunks, args.rounds, args.steps)
        name = scheduler if chunks == 1 else f"interleaved {scheduler}, {chunks} chunks"
        ms = float(np.median(got["times"])) * 1e3
        bub, theory = float(np.median(got["bubbles"])), got["theory"]
        rows.append([label, name, str(layers), str(micro), f"{ms:.1f}", f"{bub:.1%}",
                     f"{theory:.1%}", f"{bub / theory - 1:+.0%}"])
        within += abs(bub / theory - 1) <= 0.10
        if rank == 0:
            print(f"{label}, {name}: {ms:.1f} ms, bubble {bub:.1%} against the schedule's "
                  f"{theory:.1%}; first losses agree within {got['error']:.1e}", flush=True)
    if rank == 0:
        table = markdown_table(["layout", "schedule", "layers", "micro-batches", "simpar ms",
                                "bubble simpar", "schedule's bubble", "simpar vs schedule"],
                               rows)
        body = "\n\n".join([
            f"`{command()}` ({today()}; {args.rounds} rounds of {args.steps} "
            "steps, the slowest rank's median step; bubble as above; the schedule's: (S - 1) "
            "/ (M + S - 1), interleaved (S - 1) / (V M + S - 1); target: within 10%)",
            table, f"Within 10% of the schedule's bubble: {within} of {len(rows)} rows."
            + (" On 8 ranks the stages share 2 cores: a stage that waits leaves its core to "
               "the others, so the share of a step spent waiting is not the formula's, which "
               "gives each stage a core." if n > 2 else ""), host_line()])
        print(body)
        if not args.no_write:
            write_section("pipeline_step", body, f"{n} ranks, each schedule")
            print(f"written to benchmarks/RESULTS.md (## pipeline_step, "
                  f"### {n} ranks, each schedule)")


def command() -> str:
    """The command that made a table: this one's arguments but ``--no-write``."""
    rest = [a for a in sys.argv[1:] if a != "--no-write"]
    return " ".join(["mpirun", "-n", str(comm.get_group_size()), "python", SCRIPT, *rest])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--schedules-only", action="store_true",
                   help="only the table of each schedule's bubble")
    args = p.parse_args()
    n, rank = comm.get_group_size(), comm.get_rank()
    layouts = {8: (("pp 8", 8, 8), ("pp 4 x dp 2", 4, 8)), 2: (("pp 2", 2, 8),)}
    if n not in layouts:
        raise SystemExit(f"{SCRIPT}: run it on 8 or 2 ranks (mpirun -n 8, -n 2), not {n}")
    rows = []
    for label, stages, layers in () if args.schedules_only else layouts[n]:
        micro = 8
        got = run(stages, micro, layers, args.rounds, args.steps)
        hand, ours = (np.median(got["times"][k]) * 1e3 for k in ("hand", "simpar"))
        ratio = float(np.median(got["ratios"]))
        bub = {k: float(np.median(v)) for k, v in got["bubbles"].items()}
        theory = got["theory"]
        rows.append([label, str(micro), f"{hand:.1f}", f"{ours:.1f}",
                     f"{ratio:.2f} ({min(got['ratios']):.2f}-{max(got['ratios']):.2f})",
                     f"{bub['hand']:.1%}", f"{bub['simpar']:.1%}", f"{theory:.1%}",
                     f"{bub['simpar'] / theory - 1:+.0%}"])
        if rank == 0:
            print(f"{label}: hand {hand:.1f} ms, simpar {ours:.1f} ms, ratio {ratio:.2f}; "
                  f"bubble hand {bub['hand']:.1%}, simpar {bub['simpar']:.1%}, schedule "
                  f"{theory:.1%}; first losses agree within {got['error']:.1e}", flush=True)
    if rank == 0 and rows:
        table = markdown_table(["layout", "micro-batches", "hand ms", "simpar ms",
                                "simpar / hand (rounds)", "bubble hand", "bubble simpar",
                                "(S-1)/(M+S-1)", "simpar vs schedule"], rows)
        body = "\n\n".join([
            f"`{command()}` ({today()}; {args.rounds} rounds of "
            f"{args.steps} steps, the slowest rank's median step; bubble: each rank's share "
            "of its step blocked in receives, averaged over the ranks; "
            "targets: simpar within 1.15x of the hand-written 1F1B, its bubble within 10% "
            "of the schedule's)", table, host_line()])
        print(body)
        if not args.no_write:
            write_section("pipeline_step", body, f"{n} ranks")
            print(f"written to benchmarks/RESULTS.md (## pipeline_step, ### {n} ranks)")
    each_schedule(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
