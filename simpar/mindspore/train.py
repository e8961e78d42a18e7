"""``mindspore.train``: :class:`Model` and its callbacks, as MindSpore's training scripts use
them.

``Model(network, loss_fn, optimizer).train(epoch, dataset, callbacks=[...])`` wraps the
network with its loss (:class:`~simpar.nn.WithLossCell`) and trains it one step per batch
with :class:`simpar.mindspore.nn.TrainOneStepCell`, which feeds as MindSpore does: with
``full_batch=False`` each rank's dataset (sharded with ``num_shards``/``shard_id``) gives its
own slice of the batch, laid out by ``dataset_strategy``. Every rank runs every callback, in
order; the ones that print (:class:`LossMonitor`, :class:`TimeMonitor`) print on rank 0 only,
once for the job (MindSpore prints one log per process).
"""

from __future__ import annotations

import os
import shutil
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from simpar import comm
from simpar.checkpoint import save_training
from simpar.context import NotHonouredWarning
from simpar.mindspore import nn
from simpar.mindspore._missing import missing
from simpar.mindspore.dataset import Dataset
from simpar.mindspore.evaluate import Accuracy, Evaluator, Loss, Metric, metrics_of
from simpar.mindspore.tensor import Tensor
from simpar.nn import Cell, Optimizer, WithLossCell

__all__ = ["Accuracy", "Callback", "CheckpointConfig", "Loss", "LossMonitor", "Metric", "Model",
           "ModelCheckpoint", "RunContext", "TimeMonitor"]


@dataclass
class CallbackParams:
    """What a callback reads from ``run_context.original_args()`` (MindSpore's names)."""

    train_network: Any
    epoch_num: int
    batch_num: int
    cur_epoch_num: int = 0
    cur_step_num: int = 0
    net_outputs: Any = None
    extras: dict[str, Any] = field(default_factory=dict)


class RunContext:
    """Handed to every callback: ``original_args()`` and ``request_stop()``."""

    def __init__(self, params: CallbackParams) -> None:
        self._params = params
        self._stop = False

    def original_args(self) -> CallbackParams:
        return self._params

    def request_stop(self) -> None:
        self._stop = True

    def get_stop_requested(self) -> bool:
        return self._stop


class Callback:
    """Base class: override the hooks you need (MindSpore 2.x's ``on_train_*`` names; the
    older ``begin``/``epoch_begin``/``step_end``/... are called too)."""

    def on_train_begin(self, run_context: RunContext) -> None:
        self.begin(run_context)

    def on_train_epoch_begin(self, run_context: RunContext) -> None:
        self.epoch_begin(run_context)

    def on_train_step_begin(self, run_context: RunContext) -> None:
        self.step_begin(run_context)

    def on_train_step_end(self, run_context: RunContext) -> None:
        self.step_end(run_context)

    def on_train_epoch_end(self, run_context: RunContext) -> None:
        self.epoch_end(run_context)

    def on_train_end(self, run_context: RunContext) -> None:
        self.end(run_context)

    def begin(self, run_context: RunContext) -> None:
        pass

    def epoch_begin(self, run_context: RunContext) -> None:
        pass

    def step_begin(self, run_context: RunContext) -> None:
        pass

    def step_end(self, run_context: RunContext) -> None:
        pass

    def epoch_end(self, run_context: RunContext) -> None:
        pass

    def end(self, run_context: RunContext) -> None:
        pass


def _step_in_epoch(p: CallbackParams) -> int:
    return (p.cur_step_num - 1) % p.batch_num + 1


class LossMonitor(Callback):
    """Print ``epoch: E step: S, loss is L`` every ``per_print_times`` steps (rank 0)."""

    def __init__(self, per_print_times: int = 1) -> None:
        if isinstance(per_print_times, bool) or not isinstance(per_print_times, int) \
                or per_print_times < 0:
            raise ValueError(f"LossMonitor: per_print_times must be an int >= 0, got "
                             f"{per_print_times!r}")
        self._every = per_print_times

    def on_train_step_end(self, run_context: RunContext) -> None:
        p = run_context.original_args()
        loss = float(np.asarray(p.net_outputs))
        if not np.isfinite(loss):
            raise ValueError(f"epoch: {p.cur_epoch_num} step: {_step_in_epoch(p)}. Invalid "
                             f"loss {loss}, terminating training.")
        if self._every and p.cur_step_num % self._every == 0 and comm.get_rank() == 0:
            print(f"epoch: {p.cur_epoch_num} step: {_step_in_epoch(p)}, loss is {loss}",
                  flush=True)


class TimeMonitor(Callback):
    """Print each epoch's time and its time per step (rank 0)."""

    def __init__(self, data_size: int | None = None) -> None:
        self._size = data_size
        self._start = 0.0

    def on_train_epoch_begin(self, run_context: RunContext) -> None:
        self._start = time.perf_counter()

    def on_train_epoch_end(self, run_context: RunContext) -> None:
        ms = (time.perf_counter() - self._start) * 1e3
        steps = self._size or run_context.original_args().batch_num
        if comm.get_rank() == 0 and steps:
            print(f"epoch time: {ms:.3f} ms, per step time: {ms / steps:.3f} ms", flush=True)


