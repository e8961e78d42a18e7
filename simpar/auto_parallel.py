"""``from simpar.auto_parallel import AutoParallel``, where MindSpore 2.x users look for it
(``mindspore.parallel.auto_parallel.AutoParallel``; ``simpar.parallel`` is a module of
op-level helpers, so the class sits one level up). It is defined in
:mod:`simpar.nn.auto_parallel`, beside the ``TrainOneStepCell`` that compiles it; this module
only names it.
"""

from simpar.nn.auto_parallel import AutoParallel, OperatorStrategyPathError

__all__ = ["AutoParallel", "OperatorStrategyPathError"]
