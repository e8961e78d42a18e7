"""Step time of simpar's memory dimensions: optimizer parallel and recomputation (issue 30).

    mpirun -n 8 python benchmarks/step_memory.py             # the tables, into RESULTS.md
    mpirun -n 8 python benchmarks/step_memory.py --no-write --steps 2 --rounds 1

Part 1, ZeRO-3: ``nn.MLP(256, 1024, 256, n_hidden=2)`` (ReLU), float32, softmax cross entropy
on ``random_classification`` batches, Adam (lr 1e-3), batch 64, data parallel on every rank:

* (a) hand-written numpy + mpi4py ZeRO-3: rank r stores rows ``[r * out / n, ...)`` of every
  weight and bias (simpar's slice layout), Allgathers each into one preallocated buffer before
  its layer's forward (the next layer's gather overwrites it: freed), gathers a weight again in
  the backward where the input's gradient needs it (not fc1's: the data needs none),
  Reduce_scatters each gradient of its 8 rows into its slice (sum, then 1/n), and runs Adam
  (simpar's update, product for product) on its slices only;
* (b) simpar ``data_parallel`` fed the global batch: without optimizer parallel, and with
  ``enable_parallel_optimizer`` at level1, level2 and level3 (threshold 0: every parameter
  sliced), and level3 under ``nn.GradAccumulation`` with 2 and with 4 micro-batches.

Target: simpar level3 / (a) <= 1.15. Each level is also given against plain data parallel.

Part 2, recomputation: the main job's GPT (vocabulary 128, sequence 32, d_model 64, 2 layers,
8 heads, float64, Adam lr 1e-3, batch 8 of ``CharCorpus``), data parallel on every rank, with
every block recomputed (``block.recompute()``) and without, and the forward alone: the
no-recompute program's ``ParallelProgram.forward`` (what ``TrainOneStepCell`` runs before the
backward) on this rank's slice of the batch, without the step's batch slicing and agreement
check (TrainOneStepCell has no forward-only entry). Target: recompute <= 1.1 x (step + forward).

Every variant runs in this one MPI job's processes. Part 1 starts from the same full weights
(simpar's stored slices overwritten after ``build`` with their ``storage_layout(name)`` slice)
on the same batches; before timing, the first 3 losses of each simpar variant (and of the
recomputed GPT) must agree with (a)'s (the plain GPT's) within a relative 1e-4, or the run
stops. Timing: ``--rounds`` rounds of ``_common.interleaved_times`` (``--steps`` steps of each
variant, each after a barrier, the slowest rank's time); a ratio is the median over rounds of
the per-round ratio of medians, with its range.
"""

# ruff: noqa: E402, I001  (simpar first: simpar/_env.py must run before numpy's BLAS and MPI)
from __future__ import annotations

import argparse
import itertools
import math
import shlex
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import simpar
import simpar.comm as comm

import numpy as np

from simpar import nn
from simpar.dataset import VOCAB_SIZE, CharCorpus, random_classification

from _common import host_line, interleaved_times, markdown_table, today, write_section

SCRIPT = "benchmarks/step_memory.py"
SEED = 0
IN, HIDDEN, OUT, N_HIDDEN, MLP_BATCH = 256, 1024, 256, 2, 64
SEQ, D_MODEL, LAYERS, HEADS, GPT_BATCH = 32, 64, 2, 8, 8
LR, BETA1, BETA2, EPS = 1e-3, 0.9, 0.999, 1e-8     # nn.Adam's defaults, passed explicitly
N_BATCHES = 4                                     # step k trains on batch k % N_BATCHES
CHECK_STEPS, LOSS_RTOL = 3, 1e-4
ZERO3_TARGET, RECOMPUTE_TARGET = 1.15, 1.1

HAND = "(a) numpy + mpi4py ZeRO-3, by hand"
PLAIN = "(b) simpar, no optimizer parallel"
LEVEL3 = "(b) simpar level3"
#: Part 1's simpar rows: (name, optimizer level, micro-batches).
SIMPAR_MLP = ((PLAIN, None, 1), ("(b) simpar level1", "level1", 1),
              ("(b) simpar level2", "level2", 1), (LEVEL3, "level3", 1),
              ("(b) simpar level3, 2 micro-batches", "level3", 2),
              ("(b) simpar level3, 4 micro-batches", "level3", 4))