@dataclass(frozen=True)
class CheckpointConfig:
    """When :class:`ModelCheckpoint` saves (every ``save_checkpoint_steps`` steps) and how
    many it keeps (``keep_checkpoint_max``, the newest)."""

    save_checkpoint_steps: int = 1
    save_checkpoint_seconds: int = 0
    keep_checkpoint_max: int = 5
    keep_checkpoint_per_n_minutes: int = 0
    #: MindSpore's: whether to merge the slices into whole parameters on save. simpar saves
    #: each rank's blocks either way (merge them with ``python -m simpar.checkpoint merge``).
    integrated_save: bool = True
    async_save: bool = False

    def __post_init__(self) -> None:
        for name in ("integrated_save", "async_save"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"CheckpointConfig: {name} must be a bool, got "
                                f"{getattr(self, name)!r}")
        for name in ("save_checkpoint_steps", "keep_checkpoint_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"CheckpointConfig: {name} must be a positive int, got "
                                 f"{value!r}")
        if self.save_checkpoint_seconds or self.keep_checkpoint_per_n_minutes:
            raise NotImplementedError("CheckpointConfig: simpar saves by steps only "
                                      "(save_checkpoint_seconds and "
                                      "keep_checkpoint_per_n_minutes must stay 0)")


class ModelCheckpoint(Callback):
    """Save the training state every ``config.save_checkpoint_steps`` steps into
    ``directory/{prefix}-{epoch}_{step}`` (MindSpore's ``{prefix}-{epoch}_{step}.ckpt``
    names, as a simpar checkpoint directory: every rank writes its own blocks; see
    :func:`simpar.checkpoint.save_training`), keeping the newest ``keep_checkpoint_max``."""

    def __init__(self, prefix: str = "CKP", directory: str | None = None,
                 config: CheckpointConfig | None = None) -> None:
        if not isinstance(prefix, str) or not prefix or "/" in prefix:
            raise ValueError(f"ModelCheckpoint: prefix must be a non-empty name without '/', "
                             f"got {prefix!r}")
        if directory is not None and not isinstance(directory, str):
            raise TypeError(f"ModelCheckpoint: directory must be a str or None, got "
                            f"{directory!r}")
        if config is not None and not isinstance(config, CheckpointConfig):
            raise TypeError(f"ModelCheckpoint: config must be a CheckpointConfig, got "
                            f"{config!r}")
        self.prefix, self.directory = prefix, os.path.abspath(directory or os.getcwd())
        self.config = config or CheckpointConfig()
        self.saved: list[str] = []

    def on_train_step_end(self, run_context: RunContext) -> None:
        p = run_context.original_args()
        if p.cur_step_num % self.config.save_checkpoint_steps == 0:
            self._save(p)

    def on_train_end(self, run_context: RunContext) -> None:
        """The last step too, as MindSpore's ``ModelCheckpoint`` saves it when training
        ends."""
        p = run_context.original_args()
        if p.cur_step_num and p.cur_step_num % self.config.save_checkpoint_steps:
            self._save(p)

    def _save(self, p: CallbackParams) -> None:
        path = os.path.join(self.directory,
                            f"{self.prefix}-{p.cur_epoch_num}_{_step_in_epoch(p)}")
        save_training(p.train_network, path)   # collective: every rank writes its blocks
        if path in self.saved:                 # saved again (a second train): one entry
            self.saved.remove(path)
        self.saved.append(path)
        while len(self.saved) > self.config.keep_checkpoint_max:
            old = self.saved.pop(0)
            comm.barrier()
            if comm.get_rank() == 0:
                shutil.rmtree(old, ignore_errors=True)


