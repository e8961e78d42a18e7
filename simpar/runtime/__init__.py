"""simpar.runtime: lowering a traced graph to a per-rank ParallelProgram, and running it."""

from simpar.runtime.program import OpStep, ParallelProgram, lower

__all__ = ["OpStep", "ParallelProgram", "lower"]
