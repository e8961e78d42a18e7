"""A built training cell's checkpoints: :func:`save_training` and :func:`load_training`, the
collective calls ``python -m simpar.train --save-every/--resume`` makes.

The tensors are every parameter (``params/<name>``) and every optimizer state slot
(``opt/<name>/<slot>``, in its parameter's layout). A failure on any rank is raised on every
rank (:func:`_agree`), so that no rank waits alone in the next collective.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from typing import Any

import numpy as np

from simpar import comm
from simpar.checkpoint.load import load_shard
from simpar.checkpoint.manifest import check_against, param_of, read_manifest
from simpar.checkpoint.save import finish_checkpoint, save_shards
from simpar.layout import TensorLayout
from simpar.nn.wrap import TrainOneStepCell
from simpar.pipeline.strategy_files import save_pipeline_strategy
from simpar.strategy_file import save_strategy

__all__ = ["load_training", "save_training"]

# The longest problem text (in UTF-8 bytes) one rank tells the others in _agree.
_MESSAGE_BYTES = 1024


def _training_layouts(train: TrainOneStepCell
                      ) -> tuple[dict[str, TensorLayout], dict[str, tuple[int, ...]]]:
    """The tensors of a built training cell's checkpoint: every parameter
    (``params/<name>``) and every optimizer state slot (``opt/<name>/<slot>``, in its
    parameter's storage layout); and, with pipeline stages, the world ranks of the stage that
    saves each (the first stage that holds it: a tied parameter is saved once)."""
    program = train.program
    if program is None:
        raise ValueError("TrainOneStepCell checkpoint: the cell has not been built; call it "
                         "(or build) on a batch first")
    runner = train.pipeline
    stored = ([(program, ())] if runner is None else
              [(prog, tuple(runner.peer(vs) - runner.local + k for k in range(runner.per_stage)))
               for vs, prog in enumerate(runner.programs)])
    trainable = {p.name for p in train.optimizer.parameters}
    layouts: dict[str, TensorLayout] = {}
    ranks: dict[str, tuple[int, ...]] = {}
    for prog, held_by in stored:
        # A parameter optimizer parallel slices is stored, and its state kept, as its slice.
        for name in prog.param_layouts:
            if f"params/{name}" in layouts:
                continue
            lay = prog.storage_layout(name)
            names = [f"params/{name}"]
            if name in trainable:   # the optimizer keeps state for every parameter it got
                names += [f"opt/{name}/{slot}" for slot in train.optimizer.slots]
            for key in names:
                layouts[key] = lay
                if held_by:
                    ranks[key] = held_by
    return layouts, ranks


def _training_arrays(train: TrainOneStepCell) -> dict[str, np.ndarray]:
    """This rank's shard of every tensor it holds."""
    arrays = {f"params/{n}": a for n, a in train.params.items()}
    arrays.update({f"opt/{n}/{slot}": a for n, slots in train.optimizer.state.items()
                   for slot, a in slots.items()})
    return arrays


def _held(train: TrainOneStepCell) -> tuple[dict[str, TensorLayout], int]:
    """The tensors this rank holds, in the layouts its program stores them, and its device
    in them (with stages, its place in its stage)."""
    runner = train.pipeline
    if runner is None:
        layouts, _ = _training_layouts(train)
        assert train.program is not None
        return layouts, comm.get_rank() if train.program.device_num > 1 else 0
    out = {}
    for name, (prog, _) in runner.params().items():
        out[f"params/{name}"] = prog.storage_layout(name)
        for slot in train.optimizer.state.get(name, {}):
            out[f"opt/{name}/{slot}"] = prog.storage_layout(name)
    return out, runner.local


def _agree(what: str, problem: str | None, collective: bool) -> None:
    """Raise on every rank if any rank had a problem, with the first such rank's message: a
    rank that went on alone would wait forever in the next collective. The agreement runs on
    raw MPI (``comm.world()``), outside simpar's CommTrace: it is no training traffic. A
    one-device cell (``collective`` False) agrees with nobody."""
    if not collective or comm.get_group_size() == 1:
        if problem is not None:
            raise ValueError(f"{what}: {problem}")
        return
    raw = (problem or "").encode("utf-8")
    if len(raw) > _MESSAGE_BYTES:
        raw = raw[:_MESSAGE_BYTES - 3] + b"..."
    mine = np.zeros(_MESSAGE_BYTES + 1, dtype=np.int32)
    mine[0] = len(raw) if problem is not None else -1
    mine[1:1 + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    every = np.zeros((comm.get_group_size(), _MESSAGE_BYTES + 1), dtype=np.int32)
    comm.world().Allgather(mine, every)
    for rank, row in enumerate(every):
        if row[0] >= 0:
            text = bytes(row[1:1 + row[0]].astype(np.uint8)).decode("utf-8", "replace")
            raise ValueError(f"{what}: rank {rank}: {text}")


def _failed(e: BaseException) -> str:
    return str(e) if isinstance(e, (OSError, ValueError)) else f"{type(e).__name__}: {e}"


def save_training(train: TrainOneStepCell, directory: str | os.PathLike[str],
                  extra: Mapping[str, Any] | None = None) -> str:
    """Save a built training cell's state into ``directory`` (collective: every rank of a
    parallel cell calls): each rank its own blocks of the parameters and the optimizer state
    (one writer per set of replicas), the strategy file beside them, and ``manifest.json``
    last, so that a save cut short leaves no checkpoint there and the previous one stays the
    latest. ``extra`` (JSON values, e.g. the losses so far) is kept in the manifest. Returns
    the directory. Any failure raises on every rank, with the failing rank's message."""
    layouts, ranks = _training_layouts(train)
    program = train.program
    assert program is not None
    parallel = program.device_num > 1 or train.pipeline is not None
    rank = comm.get_rank() if parallel else 0
    step = train.step_count
    info = {**(extra or {}), "optimizer": type(train.optimizer).__name__,
            "optimizer_t": train.optimizer.t}
    root = os.fspath(directory)
    problem = None
    try:
        if rank == 0:
            os.makedirs(root, exist_ok=True)
    except Exception as e:  # noqa: BLE001 - agreed below and raised on every rank
        problem = f"cannot create {root!r}: {_failed(e)}"
    _agree("save_training", problem, parallel)
    try:
        mine = {n: lay for n, lay in layouts.items() if n not in ranks or rank in ranks[n]}
        arrays = _training_arrays(train)
        save_shards(root, rank, mine, {n: arrays[n] for n in mine}, step=step, extra=info,
                    ranks={n: ranks[n] for n in mine if n in ranks})
    except Exception as e:  # noqa: BLE001 - agreed below and raised on every rank
        problem = _failed(e)
    _agree("save_training", problem, parallel)
    if rank == 0:
        try:
            assert program.strategy_map is not None
            with tempfile.TemporaryDirectory(dir=root) as scratch:
                strategy = os.path.join(scratch, "strategy.json")
                if train.pipeline is None:
                    save_strategy(strategy, program.strategy_map, program.graph,
                                  only_trainable_params=False)
                else:   # every stage's plan, merged
                    save_pipeline_strategy(strategy, train.pipeline.programs,
                                           train.pipeline.count, only_trainable_params=False)
                world = program.device_num if train.pipeline is None else \
                    train.pipeline.per_stage * train.pipeline.count
                finish_checkpoint(root, world, layouts,
                                  step=step, strategy_file=strategy, extra=info, ranks=ranks)
        except Exception as e:  # noqa: BLE001 - agreed below and raised on every rank
            problem = _failed(e)
    _agree("save_training", problem, parallel)
    return root


def load_training(train: TrainOneStepCell, directory: str | os.PathLike[str]) -> int:
    """Restore a built training cell from the checkpoint in ``directory`` (collective for a
    parallel cell): its parameters, optimizer state and step count. The cell may run another
    strategy or another number of ranks than the one that saved: each rank reads only the
    saved blocks that overlap its own. A checkpoint of another network, another optimizer or
    another dtype, or a damaged file, raises on every rank, naming what is wrong. Returns the
    step the checkpoint was taken after."""
    layouts, _ = _training_layouts(train)
    program = train.program
    assert program is not None
    parallel = program.device_num > 1 or train.pipeline is not None
    held, device = _held(train)
    dtypes = {n: prog.param_values[n].dtype for prog in (
        [program] if train.pipeline is None else train.pipeline.programs)
        for n in prog.param_values}
    problem = None
    restored: dict[str, np.ndarray] = {}
    manifest = None
    try:
        manifest = read_manifest(directory)
        kind = manifest.extra.get("optimizer")
        if kind != type(train.optimizer).__name__:
            raise ValueError(f"the checkpoint holds {kind} state, but the cell trains with "
                             f"{type(train.optimizer).__name__}")
        check_against(manifest, {name: (lay.shape, dtypes[param_of(name)])
                                 for name, lay in layouts.items()})
        for name, lay in held.items():
            restored[name] = load_shard(directory, name, lay, device)
    except Exception as e:  # noqa: BLE001 - agreed below and raised on every rank
        problem = _failed(e)
    _agree("load_training", problem, parallel)
    assert manifest is not None
    for name in train.params:
        train.params[name] = restored[f"params/{name}"]
    for name, slots in train.optimizer.state.items():
        for slot in slots:
            slots[slot] = restored[f"opt/{name}/{slot}"]
    train.optimizer.t = int(manifest.extra.get("optimizer_t", manifest.step))
    train.step_count = manifest.step
    return manifest.step
