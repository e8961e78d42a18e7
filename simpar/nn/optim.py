"""Optimizers that update parameter shards in place: every update is elementwise, so the
optimizer state has exactly its parameter's layout and no communication is needed.

The same code updates global arrays on one device, which is how the single-device reference
matches the parallel run number for number. Names and update rules follow MindSpore's
``nn.SGD``, ``nn.Momentum``, ``nn.Adam``; ``AdamW`` is decoupled weight decay with bias
correction (Loshchilov & Hutter; PyTorch's AdamW).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from simpar.nn.cell import Parameter

__all__ = ["SGD", "Adam", "AdamW", "Momentum", "Optimizer"]


def _check_positive(name: str, value: float, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")
    return float(value)


class Optimizer:
    """Base: holds hyper-parameters and per-parameter state shards; ``step`` updates."""

    def __init__(self, params: Sequence[Parameter], learning_rate: float,
                 weight_decay: float = 0.0) -> None:
        given = type(params).__name__
        try:
            params = list(params)
        except TypeError:
            params = []
        if not params or not all(isinstance(p, Parameter) for p in params):
            raise TypeError("optimizer: params must be a non-empty list of Parameters "
                            f"(cell.trainable_params()), got {given}")
        self.parameters = params
        self._names = tuple(p.name for p in params)
        self.learning_rate = _check_positive("learning_rate", learning_rate)
        self.weight_decay = _check_positive("weight_decay", weight_decay, allow_zero=True)
        self.state: dict[str, dict[str, np.ndarray]] = {}
        self.t = 0
        # Scratch arrays per dtype, each as large as the largest parameter of that dtype:
        # an update writes its intermediate products into them rather than into new arrays.
        self._scratch: dict[str, list[np.ndarray]] = {}
        self._largest: dict[str, int] = {}
        self._views: dict[tuple[int, tuple[int, ...], int], np.ndarray] = {}  # into _scratch
        self._first_temps: tuple[np.ndarray, ...] | None = None  # SGD's, one per parameter

    def names(self) -> list[str]:
        return list(self._names)

    def hold_only(self, names: Sequence[str]) -> None:
        """Update only the parameters ``names`` (those this rank holds: a pipeline stage's),
        in the optimizer's order; the state starts afresh."""
        keep = set(names)
        self._names = tuple(n for n in self._names if n in keep)
        self.state = {}

    def init_state(self, shards: dict[str, np.ndarray]) -> None:
        self.state = {name: {k: np.zeros_like(shards[name]) for k in self.slots}
                      for name in self._names}
        self.t = 0
        # New shards may have new shapes (a program rebuilt for another layout).
        self._largest, self._views, self._first_temps = {}, {}, None

    slots: tuple[str, ...] = ()

    def step(self, params: dict[str, np.ndarray], grads: dict[str, np.ndarray]) -> None:
        """Update ``params`` (this rank's shards, in place) with ``grads`` (same layouts)."""
        self._prepare(params)
        update, state = self._update, self.state
        for name in self._names:
            update(params[name], grads[name], state[name])

    def _prepare(self, params: dict[str, np.ndarray]) -> None:
        """What every step does before its updates: the state on the first, then the count."""
        if not self.state:
            self.init_state(params)
        if not self._largest:
            for name in self._names:
                q = params[name]
                self._largest[q.dtype.str] = max(self._largest.get(q.dtype.str, 0), q.size)
        self.t += 1

    def _temp(self, p: np.ndarray, k: int = 0) -> np.ndarray:
        """Scratch array ``k`` shaped like ``p`` (its contents are garbage): the same memory
        from step to step, so an update allocates nothing. Every update computes the same
        products in the same order as with temporaries, so the results are unchanged."""
        key = (p.dtype.num, p.shape, k)   # dtype.str would format a string every call
        view = self._views.get(key)
        if view is None:
            bufs = self._scratch.setdefault(p.dtype.str, [])
            while len(bufs) <= k:
                bufs.append(np.empty(0, p.dtype))
            if bufs[k].size < p.size:
                bufs[k] = np.empty(max(p.size, self._largest.get(p.dtype.str, 0)), p.dtype)
                self._views = {}   # views of the buffer this one replaces
            view = self._views[key] = bufs[k][:p.size].reshape(p.shape)
        return view

    def _update(self, p: np.ndarray, g: np.ndarray, s: dict[str, np.ndarray]) -> None:
        raise NotImplementedError


class SGD(Optimizer):
    """``p -= lr * (g + wd p)``, with optional momentum (MindSpore's nn.SGD)."""

    def __init__(self, params: Sequence[Parameter], learning_rate: float = 0.1,
                 momentum: float = 0.0, weight_decay: float = 0.0) -> None:
        super().__init__(params, learning_rate, weight_decay)
        self.momentum = _check_positive("momentum", momentum, allow_zero=True)
        self.slots = ("v",) if self.momentum else ()

    def step(self, params: dict[str, np.ndarray], grads: dict[str, np.ndarray]) -> None:
        if self.momentum or self.weight_decay:
            super().step(params, grads)
            return
        # Plain SGD, the same products as _update's, with no Python call per parameter
        # between them: on a model of many small shards that call is most of the update.
        self._prepare(params)
        if self._first_temps is None:   # scratch 0 for each parameter, in order, found once
            self._first_temps = tuple(self._temp(params[name]) for name in self._names)
        lr = self.learning_rate
        for name, temp in zip(self._names, self._first_temps):
            p = params[name]
            p -= np.multiply(grads[name], lr, out=temp)

    def _update(self, p: np.ndarray, g: np.ndarray, s: dict[str, np.ndarray]) -> None:
        d = _decayed(self, p, g, 1) if self.weight_decay else g
        if self.momentum:
            s["v"] *= self.momentum
            s["v"] += d
            d = s["v"]
        p -= np.multiply(d, self.learning_rate, out=self._temp(p))


class Momentum(Optimizer):
    """``v = momentum v + (g + wd p); p -= lr v`` (MindSpore's nn.Momentum)."""

    slots = ("v",)

    def __init__(self, params: Sequence[Parameter], learning_rate: float = 0.1,
                 momentum: float = 0.9, weight_decay: float = 0.0) -> None:
        super().__init__(params, learning_rate, weight_decay)
        self.momentum = _check_positive("momentum", momentum, allow_zero=True)

    def _update(self, p: np.ndarray, g: np.ndarray, s: dict[str, np.ndarray]) -> None:
        d = _decayed(self, p, g, 1)
        s["v"] *= self.momentum
        s["v"] += d
        step = np.multiply(s["v"], self.learning_rate, out=self._temp(p))
        p -= step


class Adam(Optimizer):
    """Adam with bias correction and L2 weight decay added to the gradient (nn.Adam)."""

    slots = ("m", "v")

    def __init__(self, params: Sequence[Parameter], learning_rate: float = 1e-3,
                 beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, learning_rate, weight_decay)
        for name, b in (("beta1", beta1), ("beta2", beta2)):
            if isinstance(b, bool) or not isinstance(b, (int, float)):
                raise TypeError(f"Adam: {name} must be a number in [0, 1), got {b!r}")
            if not 0.0 <= b < 1.0:
                raise ValueError(f"Adam: {name} must be in [0, 1), got {b}")
        self.beta1, self.beta2 = beta1, beta2
        self.eps = _check_positive("eps", eps)

    def _direction(self, p: np.ndarray, g: np.ndarray, s: dict[str, np.ndarray]) -> np.ndarray:
        """``corr m / (sqrt(v) + eps)`` after the moments' update, in scratch array 1
        (scratch 0 is free again when it returns)."""
        m, v, t = s["m"], s["v"], self._temp(p, 0)
        m *= self.beta1
        m += np.multiply(g, 1.0 - self.beta1, out=t)
        v *= self.beta2
        np.multiply(g, 1.0 - self.beta2, out=t)
        t *= g
        v += t
        corr = math.sqrt(1.0 - self.beta2 ** self.t) / (1.0 - self.beta1 ** self.t)
        np.sqrt(v, out=t)
        t += self.eps
        d = np.multiply(m, corr, out=self._temp(p, 1))
        d /= t
        return d

    def _update(self, p: np.ndarray, g: np.ndarray, s: dict[str, np.ndarray]) -> None:
        d = self._direction(p, _decayed(self, p, g, 2), s)
        d *= self.learning_rate
        p -= d


class AdamW(Adam):
    """Adam with decoupled weight decay: ``p -= lr (adam_direction + wd p)``."""

    def __init__(self, params: Sequence[Parameter], learning_rate: float = 1e-3,
                 beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
                 weight_decay: float = 0.01) -> None:
        super().__init__(params, learning_rate, beta1, beta2, eps, weight_decay)

    def _update(self, p: np.ndarray, g: np.ndarray, s: dict[str, np.ndarray]) -> None:
        d = self._direction(p, g, s)
        if self.weight_decay:
            d += np.multiply(p, self.weight_decay, out=self._temp(p, 0))
        d *= self.learning_rate
        p -= d


def _decayed(opt: Optimizer, p: np.ndarray, g: np.ndarray, k: int) -> np.ndarray:
    """``g + wd p`` in scratch array ``k`` (``g`` itself without weight decay: the caller's
    gradient is never written to, ``TrainOneStepCell.last_grads`` shows it)."""
    if not opt.weight_decay:
        return g
    d = np.multiply(p, opt.weight_decay, out=opt._temp(p, k))
    d += g
    return d