GPT_STEP, GPT_RECOMPUTE, GPT_FORWARD = ("step", "step, every block recomputed",
                                        "forward only (no recompute)")

Batch = tuple[np.ndarray, np.ndarray]
Rounds = dict[str, list[np.ndarray]]


def mlp_weights() -> dict[str, np.ndarray]:
    """The MLP's global float32 parameters, named as in ``nn.MLP`` (weights (out, in))."""
    rng = np.random.default_rng([SEED, 1])
    sizes = [IN] + [HIDDEN] * N_HIDDEN + [OUT]
    w = {}
    for k, (fan_in, fan_out) in enumerate(zip(sizes, sizes[1:]), start=1):
        w[f"fc{k}.weight"] = rng.normal(0, fan_in ** -0.5, (fan_out, fan_in)).astype(np.float32)
        w[f"fc{k}.bias"] = rng.normal(0, 0.01, fan_out).astype(np.float32)
    for a in w.values():
        a.setflags(write=False)   # a variant that trained them in place would fail the check
    return w


def mlp_batch(k: int) -> Batch:
    return random_classification(k, MLP_BATCH, IN, OUT, SEED, np.float32)


class HandZero3:
    """ZeRO-3 on every rank of ``world`` for ``mlp_weights``' MLP: rank r stores rows
    ``[r * out / n, (r + 1) * out / n)`` of each parameter and Adam's moments of them only;
    with n = 8, fc2.weight's slice is rows 128r..128r+127 of (1024, 1024)."""

    def __init__(self, world: Any, mpi: Any, weights: dict[str, np.ndarray]) -> None:
        self.world, self.mpi = world, mpi
        self.ranks, rank = world.Get_size(), world.Get_rank()
        self.layers = len(weights) // 2
        self.shapes = {name: w.shape for name, w in weights.items()}
        self.slices = {name: np.array_split(w, self.ranks)[rank].copy()
                       for name, w in weights.items()}
        # Per slice: its gradient, Adam's m and v, and two scratch arrays.
        self.state = {name: tuple(np.zeros_like(s) for _ in range(5))
                      for name, s in self.slices.items()}
        largest = max(w.size for w in weights.values())
        # One gathered weight, one bias and one whole weight gradient at a time (before its
        # ReduceScatter): every layer reuses them, so a layer's gathered weight is freed.
        self._whole, self._whole_bias, self._whole_grad = (np.empty(largest, np.float32)
                                                           for _ in range(3))
        self._loss = np.zeros(1, np.float64)
        self.t = 0
        self.calls: list[str] = []      # the kinds of the last step's collectives

    def _view(self, buffer: np.ndarray, name: str) -> np.ndarray:
        return buffer[:math.prod(self.shapes[name])].reshape(self.shapes[name])

    def _gather(self, name: str) -> np.ndarray:
        whole = self._view(self._whole_bias if name.endswith("bias") else self._whole, name)
        self.calls.append("AllGather")
        self.world.Allgather(self.slices[name], whole)
        return whole

    def _reduce_scatter(self, name: str, whole_grad: np.ndarray) -> None:
        self.calls.append("ReduceScatter")
        grad = self.state[name][0]
        self.world.Reduce_scatter_block(whole_grad, grad, op=self.mpi.SUM)
        grad *= 1.0 / self.ranks        # gradients_mean

    def step(self, x: np.ndarray, labels: np.ndarray) -> float:
        self.calls.clear()
        inputs = []                     # each layer's input, for its weight's gradient
        h = x
        for k in range(1, self.layers + 1):
            inputs.append(h)
            h = h @ self._gather(f"fc{k}.weight").T
            h += self._gather(f"fc{k}.bias")
            if k < self.layers:
                np.maximum(h, 0, out=h)
        rows = np.arange(len(labels))
        shifted = h - h.max(axis=1, keepdims=True)
        e = np.exp(shifted)
        total = e.sum(axis=1, keepdims=True)
        self._loss[0] = np.mean(np.log(total[:, 0]) - shifted[rows, labels])
        self.calls.append("AllReduce")
        self.world.Allreduce(self.mpi.IN_PLACE, self._loss, op=self.mpi.SUM)
        d = e
        d /= total
        d[rows, labels] -= 1
        d *= 1.0 / len(labels)          # this rank's mean; the 1/n comes after the sum
        for k in range(self.layers, 0, -1):
            weight, bias = f"fc{k}.weight", f"fc{k}.bias"
            self._reduce_scatter(weight, np.matmul(d.T, inputs[k - 1],
                                                   out=self._view(self._whole_grad, weight)))
            self._reduce_scatter(bias, d.sum(axis=0))
            if k > 1:
                d = d @ self._gather(weight)
                d *= inputs[k - 1] > 0   # ReLU's gradient
        self._adam()
        return float(self._loss[0]) / self.ranks

    def _adam(self) -> None:
        """simpar.nn.Adam's update, product for product, on this rank's slices."""
        self.t += 1
        corr = math.sqrt(1.0 - BETA2 ** self.t) / (1.0 - BETA1 ** self.t)
        for name, p in self.slices.items():
            g, m, v, t, d = self.state[name]
            m *= BETA1
            m += np.multiply(g, 1.0 - BETA1, out=t)
            v *= BETA2
            np.multiply(g, 1.0 - BETA2, out=t)
            t *= g
            v += t
            np.sqrt(v, out=t)
            t += EPS
            np.multiply(m, corr, out=d)
            d /= t
            d *= LR
            p -= d


