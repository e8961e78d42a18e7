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

``--only simpar|hand --steps N`` builds one variant, runs N steps and exits, for a profiler
outside: the instructions of one step are the difference of two runs, e.g.

    SIMPAR_NUM_THREADS=1 valgrind --tool=callgrind \
        python benchmarks/executor_overhead.py --only simpar --steps 23     # and --steps 3
"""

# ruff: noqa: E402, I001  (simpar first: simpar/_env.py must run before numpy's BLAS)
from __future__ import annotations

import argparse
import collections
import dataclasses
import sys
import time
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

import simpar  # chooses threads before numpy's BLAS starts
import numpy as np

from simpar import nn, ops
from simpar.runtime.executor import Executor

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


def _kernels_against_hand(batch: int) -> list[tuple[str, float, float]]:
    """(kernel, simpar's µs, the hand-written µs) for LayerNorm, GeLU and a Dense's MatMul,
    forward and backward, each call alone on the GPT's shapes at ``batch`` rows."""
    def best(fn: Callable[[], object]) -> float:
        return min(timeit.repeat(fn, number=2000, repeat=5)) / 2000 * 1e6

    rng = np.random.default_rng(0)
    s = S.GPT
    x = rng.standard_normal((batch, s.seq, s.d_model)).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    gamma, beta = np.ones(s.d_model, np.float32), np.zeros(s.d_model, np.float32)
    ln = ops.LayerNorm(2, 2)
    ln_sh = ln.sharding([x.shape, gamma.shape, beta.shape], 1)
    _, ln_saved = ln.local_forward(ln_sh, x, gamma, beta)
    _, (xhat, rstd) = S._layer_norm(x, gamma, beta)
    z = rng.standard_normal((batch * s.seq, s.d_ff)).astype(np.float32)
    dz = rng.standard_normal(z.shape).astype(np.float32)
    gelu = ops.GeLU()
    gelu_sh = gelu.sharding([z.shape], 1)
    _, gelu_saved = gelu.local_forward(gelu_sh, z)
    _, t = S._gelu(z)
    a = x.reshape(-1, s.d_model)
    w = rng.standard_normal((s.d_model, s.d_model)).astype(np.float32)
    da = dy.reshape(a.shape)
    mm = ops.MatMul(transpose_b=True)
    mm_sh = mm.sharding([a.shape, w.shape], 1)
    _, mm_saved = mm.local_forward(mm_sh, a, w)
    return [
        ("LayerNorm forward", best(lambda: ln.local_forward(ln_sh, x, gamma, beta)),
         best(lambda: S._layer_norm(x, gamma, beta))),
        ("LayerNorm backward", best(lambda: ln.local_backward(ln_sh, ln_saved, dy)),
         best(lambda: S._layer_norm_grad(dy, xhat, rstd, gamma))),
        ("GeLU forward", best(lambda: gelu.local_forward(gelu_sh, z)),
         best(lambda: S._gelu(z))),
        ("GeLU backward", best(lambda: gelu.local_backward(gelu_sh, gelu_saved, dz)),
         best(lambda: S._gelu_grad(z, t, dz))),
        ("MatMul x @ W.T forward", best(lambda: mm.local_forward(mm_sh, a, w)),
         best(lambda: a @ w.T)),
        ("MatMul backward (dx, dW)", best(lambda: mm.local_backward(mm_sh, mm_saved, da)),
         best(lambda: (da @ w, da.T @ a))),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=1, help="rows of the batch (default 1)")
    ap.add_argument("--reps", type=int, default=1500, help="timed steps per variant")
    ap.add_argument("--no-write", action="store_true", help="print only")
    ap.add_argument("--only", choices=("simpar", "hand"),
                    help="run --steps steps of one variant and exit, for an outside profiler")
    ap.add_argument("--steps", type=int, default=3, help="steps for --only (default 3)")
    args = ap.parse_args()
    if args.batch < 1 or args.reps < 10 or args.steps < 0:
        ap.error(f"--batch must be >= 1, --reps >= 10 and --steps >= 0, got {args.batch}, "
                 f"{args.reps} and {args.steps}")
    info = S._blas_threads()
    train, hand, data = _variants(args.batch)
    if args.only is not None:
        for _ in range(args.steps):
            train(*data) if args.only == "simpar" else hand.step(*data)
        return 0
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

    # A kernel the executor writes inline (Primitive.inline) is called instead while it is
    # measured or replaced: inline=None on its records.
    def install(f: Callable[[Any, tuple[str, int]], Any]) -> None:
        ex.fwd = tuple(r._replace(run=f(r.run, ("f", i)), inline=None)
                       for i, r in enumerate(fwd0))
        ex.backwards[seeded] = (tuple(r._replace(kernel=f(r.kernel, ("b", i)), inline=None)
                                      if r.kernel else r for i, r in enumerate(bwd0)), mirrors)

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

    # The step with every kernel a constant, interleaved with the real steps. Each variant
    # has an executor of its own, so that each runs its own generated code warm (a freshly
    # written function runs unspecialised at first); swapping executors and the optimizer is
    # each call's untimed setup.
    opt = train.optimizer
    real_opt = opt.step
    built = Executor(prog, 0)
    constant = Executor(prog, 0)
    constant.fwd = tuple(r._replace(run=(lambda *a, _out=seen[("f", i)][1]: _out), inline=None)
                         for i, r in enumerate(fwd0))
    constant.backwards[seeded] = (tuple(
        r._replace(kernel=(lambda *a, _out=seen[("b", i)][1]: _out), inline=None) if r.kernel
        else r for i, r in enumerate(bwd0)), mirrors)

    def use(executor: Executor, optimizer: bool) -> Callable[[], None]:
        def setup() -> None:
            prog.runner.use_executor(0, executor)
            opt.step = (real_opt if optimizer  # type: ignore[method-assign, assignment]
                        else (lambda p, g: None))
        return setup

    times = _paired({"simpar": (use(built, True), lambda: train(*data)),
                     "hand": (use(built, True), lambda: hand.step(*data)),
                     "constant": (use(constant, True), lambda: train(*data)),
                     "constant, no optimizer": (use(constant, False),
                                                lambda: train(*data))}, args.reps)
    use(ex, True)()
    ex.fwd = fwd0
    ex.backwards[seeded] = (bwd0, mirrors)
    us = {name: float(np.median(t)) * 1e6 for name, t in times.items()}
    pairs = _kernels_against_hand(args.batch)

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
        "Single kernels alone against the hand-written lines that compute the same "
        "(benchmarks/step.py's), on the step's shapes, the best of 5 runs of 2000 calls:",
        "",
        markdown_table(["kernel", "simpar µs", "hand-written µs"],
                       [[name, f"{a:.1f}", f"{b:.1f}"] for name, a, b in pairs]),
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
