"""simpar.runtime: lowering a traced graph to a per-rank ParallelProgram, and running it."""

from simpar.runtime.program import (
    NothingParallelWarning,
    OpStep,
    ParallelProgram,
    ProgramStep,
    Role,
    build_program,
    lower,
)

__all__ = ["NothingParallelWarning", "OpStep", "ParallelProgram", "ProgramStep", "Role",
           "build_program", "lower"]
