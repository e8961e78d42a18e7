"""``Model.eval``: the network's forward in evaluation mode, in parallel, and MindSpore's
metrics over it.

:class:`Evaluator` traces the network with its loss, returning ``(loss, logits)``, in
evaluation mode (Dropout off, BatchNorm on its moving statistics), plans it as the training
cell's context plans (its mode, dataset strategy and feeding), and lowers it once. Each call
takes the training cell's parameter shards, redistributed from the layouts training keeps them
in to the ones this program reads (nothing moves where they agree), runs the forward alone,
and assembles the logits and labels whole on every rank for the metrics. ``Accuracy`` and
``Loss`` are MindSpore's (``clear``, ``update``, ``eval``); ``Model(metrics={"accuracy",
"loss"})`` names them as MindSpore does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from simpar import comm, graph
from simpar.layout import shard_index, take_shard
from simpar.nn import Cell, TrainOneStepCell, WithLossCell
from simpar.redistribution import execute, plan
from simpar.runtime.lowering import lower
from simpar.runtime.program import ParallelProgram
from simpar.search import plan_request, request_from_context

__all__ = ["METRICS", "Accuracy", "Evaluator", "Loss", "Metric", "metrics_of"]


class Metric:
    """MindSpore's metric interface: ``clear()``, ``update(logits, labels, loss)``,
    ``eval()``."""

    def clear(self) -> None:
        raise NotImplementedError

    def update(self, logits: np.ndarray, labels: np.ndarray, loss: float) -> None:
        raise NotImplementedError

    def eval(self) -> float:
        raise NotImplementedError


class Accuracy(Metric):
    """The share of samples whose largest logit is their label (``eval_type="classification"``,
    MindSpore's default)."""

    def __init__(self, eval_type: str = "classification") -> None:
        if eval_type != "classification":
            raise NotImplementedError(f"Accuracy: simpar implements eval_type='classification' "
                                      f"only, got {eval_type!r}")
        self.clear()

    def clear(self) -> None:
        self._correct = self._total = 0

    def update(self, logits: np.ndarray, labels: np.ndarray, loss: float) -> None:
        labels = np.asarray(labels)
        if labels.ndim == logits.ndim:      # one-hot (or smoothed) rows
            labels = labels.argmax(axis=-1)
        self._correct += int((logits.argmax(axis=-1) == labels).sum())
        self._total += int(labels.size)

    def eval(self) -> float:
        if not self._total:
            raise RuntimeError("Accuracy.eval: no sample was evaluated; update it first")
        return self._correct / self._total


class Loss(Metric):
    """The mean of the batches' losses, each weighted by its samples."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self._sum = 0.0
        self._count = 0

    def update(self, logits: np.ndarray, labels: np.ndarray, loss: float) -> None:
        self._sum += float(loss) * len(logits)
        self._count += len(logits)

    def eval(self) -> float:
        if not self._count:
            raise RuntimeError("Loss.eval: no batch was evaluated; update it first")
        return self._sum / self._count


#: MindSpore's metric names (``Model(metrics={"accuracy"})``) and their classes.
METRICS: dict[str, type[Metric]] = {"accuracy": Accuracy, "acc": Accuracy, "loss": Loss}


def metrics_of(metrics: Any) -> dict[str, Metric]:
    """``Model``'s ``metrics``: a set or list of names, or a dict {name: Metric}."""
    if isinstance(metrics, Mapping):
        out = dict(metrics)
    elif isinstance(metrics, (set, list, tuple, frozenset)):
        unknown = sorted(str(m) for m in metrics if m not in METRICS)
        if unknown:
            raise NotImplementedError(f"Model: metrics {unknown} are not implemented by "
                                      f"simpar; it has {sorted(METRICS)}")
        out = {name: METRICS[name]() for name in metrics}
    else:
        raise TypeError(f"Model: metrics must be a set of names or a dict of Metrics, got "
                        f"{type(metrics).__name__}")
    for name, metric in out.items():
        if not isinstance(metric, Metric):
            raise TypeError(f"Model: metric {name!r} must be a Metric (train.Accuracy(), "
                            f"train.Loss()), got {type(metric).__name__}")
    return out


class _WithOutputs(WithLossCell):
    """The network with its loss, returning the loss and the network's outputs."""

    def construct(self, data: Any, label: Any) -> Any:
        outputs = self._backbone(data)
        return self._loss_fn(outputs, label), outputs


class Evaluator:
    """The forward of ``network`` with ``loss_fn`` in evaluation mode, in parallel, with the
    parameters of ``train`` (module docstring)."""

    def __init__(self, network: Cell, loss_fn: Cell, train: TrainOneStepCell) -> None:
        self.cell = _WithOutputs(network, loss_fn)
        self.train = train
        #: One program per batch shape (a shorter last batch is a program of its own).
        self.programs: dict[tuple[tuple[int, ...], ...], ParallelProgram] = {}

    def _build(self, data: np.ndarray, label: np.ndarray) -> ParallelProgram:
        train = self.train
        with train.settings() as ctx:
            shapes = train.global_shapes(ctx, data, label)
            # evaluation mode for this trace; the training cell keeps its own
            g = graph.trace(self.cell, [(shapes[0], data.dtype), (shapes[1], label.dtype)],
                            ["data", "label"], training=False)
            request = request_from_context(g, cell=self.cell, mode=train.mode)
            return lower(g, plan_request(request), request.enable_alltoall)

    def __call__(self, data: np.ndarray, label: np.ndarray
                 ) -> tuple[float, np.ndarray, np.ndarray]:
        """(loss, the logits whole, the labels whole) of one batch: global arrays, or each
        rank's slice when the training cell feeds per device."""
        data, label = np.asarray(data), np.asarray(label)
        key = (tuple(data.shape), tuple(label.shape))
        if self.train.mode != "stand_alone" and comm.get_group_size() > 1:
            comm.check_same_arrays("Model.eval", [   # every rank builds and runs the same
                ("batch shapes", np.asarray([*key[0], -1, *key[1]], dtype=np.int64))])
        if key not in self.programs:
            self.programs[key] = self._build(data, label)
        prog, train = self.programs[key], self.train
        rank = comm.get_rank() if prog.device_num > 1 else 0
        params = {}
        for name in prog.param_layouts:
            dst = prog.storage_layout(name)
            if train.program is None:   # not trained yet: the initial values, as training's
                value = prog.param_values[name].param
                assert value is not None
                params[name] = value.initial_value(train.seed, dst.slice_of(rank))
                continue
            src = train.program.storage_layout(name)
            params[name] = execute(plan(src, dst), train.params[name])
        local = []
        for x, lay in zip((data, label), prog.input_layouts()):
            local.append(take_shard(x, *shard_index(lay, rank)) if tuple(x.shape) == lay.shape
                         else x)
        outs, _ = prog.forward(local, params, step=0)
        loss_lay, logits_lay = prog.output_layouts()[:2]
        loss = execute(plan(loss_lay, loss_lay.replicated()), outs[0])
        logits = execute(plan(logits_lay, logits_lay.replicated()), outs[1])
        label_lay = prog.input_layouts()[1]
        labels = execute(plan(label_lay, label_lay.replicated()), local[1])
        return float(np.asarray(loss).reshape(())), logits, labels
