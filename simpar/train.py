"""The main job: train a small GPT in parallel on simulated Ascend devices, then check it.

    mpirun -n 8 python -m simpar.train                       # GPT, dp x mp = 2 x 4 (hybrid)
    mpirun -n 8 python -m simpar.train --strategy mp         # Megatron over all 8 ranks
    mpirun -n 8 python -m simpar.train --parallel-mode data_parallel
    mpirun -n 4 python -m simpar.train --model mlp --steps 30 --out out/
    simrun -n 8 --log-dir logs -- python -m simpar.train     # per-rank logs + rank table

Every rank holds only its shards; the collectives are real MPI collectives. At the end the
same steps run on one device (rank 0) and every rank compares its shards with the matching
slice of that run: max |Δloss|, max |Δparam|, PASS or FAIL (exit code 1 on FAIL).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np

import simpar
from simpar import comm, nn
from simpar.dataset import VOCAB_SIZE, CharCorpus, random_classification
from simpar.layout import distribute
from simpar.nn import presets

MODES = ("stand_alone", "data_parallel", "semi_auto_parallel", "auto_parallel")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m simpar.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parallel-mode", default="semi_auto_parallel", choices=MODES)
    p.add_argument("--device-num", type=int, default=None,
                   help="must equal the number of MPI ranks (default: the world size)")
    p.add_argument("--strategy", default="hybrid", choices=presets.PRESETS,
                   help="semi_auto preset: dp, mp (Megatron), hybrid (dp=2 x mp=N/2)")
    p.add_argument("--model", default="gpt", choices=("gpt", "mlp"))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-length", type=int, default=32)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--hidden", type=int, default=64, help="MLP hidden width")
    p.add_argument("--lr", type=float, default=None, help="default 3e-3 (Adam) / 0.1 (SGD)")
    p.add_argument("--optimizer", default="adam", choices=("adam", "adamw", "momentum", "sgd"))
    p.add_argument("--dtype", default="float64", choices=("float32", "float64"),
                   help="float64 (default) checks to 1e-10; float32 to 1e-5 (prefer --optimizer "
                   "momentum: Adam turns float32 round-off in near-zero gradients into steps)")
    p.add_argument("--gradients-mean", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-check", action="store_true", help="skip the single-device check")
    p.add_argument("--out", default=None, help="directory for summary.json")
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "seq_length", "d_model", "n_layers", "n_heads",
                 "hidden"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def build(args: argparse.Namespace, mode: str, device_num: int
          ) -> tuple[nn.TrainOneStepCell, tuple[int, int]]:
    dtype = np.dtype(args.dtype)
    loss = nn.SoftmaxCrossEntropyWithLogits()
    model: nn.Cell
    if args.model == "gpt":
        model = nn.GPT(VOCAB_SIZE, args.seq_length, args.d_model, args.n_layers, args.n_heads,
                       dtype=dtype)
    else:
        model = nn.MLP(args.d_model, args.hidden, 8, n_hidden=1, dtype=dtype)
    dp_mp = (1, 1)
    if mode == "semi_auto_parallel":
        dp_mp = presets.apply(args.strategy, model, device_num, loss)
        if args.strategy == "dp":  # data parallel written as semi-auto strategies
            _data_parallel_strategies(model, device_num)
    elif mode == "data_parallel":
        dp_mp = (device_num, 1)
    net = nn.WithLossCell(model, loss)
    params = net.trainable_params()
    lr = args.lr if args.lr is not None else (3e-3 if args.optimizer.startswith("adam") else 0.1)
    opt: nn.Optimizer = {"adam": lambda: nn.Adam(params, lr),
                         "adamw": lambda: nn.AdamW(params, lr),
                         "momentum": lambda: nn.Momentum(params, lr, 0.9),
                         "sgd": lambda: nn.SGD(params, lr)}[args.optimizer]()
    return nn.TrainOneStepCell(net, opt, parallel_mode=mode, seed=args.seed), dp_mp


def _data_parallel_strategies(model: nn.Cell, n: int) -> None:
    for _, cell in model.cells_and_names():
        if isinstance(cell, nn.Dense):
            cell.matmul.shard(((n, 1), (1, 1)))


def batches(args: argparse.Namespace) -> Any:
    if args.model == "gpt":
        corpus = CharCorpus(seed=args.seed)
        return lambda k: corpus.batch(k, args.batch_size, args.seq_length)
    return lambda k: random_classification(k, args.batch_size, args.d_model, 8, args.seed,
                                           np.dtype(args.dtype))


def _short(name: str) -> str:
    parts = [p.split("-")[0] for p in name.split("/")[2:]]
    short = {"SparseSoftmaxCrossEntropyWithLogits": "SparseSoftmaxCE"}
    return "/".join(short.get(p, p) for p in parts[-3:])


def print_strategy_table(train: nn.TrainOneStepCell) -> None:
    prog = train.program
    assert prog is not None
    rows = prog.comm_table()
    shown = [r for r in rows if r["chosen"] == "annotated" or r["forward"] or r["redistribution"]]
    print(f"\nstrategies ({len(shown)} of {len(rows)} ops shown: annotated or communicating; "
          "the rest follow their producers)")
    print(f"  {'op':<34}{'strategy':<28}{'out map':<16}{'forward':<24}backward")
    for r in shown:
        fwd = ", ".join(r["redistribution"] + r["forward"]) or "-"
        bwd = ", ".join(r["backward"]) or "-"
        strat = str(r["strategy"]).replace(" ", "")
        print(f"  {_short(r['op'])[-33:]:<34}{strat:<28}"
              f"{str(r['out_tensor_map']).replace(' ', ''):<16}{fwd:<24} {bwd}")
    mirrors: dict[int, int] = {}
    for name in prog.param_layouts:
        g = len(prog.mirror_group(name, 0))
        mirrors[g] = mirrors.get(g, 0) + 1
    print("  parameter gradients: " + ", ".join(
        f"{n} synced over {g} ranks" if g > 1 else f"{n} sharded (no Mirror)"
        for g, n in sorted(mirrors.items())))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank, world = comm.get_rank(), comm.get_group_size()
    say = print if rank == 0 else (lambda *a, **k: None)
    device_num = args.device_num if args.device_num is not None else world
    simpar.set_seed(args.seed)
    try:  # every rank gets the same verdict, so every rank stops here alike
        simpar.set_auto_parallel_context(parallel_mode=args.parallel_mode,
                                         device_num=device_num,
                                         gradients_mean=args.gradients_mean,
                                         enable_alltoall=True)
        comm.check_context()
    except ValueError as e:
        say(f"python -m simpar.train: error: {e}")
        return 2
    if args.parallel_mode == "auto_parallel":
        say("parallel_mode auto_parallel needs the strategy search, which is not implemented "
            "yet; use semi_auto_parallel or data_parallel")
        return 2
    train, (dp, mp) = build(args, args.parallel_mode, device_num)
    if args.parallel_mode == "semi_auto_parallel" and args.model == "gpt":
        simpar.set_auto_parallel_context(
            dataset_strategy=((dp, 1), (dp, 1)) if dp * mp == device_num else "full_batch")
    get_batch = batches(args)
    from simpar import _env

    env = _env.SETTINGS
    say(f"simpar {simpar.__version__}: {world} ranks, mode {args.parallel_mode}, model "
        f"{args.model}, dtype {args.dtype}; BLAS threads/rank {env.get('blas_threads')}, MPI "
        f"wait policy {env.get('wait_policy')}")
    if args.parallel_mode == "semi_auto_parallel":
        say(f"mesh: dp x mp = {dp} x {mp}" + (f" (x {device_num // (dp * mp)} repeated)"
                                               if dp * mp < device_num else "") +
            f", strategy preset {args.strategy!r}")
    t_build = time.perf_counter()
    data0, label0 = get_batch(0)
    train.build(data0, label0)
    t_build = time.perf_counter() - t_build
    print_strategy_table(train) if rank == 0 else None
    say(f"\nplanned in {t_build:.2f} s; training {args.steps} steps of {args.batch_size} x "
        f"{args.seq_length if args.model == 'gpt' else 1} tokens")
    losses, step_times = [], []
    tokens = args.batch_size * (args.seq_length if args.model == "gpt" else 1)
    with comm.CommTrace() as trace:
        for k in range(args.steps):
            data, label = get_batch(k)
            comm.world().Barrier()  # untraced: only to time steps fairly
            t0 = time.perf_counter()
            loss = train(data, label)
            step_times.append(time.perf_counter() - t0)
            losses.append(loss)
            bar = "#" * int(20 * (k + 1) / args.steps)
            say(f"  step {k + 1:>3}/{args.steps} [{bar:<20}] loss {loss:.4f}  "
                f"{tokens / step_times[-1]:>8.0f} tok/s", flush=True)
    steady = step_times[1:] or step_times
    tok_s = tokens / float(np.median(steady))
    say(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; {tok_s:.0f} tokens/s (median step "
        f"{1e3 * float(np.median(steady)):.1f} ms)")
    say("collectives per rank 0 over the run:\n" + "\n".join(
        "  " + line for line in trace.summary().splitlines()))
    summary: dict[str, Any] = {
        "mode": args.parallel_mode, "strategy": args.strategy, "dp": dp, "mp": mp,
        "model": args.model, "dtype": args.dtype, "steps": args.steps, "losses": losses,
        "tokens_per_s": tok_s, "plan_seconds": t_build, "step_seconds": step_times,
        "comm": trace.by_kind(), "strategies": train.program.strategies() if train.program
        else {}, "passed": None}
    ok = True
    if not args.no_check:
        ok, diffs = check_against_single_device(args, train, losses, get_batch)
        summary.update(diffs, passed=ok)
    if args.out and rank == 0:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "summary.json")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(summary, f, indent=1, default=float)
        os.replace(tmp, path)
        say(f"wrote {path}")
    return 0 if ok else 1


def check_against_single_device(args: argparse.Namespace, train: nn.TrainOneStepCell,
                                losses: list[float], get_batch: Any
                                ) -> tuple[bool, dict[str, float]]:
    """Rank 0 trains the same steps on one device and broadcasts the result; every rank
    compares its own shards with the matching slices."""
    rank = comm.get_rank()
    prog = train.program
    assert prog is not None
    names = sorted(prog.param_layouts)
    ref_losses = np.zeros(len(losses))
    ref_params = {n: np.zeros(prog.param_layouts[n].shape, dtype=train.params[n].dtype)
                  for n in names}
    if rank == 0:
        ref, _ = build(args, "stand_alone", 1)
        if not args.gradients_mean:
            # The parallel gradients are the sum over the D batch shards at the loss op (see
            # simpar.nn.wrap): D times the single-device gradient, which sens=D reproduces.
            ref.sens = float(prog.loss_batch_cut())
        for k in range(args.steps):
            ref_losses[k] = ref(*get_batch(k))
        for n in names:
            ref_params[n] = ref.params[n]
    ref_losses = comm.broadcast(ref_losses, root=0)
    d_loss = float(np.max(np.abs(ref_losses - np.asarray(losses)) / np.maximum(
        np.abs(ref_losses), 1e-30)))
    d_param = 0.0
    for n in names:
        want = distribute(comm.broadcast(ref_params[n], root=0), prog.param_layouts[n], rank)
        scale = max(float(np.max(np.abs(want))), 1e-30)
        d_param = max(d_param, float(np.max(np.abs(train.params[n] - want))) / scale)
    worst = comm.all_reduce(np.array([d_loss, d_param]), op="max")
    tol = 1e-5 if args.dtype == "float32" else 1e-10
    ok = bool(worst[0] <= tol and worst[1] <= tol)
    if rank == 0:
        print(f"\ncheck against one device ({args.steps} steps, every rank's shards): max "
              f"|Δloss| {worst[0]:.2e}, max |Δparam| {worst[1]:.2e} (relative; tolerance "
              f"{tol:.0e}): {'PASS' if ok else 'FAIL'}")
    return ok, {"max_dloss": float(worst[0]), "max_dparam": float(worst[1])}


if __name__ == "__main__":
    sys.exit(main())
