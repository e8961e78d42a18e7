"""simpar.runtime: lowering a traced graph to a per-rank ParallelProgram, and running it."""

from simpar.runtime.program import (
    NothingParallelWarning,
    OpStep,
    ParallelProgram,
    build_program,
    lower,
)

__all__ = ["NothingParallelWarning", "OpStep", "ParallelProgram", "build_program", "lower"]
