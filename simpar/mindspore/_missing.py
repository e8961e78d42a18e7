"""What a name MindSpore documents and simpar does not implement raises: a
``NotImplementedError`` that names it and says what to use instead, where an unknown name
would raise an ``AttributeError`` that reads like a typo."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NoReturn


def missing(module: str, documented: Mapping[str, str]) -> Callable[[str], NoReturn]:
    """A module ``__getattr__`` for ``module`` (e.g. ``"mindspore.nn"``): the names in
    ``documented`` ({name: what to use instead}) raise NotImplementedError, others
    AttributeError."""

    def __getattr__(name: str) -> NoReturn:
        if name in documented:
            raise NotImplementedError(f"{module}.{name} is MindSpore's, but simpar does not "
                                      f"implement it: {documented[name]}")
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
