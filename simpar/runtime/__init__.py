"""simpar.runtime: lowering a traced graph to a per-rank ParallelProgram, and running it."""

from simpar.runtime.program import (
    MemoryWatch,
    NothingParallelWarning,
    OpStep,
    ParallelProgram,
    ProgramStep,
    Role,
    build_program,
    lower,
    watching_memory,
)

__all__ = ["MemoryWatch", "NothingParallelWarning", "OpStep", "ParallelProgram", "ProgramStep",
           "Role", "build_program", "lower", "watching_memory"]
