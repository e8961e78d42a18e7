"""The key-spec engine: how a context call (``set_auto_parallel_context``,
``set_algo_parameters``, ``set_cost_model_context``) validates its keys and stages its values.

A :class:`KeySpec` says what one key accepts and where its value goes; :func:`stage_call`
validates a whole call against a table of them and returns the new state without touching the
old, so a call that raises changes nothing. Errors name the function, the key, the value and
what is allowed. This module imports nothing from simpar (and no MPI).
"""

from __future__ import annotations

import difflib
import numbers
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

__all__ = ["Bounds", "ContextError", "ContextTypeError", "KeySpec", "NotHonouredWarning",
           "Writes", "check_key", "has_kind", "spec_defaults", "stage_call", "type_error",
           "unknown_key", "validate_dict", "validate_value", "warn_not_honoured"]


class ContextError(ValueError):
    """A context key or value that is not allowed (unknown key, out of range, unknown mode)."""

    __module__ = "simpar.context"   # where users import it from


class ContextTypeError(TypeError):
    """A context value of the wrong type, e.g. ``gradients_mean=1``."""

    __module__ = "simpar.context"


class NotHonouredWarning(UserWarning):
    """A key was set to a value that simpar accepts (MindSpore's) but does not act on yet."""

    __module__ = "simpar.context"


@dataclass(frozen=True, slots=True)
class Bounds:
    """A range of numbers, e.g. ``[1, 4096]``, ``(0, 1]`` or ``[0, inf)``."""

    lo: float
    hi: float
    lo_open: bool = False
    hi_open: bool = False

    def __contains__(self, x: float) -> bool:
        return ((self.lo < x if self.lo_open else self.lo <= x)
                and (x < self.hi if self.hi_open else x <= self.hi))

    def __str__(self) -> str:
        return (f"{'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}"
                f"{')' if self.hi_open else ']'}")


Writes = list[tuple[str, Any]]  # (field, value); a field is a key or "key.sub_key"


@dataclass(frozen=True, slots=True)
class KeySpec:
    """How one key is validated and where its value goes.

    ``kind`` is the Python type the value must have; ``None`` leaves everything to ``check``.
    ``fields`` maps a validated value onto state fields (default: the key itself); it sees
    the state staged so far, and ``late`` keys are staged after all others in the call.
    """

    kind: type | None
    default: Any
    bounds: Bounds | None = None
    choices: Callable[[], Sequence[Any]] | None = None
    allowed: str = ""
    check: Callable[[str, str, Any], Any] | None = None
    fields: Callable[[Any, Mapping[str, Any]], Writes] | None = None
    late: bool = False
    #: Values of the right type that are refused with a reason, e.g. MindSpore's
    #: ``parallel_mode="hybrid_parallel"``: ``((value, why), ...)``.
    unsupported: tuple[tuple[Any, str], ...] = ()


_NOUNS: dict[type, str] = {bool: "a bool", int: "an int", float: "a float", str: "a str"}


def _allowed(spec: KeySpec) -> str:
    if spec.allowed:
        return spec.allowed
    if spec.choices is not None:
        return "one of " + ", ".join(repr(c) for c in spec.choices())
    noun = _NOUNS[spec.kind] if spec.kind is not None else "a valid value"
    return f"{noun} in {spec.bounds}" if spec.bounds is not None else noun


def has_kind(value: object, kind: type) -> bool:
    if isinstance(value, bool) or kind is bool:
        return kind is bool and isinstance(value, bool)
    if kind is int:
        return isinstance(value, numbers.Integral)
    if kind is float:   # an int is taken where a float is (MindSpore's costmodel_beta=50)
        return isinstance(value, numbers.Real)
    return isinstance(value, kind)


def type_error(func: str, key: str, allowed: str, value: object) -> ContextTypeError:
    return ContextTypeError(f"{func}: {key} must be {allowed}, but got {value!r} of type "
                            f"{type(value).__name__}.")