def _compiled(network: nn.Cell, optimizer: nn.Adam, parallel: dict[str, Any], batch: Batch
              ) -> nn.TrainOneStepCell:
    """``TrainOneStepCell(network, optimizer)`` under ``data_parallel`` with
    ``gradients_mean`` and ``parallel``, built on ``batch``; the context is reset after."""
    simpar.reset_auto_parallel_context()
    simpar.set_auto_parallel_context(parallel_mode="data_parallel", gradients_mean=True,
                                     **parallel)
    try:
        train = nn.TrainOneStepCell(network, optimizer, seed=SEED)
        train.build(*batch)
    finally:
        simpar.reset_auto_parallel_context()
    return train


def simpar_mlp(level: str | None, micro: int, weights: dict[str, np.ndarray]
               ) -> nn.TrainOneStepCell:
    """Part 1's simpar step at ``level`` (None: optimizer parallel off), from ``weights``."""
    cell = nn.WithLossCell(nn.MLP(IN, HIDDEN, OUT, n_hidden=N_HIDDEN, dtype=np.float32),
                           nn.SoftmaxCrossEntropyWithLogits())
    adam = nn.Adam(cell.trainable_params(), LR, BETA1, BETA2, EPS)
    parallel: dict[str, Any] = {} if level is None else {
        "enable_parallel_optimizer": True,
        "parallel_optimizer_config": {"optimizer_level": level,
                                      "parallel_optimizer_threshold": 0}}
    train = _compiled(nn.GradAccumulation(cell, micro) if micro > 1 else cell, adam, parallel,
                      mlp_batch(0))
    prog = train.program
    assert prog is not None
    rank = comm.get_rank()
    for name, stored in train.params.items():
        stored[...] = weights[name.rpartition("_backbone.")[2]][
            prog.storage_layout(name).slices(rank)]
    return train


def simpar_gpt(recompute: bool) -> nn.TrainOneStepCell:
    """Part 2's GPT step, every block recomputed or none; simpar's seeded initial weights."""
    gpt = nn.GPT(VOCAB_SIZE, SEQ, D_MODEL, LAYERS, HEADS, dtype=np.float64)
    for block in gpt.blocks if recompute else []:
        block.recompute()
    cell = nn.WithLossCell(gpt, nn.SoftmaxCrossEntropyWithLogits())
    return _compiled(cell, nn.Adam(cell.trainable_params(), LR), {}, gpt_batch(0))


def gpt_batch(k: int) -> Batch:
    return CharCorpus(seed=SEED).batch(k, GPT_BATCH, SEQ)


def _cycling(step: Callable[[np.ndarray, np.ndarray], object], batches: Sequence[Batch]
             ) -> Callable[[], object]:
    """A call that runs ``step`` on the next batch, round and round."""
    order = itertools.cycle(batches)
    return lambda: step(*next(order))


