"""``mindspore.ops``: simpar's primitives under MindSpore's names (``ops.MatMul()``,
``ops.ReLU()``, ...), each with ``.shard()``. MindSpore's functional forms (``ops.matmul``)
and the primitives simpar lacks raise ``NotImplementedError`` saying what to use."""

from __future__ import annotations

from typing import NoReturn

from simpar import ops as _ops
from simpar.ops import *  # noqa: F403  (every primitive simpar has, under MindSpore's name)

__all__ = list(_ops.__all__)

#: MindSpore's primitives and helpers that tutorials use and simpar does not have.
_DOCUMENTED = {
    "GradOperation": "simpar differentiates the whole step: nn.TrainOneStepCell or train.Model",
    "value_and_grad": "nn.TrainOneStepCell(...).value_and_grad(data, label)",
    "grad": "nn.TrainOneStepCell(...).value_and_grad(data, label)",
    "composite": "the primitives, each with .shard()",
    "functional": "the primitives, each with .shard()",
    "operations": "the primitives here: ops.MatMul(), ops.ReLU(), ...",
    "AllReduce": "simpar inserts the collectives a strategy needs; simpar.comm.all_reduce runs "
                 "one by hand",
    "AllGather": "simpar inserts the collectives a strategy needs; simpar.comm.all_gather runs "
                 "one by hand",
    "Print": "print() in construct runs at trace time; inspect values with run_op",
    "Depend": "nothing: simpar runs a program in its traced order",
}
_BY_LOWER = {name.lower(): name for name in _ops.__all__}


def __getattr__(name: str) -> NoReturn:
    if name in _DOCUMENTED:
        raise NotImplementedError(f"mindspore.ops.{name} is MindSpore's, but simpar does not "
                                  f"implement it: {_DOCUMENTED[name]}")
    primitive = _BY_LOWER.get(name.replace("_", "").lower())
    if primitive is not None:
        raise NotImplementedError(f"mindspore.ops.{name} (MindSpore's functional form) is not "
                                  f"implemented by simpar: use the primitive "
                                  f"ops.{primitive}() in a Cell's __init__, then call it in "
                                  "construct")
    raise AttributeError(f"module 'mindspore.ops' has no attribute {name!r} (simpar's "
                         f"primitives: {', '.join(sorted(_ops.__all__))})")
