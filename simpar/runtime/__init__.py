"""simpar.runtime: lowering a traced graph to a per-rank ParallelProgram, and running it."""

from simpar.runtime.lowered import OpStep
from simpar.runtime.lowering import NothingParallelWarning, build_program, lower
from simpar.runtime.memory import MemoryWatch, watching_memory
from simpar.runtime.program import ParallelProgram
from simpar.runtime.program_schedule import ProgramStep, Role

__all__ = ["MemoryWatch", "NothingParallelWarning", "OpStep", "ParallelProgram", "ProgramStep",
           "Role", "build_program", "lower", "watching_memory"]