def _checked(name: str, losses: Sequence[float], reference: Sequence[float], against: str
             ) -> float:
    """The largest relative difference of ``losses`` from ``reference``; stops the run
    (on every rank alike: losses are global) beyond LOSS_RTOL."""
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
    if worst > LOSS_RTOL:
        raise SystemExit(f"step_memory: the losses of {name} {list(losses)} differ from "
                         f"{against}'s {list(reference)} by a relative {worst:.1e} > "
                         f"{LOSS_RTOL}: the variants do not compute the same step")
    return worst


def _kinds(kinds: Sequence[str]) -> str:
    """``AllGather x9, ReduceScatter x6``: one step's collectives by kind."""
    return ", ".join(f"{kind} x{n}" for kind, n in sorted(Counter(kinds).items())) or "none"


def timed(fns: dict[str, Callable[[], object]], rounds: int, steps: int, world: Any, mpi: Any
          ) -> Rounds:
    """Per name, one array of step seconds (the slowest rank's) per round."""
    def slowest(a: np.ndarray) -> np.ndarray:
        out = np.empty_like(a)
        world.Allreduce(a, out, op=mpi.MAX)
        return out

    out: Rounds = {name: [] for name in fns}
    for _ in range(rounds):
        for name, t in interleaved_times(fns, steps, 1, world.Barrier, slowest).items():
            out[name].append(t)
    return out


def _ratio(rounds: Rounds, numerator: str, denominator: Sequence[str]) -> list[float]:
    """Per round, ``numerator``'s median over the sum of the ``denominator`` medians."""
    return [float(np.median(rounds[numerator][r])
                  / sum(np.median(rounds[d][r]) for d in denominator))
            for r in range(len(rounds[numerator]))]


def _time_cells(rounds: Rounds, name: str) -> list[str]:
    """The median ms of every step, and the range of the per-round medians."""
    medians = [np.median(t) * 1e3 for t in rounds[name]]
    return [f"{np.median(np.concatenate(rounds[name])) * 1e3:.1f}",
            f"{min(medians):.1f}–{max(medians):.1f}"]


def _ratio_cell(per_round: list[float]) -> str:
    return f"{np.median(per_round):.2f} ({min(per_round):.2f}–{max(per_round):.2f})"


def _verdict(what: str, per_round: list[float], target: float) -> str:
    met = np.median(per_round) <= target
    return (f"{what}: {_ratio_cell(per_round)} (median over rounds, and range), against "
            f"the target <= {target}: {'met' if met else 'MISSED'}.")


def part_zero3(world: Any, mpi: Any, rounds: int, steps: int) -> tuple[str, str, float]:
    """Part 1's tables, its verdict and the largest loss difference."""
    weights = mlp_weights()
    batches = [mlp_batch(k) for k in range(N_BATCHES)]
    rank, n = world.Get_rank(), world.Get_size()
    local = [(np.array_split(x, n)[rank], np.array_split(y, n)[rank]) for x, y in batches]
    hand = HandZero3(world, mpi, weights)
    reference = [hand.step(*local[k % N_BATCHES]) for k in range(CHECK_STEPS)]
    calls = {HAND: _kinds(hand.calls)}
    fns: dict[str, Callable[[], object]] = {HAND: _cycling(hand.step, local)}
    worst = 0.0
    for name, level, micro in SIMPAR_MLP:
        train = simpar_mlp(level, micro, weights)
        losses = [train(*batches[k % N_BATCHES]) for k in range(CHECK_STEPS)]
        worst = max(worst, _checked(name, losses, reference, "(a)"))
        with comm.CommTrace() as trace:
            train(*batches[0])
        calls[name] = _kinds([e.kind for e in trace.events])
        fns[name] = _cycling(train, batches)
    times = timed(fns, rounds, steps, world, mpi)
    rows = [[name, *_time_cells(times, name), _ratio_cell(_ratio(times, name, [HAND])),
             _ratio_cell(_ratio(times, name, [PLAIN])) if name != HAND else "—", calls[name]]
            for name in fns]
    table = markdown_table(["variant", "median ms", "round medians ms", "/ (a) (rounds)",
                            "/ no optimizer parallel (rounds)", "collectives per step"], rows)
    return table, _verdict("simpar level3 / hand-written ZeRO-3",
                           _ratio(times, LEVEL3, [HAND]), ZERO3_TARGET), worst


