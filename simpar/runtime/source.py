"""The generated Python of a rank's executor: its lines and the objects they name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from simpar.ops.kernels import INLINE_NAMES
from simpar.runtime.tapes import rehold, unhold

__all__ = ["Source"]


class Source:
    """Lines of generated Python and the objects they name (the function's globals)."""

    def __init__(self, header: str) -> None:
        self.lines = [header]
        self.names: dict[str, Any] = {"_zeros": np.zeros, "_unhold": unhold,
                                      "_rehold": rehold, **INLINE_NAMES}
        self._bound: dict[int, str] = {}   # id of an object already named -> its name

    def bind(self, prefix: str, obj: Any) -> str:
        """The global name of ``obj`` (named once: a dtype read by every contribution is
        one ``D`` name, not one per line)."""
        name = self._bound.get(id(obj))
        if name is None:
            name = self._bound[id(obj)] = f"{prefix}{len(self.names)}"
            self.names[name] = obj
        return name

    def add(self, line: str) -> None:
        self.lines.append("    " + line)

    def build(self, name: str) -> tuple[Callable[..., Any], str]:
        text = "\n".join(self.lines) + "\n"
        scope = dict(self.names)
        exec(compile(text, f"<simpar executor: {name}>", "exec"), scope)  # noqa: S102
        return scope[name], text