class Model:
    """``Model(network, loss_fn=None, optimizer=None, metrics=None)``: :meth:`train` one step
    per batch; :meth:`eval` the ``metrics`` (``{"accuracy", "loss"}``, or {name: Metric})
    over a dataset, in evaluation mode and in parallel (:mod:`simpar.mindspore.evaluate`).
    Without ``loss_fn`` the network computes its loss itself, and ``eval`` needs one."""

    def __init__(self, network: Cell, loss_fn: Cell | None = None,
                 optimizer: Optimizer | None = None, metrics: Any = None,
                 eval_network: Any = None, **kwargs: Any) -> None:
        if not isinstance(network, Cell):
            raise TypeError(f"Model: network must be a Cell, got {network!r}")
        if loss_fn is not None and not isinstance(loss_fn, Cell):
            raise TypeError(f"Model: loss_fn must be a Cell or None, got {loss_fn!r}")
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"Model: optimizer must be a simpar optimizer (nn.Momentum, "
                            f"nn.SGD, nn.Adam, ...): simpar's Model trains only, got "
                            f"{optimizer!r}")
        if eval_network is not None:
            raise NotImplementedError("Model: eval_network is not implemented by simpar: "
                                      "Model.eval runs the network with loss_fn")
        if kwargs:
            raise NotImplementedError(f"Model: simpar does not implement {sorted(kwargs)}")
        self.network = network
        self.metrics = {} if metrics is None else metrics_of(metrics)
        self.train_network = nn.TrainOneStepCell(
            network if loss_fn is None else WithLossCell(network, loss_fn), optimizer)
        self._evaluator = None if loss_fn is None else Evaluator(network, loss_fn,
                                                                 self.train_network)

    def train(self, epoch: int, train_dataset: Dataset,
              callbacks: Callback | Sequence[Callback] | None = None,
              dataset_sink_mode: bool = False, sink_size: int = -1,
              initial_epoch: int = 0) -> None:
        """Train epochs ``initial_epoch + 1 .. epoch`` over ``train_dataset``, whose rows must
        be (data, label)."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 1:
            raise ValueError(f"Model.train: epoch must be a positive int, got {epoch!r}")
        if not isinstance(train_dataset, Dataset):
            raise TypeError(f"Model.train: train_dataset must be a mindspore.dataset Dataset, "
                            f"got {train_dataset!r}")
        if isinstance(initial_epoch, bool) or not isinstance(initial_epoch, int) \
                or not 0 <= initial_epoch < epoch:
            raise ValueError(f"Model.train: initial_epoch must be an int in [0, {epoch}), got "
                             f"{initial_epoch!r}")
        if len(train_dataset.get_col_names()) != 2:
            raise ValueError(f"Model.train: the dataset's rows must be (data, label), got "
                             f"columns {train_dataset.get_col_names()}")
        if train_dataset.last_batch_short():
            raise ValueError(f"Model.train: the dataset's last batch is shorter than the "
                             f"others (batch size {train_dataset.get_batch_size()}), and a "
                             "step's program is built for one batch shape; batch with "
                             "drop_remainder=True")
        if dataset_sink_mode:
            warnings.warn("Model.train: dataset_sink_mode=True is not honoured by simpar: it "
                          "runs one step per batch either way", NotHonouredWarning,
                          stacklevel=2)
        cbs = [] if callbacks is None else (
            [callbacks] if isinstance(callbacks, Callback) else list(callbacks))
        if not all(isinstance(cb, Callback) for cb in cbs):
            raise TypeError(f"Model.train: callbacks must be Callbacks, got {callbacks!r}")
        self.train_network.set_train(True)
        params = CallbackParams(self.train_network, epoch, train_dataset.get_dataset_size(),
                                cur_step_num=initial_epoch * train_dataset.get_dataset_size())
        run = RunContext(params)
        for cb in cbs:
            cb.on_train_begin(run)
        for e in range(initial_epoch, epoch):
            params.cur_epoch_num = e + 1
            for cb in cbs:
                cb.on_train_epoch_begin(run)
            for data, label in train_dataset.epoch(e):
                for cb in cbs:
                    cb.on_train_step_begin(run)
                loss = self.train_network(data, label)
                params.cur_step_num += 1
                params.net_outputs = Tensor(np.asarray(loss))
                for cb in cbs:
                    cb.on_train_step_end(run)
                if run.get_stop_requested():
                    break
            for cb in cbs:
                cb.on_train_epoch_end(run)
            if run.get_stop_requested():
                break
        for cb in cbs:
            cb.on_train_end(run)

    def eval(self, valid_dataset: Dataset, callbacks: Any = None,
             dataset_sink_mode: bool = False) -> dict[str, float]:
        """{metric name: value} over one epoch of ``valid_dataset`` (rows (data, label)), the
        network in evaluation mode; the same on every rank."""
        if not isinstance(valid_dataset, Dataset):
            raise TypeError(f"Model.eval: valid_dataset must be a mindspore.dataset Dataset, "
                            f"got {valid_dataset!r}")
        if self._evaluator is None:
            raise ValueError("Model.eval needs the Model's loss_fn (the network alone gives "
                             "no loss to evaluate)")
        if not self.metrics:
            raise ValueError("Model.eval: the Model has no metrics; pass metrics={'accuracy'} "
                             "(or 'loss', or {name: Metric})")
        if callbacks is not None:
            raise NotImplementedError("Model.eval: callbacks are not implemented by simpar")
        for metric in self.metrics.values():
            metric.clear()
        for data, label in valid_dataset.epoch(0):
            loss, logits, labels = self._evaluator(data, label)
            for metric in self.metrics.values():
                metric.update(logits, labels, loss)
        return {name: metric.eval() for name, metric in self.metrics.items()}

    def predict(self, *predict_data: Any) -> Any:
        raise NotImplementedError("Model.predict is not implemented by simpar: it trains only")


__getattr__ = missing("mindspore.train", {
    "Precision": "train.Accuracy or train.Loss",
    "Recall": "train.Accuracy or train.Loss",
    "F1": "train.Accuracy or train.Loss",
    "MAE": "train.Loss",
    "MSE": "train.Loss",
    "SummaryCollector": "python -m simpar.train --report DIR (simpar's run report)",
    "LearningRateScheduler": "a fixed learning rate on the optimizer",
    "EarlyStopping": "run_context.request_stop() in a Callback of your own",
    "load_checkpoint": "simpar.checkpoint.load_training",
    "save_checkpoint": "ModelCheckpoint, or simpar.checkpoint.save_training",
})