def validate_value(func: str, key: str, spec: KeySpec, value: object) -> Any:
    """Return ``value`` normalised (numpy scalars to Python ones), or raise naming ``key``."""
    if spec.check is not None:
        return spec.check(func, key, value)
    assert spec.kind is not None, key
    if not has_kind(value, spec.kind):
        raise type_error(func, key, _allowed(spec), value)
    plain: Any = spec.kind(value)
    reason = dict(spec.unsupported).get(plain)
    if reason is not None:
        raise ContextError(f"{func}: {key}={plain!r} {reason}.")
    if (spec.bounds is not None and plain not in spec.bounds) or (
        spec.choices is not None and plain not in spec.choices()
    ):
        raise ContextError(f"{func}: {key} must be {_allowed(spec)}, but got {plain!r}.")
    return plain


def unknown_key(func: str, key: str, known: Sequence[str], what: str = "key") -> ContextError:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ContextError(f"{func}: unknown {what} {key!r}{hint}; the known {what}s are "
                        f"{', '.join(sorted(known))}.")


def validate_dict(func: str, key: str, value: object, specs: Mapping[str, KeySpec]
                  ) -> dict[str, Any]:
    """A dict-valued key (``strategy_ckpt_config``, ``parallel_optimizer_config``): each of
    its keys one of ``specs``, each value validated as ``key['sub']``."""
    if not isinstance(value, Mapping):
        raise type_error(func, key, f"a dict with keys from {', '.join(specs)}", value)
    out = {}
    for sub, sub_value in value.items():
        if sub not in specs:
            raise unknown_key(func, str(sub), list(specs), what=f"{key} key")
        out[sub] = validate_value(func, f"{key}[{sub!r}]", specs[sub], sub_value)
    return out


def check_key(func: str, key: object, known: Mapping[str, KeySpec]) -> str:
    """``key`` if it names one of ``known``, else raise naming it (and the closest key)."""
    if not isinstance(key, str):
        raise type_error(func, "the key", "a str", key)
    if key not in known:
        raise unknown_key(func, key, list(known))
    return key


def warn_not_honoured(func: str, specs: Mapping[str, KeySpec], staged: Mapping[str, Any],
                      reasons: Mapping[str, str], warned: set[str]) -> None:
    """Warn once per process (``warned``) for each key of ``reasons`` that ``staged`` sets
    away from its default: simpar accepts the value but does not act on it yet."""
    for key, why in reasons.items():
        if key in specs and key not in warned and staged[key] != specs[key].default:
            warned.add(key)
            warnings.warn(f"{func}: {key}={staged[key]!r} is accepted but not honoured yet: "
                          f"{why}", NotHonouredWarning, stacklevel=3)


def spec_defaults(specs: Mapping[str, KeySpec]) -> dict[str, Any]:
    """Every key's default, e.g. ``{"fully_use_devices": False, ...}``."""
    return {key: spec.default for key, spec in specs.items()}


def stage_call(func: str, keys: Mapping[str, KeySpec], state: Mapping[str, Any],
               kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Validate a whole call and return the new state, leaving ``state`` untouched."""
    for key in kwargs:
        if key not in keys:
            raise unknown_key(func, key, list(keys))
    staged = dict(state)
    written: dict[str, tuple[str, Any]] = {}  # field -> (key, value) that wrote it
    for key in sorted(kwargs, key=lambda k: keys[k].late):
        spec, given = keys[key], kwargs[key]
        value = validate_value(func, key, spec, given)
        writes = spec.fields(value, staged) if spec.fields is not None else [(key, value)]
        for field, new in writes:
            if field in written and _read(staged, field) != new:
                other, other_given = written[field]
                raise ContextError(f"{func}: {other}={other_given!r} and {key}={given!r} "
                                   f"contradict each other; pass only one of them.")
            written[field] = (key, given)
            _write(staged, field, new)
    return staged


def _read(state: Mapping[str, Any], field: str) -> Any:
    key, _, sub = field.partition(".")
    return getattr(state[key], sub) if sub else state[key]


def _write(state: dict[str, Any], field: str, value: Any) -> None:
    key, _, sub = field.partition(".")
    state[key] = replace(state[key], **{sub: value}) if sub else value
