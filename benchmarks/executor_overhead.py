"""Where a training step's time goes in one process: simpar's executor against its kernels,
and the kernels in the step against the same calls alone (issue 12).

    python benchmarks/executor_overhead.py                 # writes "## executor_overhead"
    python benchmarks/executor_overhead.py --batch 8 --no-write

The model is the main job's GPT (benchmarks/step.py's sizes and weights, float32, SGD), run
``stand_alone`` at ``--batch`` rows (default 1: what each rank of the dp 2 x mp 4 Megatron
GPT computes, one eighth of the step's work). Interleaved step by step, each variant on the
same batch:

* the whole step, simpar's, and benchmarks/step.py's hand-written numpy step of the same
  model (the floor);
* simpar's step with every op's kernel replaced by a constant (the outputs it returned on
  that batch): what is left is the compiled executor, the training cell and the optimizer;
* the same without the optimizer.

Then each op's kernel calls are timed three ways: inside the step (wrapped), each call alone
repeated on the inputs it had in the step, and all of them round-robin on those inputs. The
table per op type shows the first two.
"""

# ruff: noqa: E402, I001  (simpar first: simpar/_env.py must run before numpy's BLAS)
from __future__ import annotations

import argparse
import collections
import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import simpar  # chooses threads before numpy's BLAS starts
import numpy as np

from simpar import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import step as S  # benchmarks/step.py: the GPT's sizes, weights, batches, hand-written step
from _common import host_line, markdown_table, today, write_section


def _variants(batch: int) -> tuple[nn.TrainOneStepCell, Any,
                                    tuple[np.ndarray, np.ndarray]]:
    """simpar's training cell and the hand-written step, from the same weights, and a batch."""
    sizes = dataclasses.replace(S.GPT, batch=batch)
    weights = S._read_only(S.gpt_weights(sizes))
    data = S.gpt_batch(0, sizes)
    simpar.reset_auto_parallel_context()
    simpar.set_auto_parallel_context(parallel_mode="stand_alone")
    gpt = nn.GPT(sizes.vocab, sizes.seq, sizes.d_model, sizes.n_layers, sizes.n_heads,
                 dtype=np.float32)
    cell = nn.WithLossCell(gpt, nn.SoftmaxCrossEntropyWithLogits())
    train = nn.TrainOneStepCell(cell, nn.SGD(cell.trainable_params(), S.LR),
                                parallel_mode="stand_alone", seed=S.SEED)
    train.build(*data)
    S._load(train, weights)
    hand = S.HandGPT(sizes, 1, 1, 0, S.LR, S._Group(), S._Group())
    hand.load(weights)
    return train, hand, data


