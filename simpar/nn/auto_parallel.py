"""``AutoParallel``: MindSpore 2.x's per-network parallel configuration, as a wrapping Cell.

MindSpore 2.x moves the parallel settings from the process-global
``set_auto_parallel_context`` onto the network: ``AutoParallel(network, parallel_mode=...)``
(``mindspore.parallel.auto_parallel.AutoParallel``) wraps the top-level Cell, and methods on
the wrapper set the rest (``dataset_strategy``, ``enable_gradients_mean``, ``pipeline``, ...).
The Model API trains it as the network with its loss, ``Model(network=AutoParallel(
net_with_loss), optimizer=...)``, which builds a ``TrainOneStepCell`` around it; simpar's
equivalent is::

    parallel_net = AutoParallel(nn.WithLossCell(net, loss), parallel_mode="semi_auto")
    parallel_net.dataset_strategy(((2, 1), (2,)))
    train = nn.TrainOneStepCell(parallel_net, optimizer)
    train(data, label)                  # compiles under parallel_net's settings, then trains

``TrainOneStepCell`` finds the wrapper anywhere in its network (so ``WithLossCell(
AutoParallel(net), loss)``, MindSpore's ``Model(parallel_net, loss_fn=...)``, works too) and
compiles (traces, plans, lowers) inside :meth:`AutoParallel.parallel_context`, which lays the
wrapper's settings over the global context for that compilation only and restores it
afterwards, even on error. Other networks never see them. MindSpore's functional form,
``AutoParallel(train_step)`` around ``value_and_grad``, has no simpar equivalent (simpar has no
functional autodiff); wrapping a ``TrainOneStepCell`` raises and says so.

``parallel_mode`` maps onto simpar's planners: ``"semi_auto"`` is ``semi_auto_parallel``
(``.shard()`` strategies, the rest filled in by sharding propagation);
``"sharding_propagation"`` and ``"recursive_programming"`` are ``auto_parallel`` with that
``search_mode``. simpar-only: any search registered in
:func:`simpar.search.registered_searches` (``"dynamic_programming"`` and ``"exact"`` besides
MindSpore's two) is accepted as ``parallel_mode`` too, as ``auto_parallel`` with that search.

Methods whose feature simpar has (dataset strategy, gradient mean, loss repeated mean,
pipeline stages, optimizer sharding, the param strategy files) set it. Methods whose feature
simpar lacks (MindSpore's other pipeline schedulers, operator strategy files, local norms,
communication fusion settings, Ascend speed-up files)
validate their arguments with MindSpore's rules and raise ``NotImplementedError`` naming the
method and what simpar does instead; none of them is silently ignored.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from simpar import context, graph
from simpar.comm_fusion import check_comm_fusion
from simpar.layout import Layout
from simpar.nn.cell import Cell, Wrapper
from simpar.optimizer_parallel import LEVELS
from simpar.search import registered_searches

__all__ = ["AutoParallel", "OperatorStrategyPathError"]

# MindSpore's parallel_mode values and the (parallel_mode, search_mode) of simpar they plan as.
_MINDSPORE_MODES: dict[str, tuple[str, str | None]] = {
    "semi_auto": ("semi_auto_parallel", None),
    "sharding_propagation": ("auto_parallel", "sharding_propagation"),
    "recursive_programming": ("auto_parallel", "recursive_programming"),
}
_SCHEDULERS = ("1f1b", "gpipe", "seqpipe", "seqvpp", "seqsmartvpp", "zero_bubble_v")
_OPERATOR_FILES = ("operator strategy files (MindSpore's per-operator layout files) are not "
                   "supported; save_param_strategy_file and load_param_strategy_file write "
                   "and read MindSpore's strategy file (strategy_ckpt_config), which holds "
                   "every operator's strategy")

# The wrappers whose settings are in force, innermost last (see AutoParallel.parallel_context).
_ACTIVE: list[AutoParallel] = []


class OperatorStrategyPathError(KeyError, ValueError):
    """A bad ``file_path`` for ``save_operator_strategy_file``/``load_operator_strategy_file``.

    MindSpore raises ``KeyError`` there; simpar raises this, which is both a ``KeyError``
    (MindSpore's code catches it) and a ``ValueError`` (simpar's convention for bad input).
    """

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _check_str(method: str, name: str, value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"For 'AutoParallel.{method}', the argument '{name}' must be str, but "
                        f"got the type : {type(value).__name__} ({value!r}).")
    return value


def _check_bool(method: str, name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"For 'AutoParallel.{method}', the argument '{name}' must be bool type, "
                        f"but got the type : {type(value).__name__} ({value!r}).")
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class AutoParallel(Wrapper):
    """Wrap the top-level network with its parallel configuration (MindSpore 2.x's
    ``mindspore.parallel.auto_parallel.AutoParallel``).

    ``network`` is the Cell to parallelise, normally the network with its loss; train it with
    ``nn.TrainOneStepCell(AutoParallel(...), optimizer)``. ``parallel_mode`` is one of
    ``"semi_auto"`` (default), ``"sharding_propagation"``, ``"recursive_programming"``, or
    (simpar-only) a registered search such as ``"exact"``. The wrapper is transparent: the
    parameters and ops keep the names they have in ``network``, so strategies and checkpoints
    are the same with or without it. Called eagerly (outside a training cell) it runs the
    network on one device, as every simpar Cell does.

    Example, on 4 ranks (``mpirun -n 4``), a Megatron MLP with dp=2 x mp=2: rank 1 holds
    rows 16..31 of ``fc1.weight`` and the batch rows 0..3::

        net = nn.MLP(16, 32, 8)
        presets.megatron_mlp(net, dp=2, mp=2)
        parallel_net = AutoParallel(nn.WithLossCell(net, loss), parallel_mode="semi_auto")
        parallel_net.dataset_strategy(((2, 1), (2,)))
        train = nn.TrainOneStepCell(parallel_net, nn.SGD(net.trainable_params(), 0.1))
        train(x, y)    # global batch of 8; the global context is unchanged afterwards
    """

    network: Cell
    _parallel_mode: str
    _settings: dict[str, Any]

    def __init__(self, network: Cell, parallel_mode: str = "semi_auto") -> None:
        if not isinstance(network, Cell):
            hint = (" MindSpore's functional form, AutoParallel(train_step), has no simpar "
                    "equivalent: wrap the network with its loss instead and train it with "
                    "nn.TrainOneStepCell(AutoParallel(nn.WithLossCell(net, loss)), optimizer)"
                    if callable(network) else "")
            raise TypeError(f"AutoParallel: the argument 'network' must be a simpar Cell (the "
                            f"top-level network, normally with its loss), but got "
                            f"{type(network).__name__}.{hint}")
        if not isinstance(parallel_mode, str):
            raise TypeError(f"AutoParallel: the argument 'parallel_mode' must be a str, one of "
                            f"{_allowed_modes()}, but got {parallel_mode!r} of type "
                            f"{type(parallel_mode).__name__}.")
        if parallel_mode not in _MINDSPORE_MODES and parallel_mode not in registered_searches():
            raise ValueError(f"AutoParallel: the argument 'parallel_mode' must be one of "
                             f"{_allowed_modes()}, but got the value : {parallel_mode!r}.")
        super().__init__(network)
        self._parallel_mode = parallel_mode
        # MindSpore's defaults for the wrapper (not the global context's).
        self._settings = {"dataset_strategy": "data_parallel", "gradients_mean": False,
                          "gradient_fp32_sync": True, "loss_repeated_mean": True,
                          "pipeline_stages": 1, "enable_parallel_optimizer": False,
                          "parallel_optimizer_config": {
                              "optimizer_level": "level1", "parallel_optimizer_threshold": 64,
                              "optimizer_weight_shard_size": -1}}
        self._files: dict[str, Any] = {"load_file": "", "save_file": "",
                                       "only_trainable_params": True}

    # ------------------------------------------------------------------ what it applies
    @property
    def parallel_mode(self) -> str:
        """The ``parallel_mode`` given (MindSpore's name, e.g. ``"semi_auto"``)."""
        return self._parallel_mode

    def parallel_settings(self) -> dict[str, Any]:
        """The ``set_auto_parallel_context`` keys this wrapper puts in force while its network
        compiles (simpar-only). Every key that shapes the program is given, so that the
        global context cannot reach the wrapped network; ``device_num`` and ``global_rank``
        follow the MPI world. ``enable_alltoall`` is True, as MindSpore's ``AutoParallel``
        initialises it.

        >>> from simpar import nn
        >>> ap = AutoParallel(nn.Dense(4, 2), parallel_mode="sharding_propagation")
        >>> s = ap.parallel_settings()
        >>> s["parallel_mode"], s["search_mode"], s["dataset_strategy"]
        ('auto_parallel', 'sharding_propagation', 'data_parallel')
        """
        mode, search = _MINDSPORE_MODES.get(self.parallel_mode,
                                            ("auto_parallel", self.parallel_mode))
        out: dict[str, Any] = {"parallel_mode": mode, **self._settings,
                               "enable_alltoall": True,
                               "strategy_ckpt_config": dict(self._files)}
        if search is not None:
            out["search_mode"] = search
        return out

    @contextmanager
    def parallel_context(self) -> Iterator[context.ParallelContext]:
        """Put this wrapper's settings in force for the ``with`` block (simpar-only).

        ``TrainOneStepCell`` compiles the network inside it (its plan request is built
        there, so the request holds the wrapper's settings); use it yourself to trace or plan
        the wrapped network by hand (``simpar.search.request_from_context`` inside it). On
        leaving, even by an exception, the global context is restored exactly
        (:func:`simpar.context.scoped_auto_parallel_context`).

        >>> from simpar import nn, get_auto_parallel_context
        >>> ap = AutoParallel(nn.Dense(4, 2))
        >>> ap.enable_gradients_mean()
        >>> with ap.parallel_context() as ctx:
        ...     ctx.parallel_mode, ctx.gradients_mean
        ('semi_auto_parallel', True)
        >>> get_auto_parallel_context("parallel_mode"), get_auto_parallel_context("gradients_mean")
        ('stand_alone', False)
        """
        settings = self.parallel_settings()
        with context.scoped_auto_parallel_context(**settings) as ctx:
            _ACTIVE.append(self)
            try:
                yield ctx
            finally:
                _ACTIVE.pop()

    # ------------------------------------------------------------------ as a Cell
    def shard(self, in_strategy: Any, out_strategy: Any = None,
              parameter_plan: Any = None) -> Cell:
        raise ValueError("AutoParallel.shard: the wrapper has no strategy of its own; shard the "
                         "wrapped network or its ops instead (AutoParallel.network.shard(...), "
                         "op.shard(...))")

    def __call__(self, *args: Any) -> Any:
        if graph.tracing() and (not _ACTIVE or _ACTIVE[-1] is not self):
            raise ValueError(
                "AutoParallel: the network was traced outside its parallel settings, which "
                "would be ignored. They apply while nn.TrainOneStepCell compiles it "
                "(nn.TrainOneStepCell(parallel_net, optimizer); only one AutoParallel per "
                "training cell), or inside `with parallel_net.parallel_context():`")
        return self.network(*args)

    def __repr__(self) -> str:
        return f"AutoParallel({self.network!r}, parallel_mode={self.parallel_mode!r})"

    # ------------------------------------------------------------------ MindSpore's settings
    def dataset_strategy(self, config: Any) -> None:
        """Set how the inputs are split: ``"data_parallel"`` (default; dim 0 over every
        device), ``"full_batch"`` (every rank takes the whole batch) or a tuple of cuts per
        input, e.g. ``((2, 1), (2,))`` (on 4 ranks rank 3 takes rows 4..7; the remaining
        factor 2 repeats). Tuples of ``Layout`` are MindSpore's too; simpar takes cuts only.
        """
        method = "AutoParallel.dataset_strategy"
        if config is None:
            raise ValueError(f"For '{method}', the argument 'config' must be 'full_batch', "
                             "'data_parallel' or a tuple of tuples of positive ints, but got "
                             "None (dataset_strategy is none in config!).")
        if isinstance(config, tuple) and any(isinstance(e, Layout) for e in config):
            raise NotImplementedError(
                f"{method}: a tuple of Layout is not supported by simpar, whose dataset "
                "strategies are cuts per dimension; give ((dp, 1), (dp,))-style tuples of ints")
        self._settings["dataset_strategy"] = context.check_dataset_strategy(
            method, "config", config)

    def enable_gradients_mean(self) -> None:
        """Average the gradients over the data-parallel shards (``gradients_mean=True``)."""
        self._settings["gradients_mean"] = True

    def disable_loss_repeated_mean(self) -> None:
        """Seed every replica of a repeated loss with the full cotangent
        (``loss_repeated_mean=False``): the gradients become r times one device's."""
        self._settings["loss_repeated_mean"] = False

    def disable_gradient_fp32_sync(self) -> None:
        """``gradient_fp32_sync=False``. simpar has no float16 gradients, so there is never a
        cast to skip; the context warns so (``NotHonouredWarning``) when the network compiles.
        """
        self._settings["gradient_fp32_sync"] = False

    def enable_fp32_communication(self) -> None:
        """Reduce in float32 or wider. Always so in simpar: its collectives move float32 and
        float64 only (no float16/bfloat16), each in its own dtype, so there is nothing to
        change."""

    def pipeline(self, stages: int = 1, output_broadcast: bool = False,
                 interleave: bool = False, scheduler: str = "1f1b") -> None:
        """Pipeline parallelism (:mod:`simpar.pipeline`): ``stages`` stages, each on
        ``device_num / stages`` ranks; ``interleave`` runs each stage's Cells in chunks by
        their ``pipeline_segment`` (virtual stages); ``scheduler`` orders the micro-batches:
        ``"1f1b"`` or ``"gpipe"`` (MindSpore's other schedulers raise
        ``NotImplementedError``). The loss reaches every rank whatever
        ``output_broadcast`` says."""
        method = "pipeline"
        if not _is_int(stages):
            raise TypeError(f"For 'AutoParallel.pipeline', the argument 'stages' must be int "
                            f"type, but got the type : {type(stages).__name__} ({stages!r}).")
        if stages <= 0:
            raise ValueError(f"For 'AutoParallel.pipeline', the argument 'stages' must be "
                             f"larger than zero, but got value: {stages}.")
        _check_bool(method, "output_broadcast", output_broadcast)
        _check_bool(method, "interleave", interleave)
        _check_str(method, "scheduler", scheduler)
        if scheduler not in _SCHEDULERS:
            raise ValueError(f"For 'AutoParallel.pipeline', the argument 'scheduler' must be "
                             f"one of {list(_SCHEDULERS)}, but got the value : {scheduler!r}.")
        if scheduler not in context.PIPELINE_SCHEDULERS:
            raise NotImplementedError(
                f"AutoParallel.pipeline: scheduler={scheduler!r} is MindSpore's, but simpar "
                f"runs {' and '.join(repr(x) for x in context.PIPELINE_SCHEDULERS)} only")
        self._settings["pipeline_stages"] = stages
        self._settings["pipeline_config"] = {"pipeline_interleave": interleave,
                                             "pipeline_scheduler": scheduler}

    def get_pipeline_stages(self) -> int:
        """The number of pipeline stages :meth:`pipeline` set (1 without)."""
        return int(self._settings["pipeline_stages"])

    def hsdp(self, shard_size: int = -1, threshold: int = 64,
             optimizer_level: str = "level1") -> None:
        """Optimizer parallel (MindSpore's ``enable_parallel_optimizer``): each trainable
        parameter that ranks hold alike is stored, updated and has its gradient reduced in
        slices over ``shard_size`` of those ranks (-1: all of them); parameters under
        ``threshold`` KB stay whole; ``optimizer_level`` as :mod:`simpar.optimizer_parallel`
        describes. The arguments are checked as MindSpore checks them."""
        if not _is_int(shard_size) or (shard_size <= 0 and shard_size != -1):
            raise ValueError(f"For 'AutoParallel.hsdp', the argument 'shard_size' must be a "
                             f"positive integer or -1, but got {shard_size!r}.")
        if not _is_int(threshold) or threshold < 0:
            raise ValueError(f"For 'AutoParallel.hsdp', the argument 'threshold' must be a "
                             f"positive integer or 0, but got {threshold!r}.")
        if optimizer_level not in LEVELS:
            raise ValueError(f"For 'AutoParallel.hsdp', the argument 'optimizer_level' must be "
                             f"one of {list(LEVELS)}, but got {optimizer_level!r}.")
        self._settings["enable_parallel_optimizer"] = True
        # Every key given, so that the global context cannot reach the wrapped network.
        self._settings["parallel_optimizer_config"] = {
            "optimizer_level": optimizer_level, "parallel_optimizer_threshold": int(threshold),
            "optimizer_weight_shard_size": int(shard_size)}

    def comm_fusion(self, config: dict[str, Any] | None) -> None:
        """How the gradient (Mirror) AllReduces are fused, as the context's ``comm_fusion``
        (:mod:`simpar.comm_fusion`): ``{"allreduce": {"mode": "auto" | "size" | "index",
        "config": ...}, "openstate": bool}``; ``None`` or ``{}`` leave the default (every
        gradient of a group of ranks in one AllReduce). AllGather and ReduceScatter fusion
        raise ``NotImplementedError``."""
        if config is not None and not isinstance(config, dict):
            raise TypeError(f"For 'AutoParallel.comm_fusion', the argument 'config' must be "
                            f"dict, but got the type : {type(config).__name__} ({config!r}).")
        if config:
            check_comm_fusion("AutoParallel.comm_fusion", "config", config)
            self._settings["comm_fusion"] = config

    def load_param_strategy_file(self, file_path: str) -> None:
        """Plan from a strategy file instead of searching (MindSpore's
        ``strategy_ckpt_config["load_file"]`` for this network): its strategies, checked
        against the network when it compiles (:func:`simpar.strategy_file.load_strategy`)."""
        _check_str("load_param_strategy_file", "file_path", file_path)
        self._files["load_file"] = file_path

    def save_param_strategy_file(self, file_path: str) -> None:
        """Save the network's strategies when it compiles (``strategy_ckpt_config
        ["save_file"]``), as MindSpore's JSON strategy file."""
        _check_str("save_param_strategy_file", "file_path", file_path)
        self._files["save_file"] = file_path

    def disable_strategy_file_only_for_trainable_params(self) -> None:
        """Saved strategy files lay out every parameter, not only the trainable ones
        (``strategy_ckpt_config["only_trainable_params"] = False``)."""
        self._files["only_trainable_params"] = False

    def save_operator_strategy_file(self, file_path: str) -> None:
        """Save the operator strategies in MindSpore's per-operator layout file: not in simpar
        (``save_param_strategy_file`` writes every operator's strategy). ``file_path`` must be
        an absolute path ending in ``.json``."""
        _check_operator_strategy_path("save_operator_strategy_file", file_path)
        raise NotImplementedError(f"AutoParallel.save_operator_strategy_file: {_OPERATOR_FILES}")

    def load_operator_strategy_file(self, file_path: str) -> None:
        """Load MindSpore's per-operator layout file: not in simpar
        (``load_param_strategy_file`` reads every operator's strategy). ``file_path`` must be an
        absolute path ending in ``.json``."""
        _check_operator_strategy_path("load_operator_strategy_file", file_path)
        raise NotImplementedError(f"AutoParallel.load_operator_strategy_file: {_OPERATOR_FILES}")

    def no_init_parameters_in_compile(self) -> None:
        """Leave the parameters uninitialised at compile time: not in simpar."""
        raise NotImplementedError(
            "AutoParallel.no_init_parameters_in_compile: simpar initialises each rank's "
            "parameter blocks (only its own shards) when the network compiles; deferring that "
            "serves loading a checkpoint afterwards, and distributed checkpoints are not built "
            "yet")

    def set_group_ckpt_save_file(self, file_path: str) -> None:
        """Save the communication groups to a file: not in simpar."""
        _check_str("set_group_ckpt_save_file", "file_path", file_path)
        raise NotImplementedError(
            "AutoParallel.set_group_ckpt_save_file: simpar writes no communication-group file; "
            "every collective's group is listed in train.program.schedule(rank)")

    def print_local_norm(self) -> None:
        """Print the local norms: not in simpar."""
        raise NotImplementedError(_LOCAL_NORM.format("print_local_norm"))

    def dump_local_norm(self, file_path: str) -> None:
        """Write the local norms to files: not in simpar."""
        _check_str("dump_local_norm", "file_path", file_path)
        raise NotImplementedError(_LOCAL_NORM.format("dump_local_norm"))

    def enable_device_local_norm(self) -> None:
        """Print the device local norms: not in simpar."""
        raise NotImplementedError(_LOCAL_NORM.format("enable_device_local_norm"))

    def transformer_opt(self, file_path: str | None) -> None:
        """Ascend's parallel speed-up JSON (communication/computation overlap): ``None`` or
        ``""`` (off) is accepted; a file raises ``NotImplementedError``."""
        if file_path is not None and not isinstance(file_path, str):
            raise TypeError(f"For 'AutoParallel.transformer_opt', the argument 'file_path' must "
                            f"be str or None, but got the type : {type(file_path).__name__} "
                            f"({file_path!r}).")
        if file_path:
            raise NotImplementedError(
                "AutoParallel.transformer_opt: simpar runs each collective when its step "
                "comes (program.schedule(rank)) and has none of the Ascend overlap or fusion "
                f"optimisations that parallel_speed_up.json switches; got {file_path!r}")


_LOCAL_NORM = ("AutoParallel.{}: simpar does not compute local norms; the gradients of the "
               "last step are in train.last_grads (this rank's shards)")


def _allowed_modes() -> str:
    extra = [s for s in registered_searches() if s not in _MINDSPORE_MODES]
    return f"{list(_MINDSPORE_MODES)} (MindSpore's), or a search simpar has registered " \
           f"{extra} (simpar-only)"


def _check_operator_strategy_path(method: str, file_path: object) -> None:
    _check_str(method, "file_path", file_path)
    assert isinstance(file_path, str)
    if not os.path.isabs(file_path):
        raise OperatorStrategyPathError(f"For 'AutoParallel.{method}', the argument 'file_path' "
                                        f"must be an absolute path, but got {file_path!r}.")
    if os.path.splitext(file_path)[1] != ".json":
        raise OperatorStrategyPathError(f"For 'AutoParallel.{method}', the argument 'file_path' "
                                        f"must end in .json (File type must be .json), but got "
                                        f"{file_path!r}.")