def part_recompute(world: Any, mpi: Any, rounds: int, steps: int) -> tuple[str, str, float]:
    """Part 2's table, its verdict and the loss difference of recompute against without."""
    batches = [gpt_batch(k) for k in range(N_BATCHES)]
    plain, recomputed = simpar_gpt(False), simpar_gpt(True)
    reference = [plain(*batches[k % N_BATCHES]) for k in range(CHECK_STEPS)]
    losses = [recomputed(*batches[k % N_BATCHES]) for k in range(CHECK_STEPS)]
    worst = _checked(GPT_RECOMPUTE, losses, reference, GPT_STEP)
    prog, (x_lay, y_lay), rank = plain.program, plain.batch_layouts(), world.Get_rank()
    assert prog is not None
    local = [(x[x_lay.slices(rank)], y[y_lay.slices(rank)]) for x, y in batches]
    fns: dict[str, Callable[[], object]] = {
        GPT_STEP: _cycling(plain, batches), GPT_RECOMPUTE: _cycling(recomputed, batches),
        GPT_FORWARD: _cycling(lambda x, y: prog.forward([x, y], plain.params), local)}
    times = timed(fns, rounds, steps, world, mpi)
    table = markdown_table(["GPT, data parallel", "median ms", "round medians ms"],
                           [[name, *_time_cells(times, name)] for name in fns])
    return table, _verdict("recompute step / (step + forward)", _ratio(
        times, GPT_RECOMPUTE, [GPT_STEP, GPT_FORWARD]), RECOMPUTE_TARGET), worst


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant per round")
    p.add_argument("--rounds", type=int, default=8, help="rounds (default 8)")
    p.add_argument("--no-write", action="store_true", help="print only")
    args = p.parse_args()
    if args.steps < 1 or args.rounds < 1:
        p.error(f"--steps and --rounds must be >= 1, got {args.steps} and {args.rounds}")
    comm.init()                # simpar starts MPI, after choosing threads and wait policy
    from mpi4py import MPI     # the hand-written baseline's own collectives

    world = MPI.COMM_WORLD
    load = host_line()
    zero3, zero3_verdict, worst_mlp = part_zero3(world, MPI, args.rounds, args.steps)
    recompute, recompute_verdict, worst_gpt = part_recompute(world, MPI, args.rounds,
                                                             args.steps)
    if world.Get_rank() != 0:
        return 0
    n = world.Get_size()
    command = shlex.join(["mpirun", "-n", str(n), "python", SCRIPT, *sys.argv[1:]])
    body = "\n\n".join([
        f"Command: `{command}` · date: {today()}. {args.rounds} rounds of {args.steps} "
        "interleaved steps per variant (after 1 untimed step each), each after a barrier, "
        "the slowest rank's time; all variants in the same 8 processes. Ratios: median over "
        "rounds of the per-round ratio of medians, with its range.",
        f"ZeRO-3 data parallel: MLP {IN} -> {HIDDEN} -> {HIDDEN} -> {OUT} (ReLU), float32, "
        f"softmax cross entropy, Adam lr {LR}, batch {MLP_BATCH} on {n} ranks; simpar at "
        "threshold 0 (every parameter sliced), fed the global batch.", zero3, zero3_verdict,
        f"Recomputation: the main job's GPT (sequence {SEQ}, d_model {D_MODEL}, {LAYERS} "
        f"layers, {HEADS} heads, float64, Adam lr {LR}, batch {GPT_BATCH}), data parallel on "
        f"{n} ranks; forward only: the no-recompute program's ParallelProgram.forward on this "
        "rank's slice.", recompute, recompute_verdict,
        f"Correctness: from the same weights on the same batches, the first {CHECK_STEPS} "
        f"losses of every simpar MLP variant agree with (a)'s within {worst_mlp:.1e} "
        f"(relative), the recomputed GPT's with the plain GPT's within {worst_gpt:.1e}; the "
        f"run stops beyond {LOSS_RTOL}. Collectives: one step traced by CommTrace for simpar "
        "(its one-word batch agreement check is not traced), counted for (a).", f"{load}."])
    print(body)
    if not args.no_write:
        write_section("step time of the memory dimensions (issue 30)", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