def _paired(fns: dict[str, tuple[Callable[[], object], Callable[[], object]]], reps: int
            ) -> dict[str, np.ndarray]:
    """Seconds of ``reps`` calls of each ``(setup, fn)``, interleaved call by call; only
    ``fn`` is timed."""
    times = {name: np.empty(reps) for name in fns}
    for rep in range(reps):
        for name, (setup, fn) in fns.items():
            setup()
            start = time.perf_counter()
            fn()
            times[name][rep] = time.perf_counter() - start
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=1, help="rows of the batch (default 1)")
    ap.add_argument("--reps", type=int, default=1500, help="timed steps per variant")
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args()
    if args.batch < 1 or args.reps < 10:
        ap.error(f"--batch must be >= 1 and --reps >= 10, got {args.batch} and {args.reps}")
    info = S._blas_threads()
    train, hand, data = _variants(args.batch)
    for _ in range(5):
        train(*data)
        hand.step(*data)
    prog = train.program
    assert prog is not None
    ex = prog.executor(0)
    seeded = (True,)
    fwd0 = ex.fwd
    bwd0, mirrors = ex.backwards[seeded]
    names_f = [s.node.op.name for s in prog.steps]
    names_b = list(reversed(names_f))

    # Each kernel's inputs and outputs on batch 0, recorded by wrapping its call.
    seen: dict[tuple[str, int], tuple[Any, Any]] = {}
    spent: dict[tuple[str, int], float] = collections.defaultdict(float)

    def wrapped(fn: Callable[..., Any], key: tuple[str, int]) -> Callable[..., Any]:
        def run(*a: Any) -> Any:
            start = time.perf_counter()
            out = fn(*a)
            spent[key] += time.perf_counter() - start
            seen.setdefault(key, (a, out))
            return out
        return run

    def install(f: Callable[[Any, tuple[str, int]], Any]) -> None:
        ex.fwd = tuple(r._replace(run=f(r.run, ("f", i))) for i, r in enumerate(fwd0))
        ex.backwards[seeded] = (tuple(r._replace(kernel=f(r.kernel, ("b", i))) if r.kernel
                                      else r for i, r in enumerate(bwd0)), mirrors)

    install(wrapped)
    train(*data)
    spent.clear()
    _paired({"simpar": (lambda: None, lambda: train(*data))}, args.reps)
    kernel_share = sum(spent.values()) / args.reps
    per_type: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for (d, i), t in spent.items():
        row = per_type[names_f[i] if d == "f" else names_b[i]]
        row[0] += t / args.reps

    # Each call alone, on its recorded inputs, hot; then all of them round-robin.
    def again(key: tuple[str, int]) -> Callable[[], Any]:
        a, _ = seen[key]
        fn = fwd0[key[1]].run if key[0] == "f" else bwd0[key[1]].kernel
        assert fn is not None   # only calls that ran were recorded
        a = tuple(x.copy() if isinstance(x, np.ndarray) else x for x in a)
        return lambda: fn(*a)

    calls = {key: again(key) for key in seen}
    alone = 0.0
    for key, call in calls.items():
        for _ in range(5):
            call()
        start = time.perf_counter()
        for _ in range(50):
            call()
        t = (time.perf_counter() - start) / 50
        alone += t
        per_type[names_f[key[1]] if key[0] == "f" else names_b[key[1]]][1] += t
        per_type[names_f[key[1]] if key[0] == "f" else names_b[key[1]]][2] += 1
    for _ in range(5):
        for call in calls.values():
            call()
    start = time.perf_counter()
    for _ in range(100):
        for call in calls.values():
            call()
    round_robin = (time.perf_counter() - start) / 100

    # The step with every kernel a constant, interleaved with the real steps (swapping the
    # kernels in and out, and the optimizer, is each call's untimed setup).
    opt = train.optimizer
    real_opt = opt.step

    def as_recorded(optimizer: bool) -> None:
        install(lambda fn, key: (lambda *a, _out=seen[key][1]: _out))
        opt.step = (real_opt if optimizer  # type: ignore[method-assign, assignment]
                    else (lambda p, g: None))

    def as_built() -> None:
        install(lambda fn, key: fn)
        opt.step = real_opt  # type: ignore[method-assign]

    times = _paired({"simpar": (as_built, lambda: train(*data)),
                     "hand": (as_built, lambda: hand.step(*data)),
                     "constant": (lambda: as_recorded(True), lambda: train(*data)),
                     "constant, no optimizer": (lambda: as_recorded(False),
                                                lambda: train(*data))}, args.reps)
    as_built()
    ex.fwd = fwd0
    ex.backwards[seeded] = (bwd0, mirrors)
    us = {name: float(np.median(t)) * 1e6 for name, t in times.items()}

    rows = [["simpar step", f"{us['simpar']:.0f}"],
            ["hand-written numpy step (the floor)", f"{us['hand']:.0f}"],
            ["simpar step, every kernel a constant", f"{us['constant']:.0f}"],
            ["  the same without the optimizer", f"{us['constant, no optimizer']:.0f}"],
            ["simpar's kernels inside the step (wrapped)", f"{kernel_share * 1e6:.0f}"],
            ["the same kernel calls, each alone and hot", f"{alone * 1e6:.0f}"],
            ["the same kernel calls, round-robin", f"{round_robin * 1e6:.0f}"]]
    ops_rows = [[name, f"{int(n)}", f"{t_in * 1e6:.0f}", f"{t_alone * 1e6:.0f}",
                 f"{t_in / t_alone:.2f}" if t_alone else "—"]
                for name, (t_in, t_alone, n) in sorted(per_type.items(), key=lambda kv: -kv[1][0])]
    cmd = "python benchmarks/executor_overhead.py" + (f" --batch {args.batch}"
                                                       if args.batch != 1 else "")
    body = "\n".join([
        f"Command: `{cmd}` · date: {today()}",
        "",
        f"The main job's GPT (vocabulary {S.GPT.vocab}, sequence {S.GPT.seq}, d_model "
        f"{S.GPT.d_model}, {S.GPT.n_layers} layers, {S.GPT.n_heads} heads) at batch "
        f"{args.batch}, float32, SGD, stand_alone in one process "
        f"(BLAS threads {info['blas_threads']}). Medians over {args.reps} steps, the variants "
        "interleaved step by step on the same batch. The per-op table sums each op type's "
        "forward and backward kernel calls of one step: inside the step, and each call alone "
        "(50 repeats on its recorded inputs).",
        "",
        markdown_table(["what", "µs per step"], rows),
        "",
        markdown_table(["op type", "calls per step", "in the step µs", "alone µs",
                        "ratio"], ops_rows),
        "",
        host_line(),
    ])
    print(body)
    if not args.no_write:
        write_section("executor_overhead", body)
        print("\nwritten to benchmarks/RESULTS.md (## executor_overhead)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
