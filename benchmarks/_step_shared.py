"""What benchmarks/step.py's worker jobs share: the Megatron MLP's sizes, its seeded initial
weights and batches, and the worker's end of the control channel.

Only numpy and the standard library: the PyTorch worker (benchmarks/_dtensor_step.py) imports
this module without simpar, whose import sets threads, the MPI wait policy and malloc for the
process.

The orchestrator (``python benchmarks/step.py``) listens on a local TCP port named by
``SIMPAR_STEP_CONTROL`` and every process of every job connects to it. A worker waits for its
next command in a blocking socket read, so an idle job takes no CPU from the job being timed
(a rank waiting in an MPI Barrier would poll, even with MPICH's yielding wait).
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from time import perf_counter
from typing import Any

import numpy as np

__all__ = ["BATCH", "CHECK_STEPS", "CONTROL_ENV", "FFN", "HIDDEN", "LR", "N_BATCHES", "SEED",
           "Channel", "Variant", "mlp_batch", "mlp_weights", "serve"]

BATCH, HIDDEN, FFN = 64, 1024, 4096
LR = 0.1
SEED = 0
N_BATCHES = 4          # step k trains on batch k % N_BATCHES
CHECK_STEPS = 3        # the losses every variant reports before timing, compared across jobs
CONTROL_ENV = "SIMPAR_STEP_CONTROL"


def mlp_weights(seed: int = SEED) -> dict[str, np.ndarray]:
    """The MLP's global float32 parameters, named as in ``simpar.nn.MLP`` (fc1 1024 -> 4096,
    fc2 4096 -> 1024, weights (out, in)); the same arrays in every process."""
    rng = np.random.default_rng(seed)
    return {"fc1.weight": rng.normal(0, 0.02, (FFN, HIDDEN)).astype(np.float32),
            "fc1.bias": rng.normal(0, 0.02, (FFN,)).astype(np.float32),
            "fc2.weight": rng.normal(0, 0.02, (HIDDEN, FFN)).astype(np.float32),
            "fc2.bias": rng.normal(0, 0.02, (HIDDEN,)).astype(np.float32)}


def mlp_batch(k: int, seed: int = SEED) -> tuple[np.ndarray, np.ndarray]:
    """Global batch ``k % N_BATCHES``: input (64, 1024) and MSE target (64, 1024), float32."""
    rng = np.random.default_rng([seed, 1, k % N_BATCHES])
    return (rng.standard_normal((BATCH, HIDDEN), dtype=np.float32),
            rng.standard_normal((BATCH, HIDDEN), dtype=np.float32))


@dataclass(frozen=True, slots=True)
class Variant:
    """One timed step: ``step(k)`` trains on batch ``k`` and returns the global loss.
    ``comm`` says which collectives one step issues (e.g. "AllReduce x1")."""

    step: Callable[[int], float]
    comm: str


class Channel:
    """This process's line to the orchestrator: one JSON object per line each way."""

    def __init__(self) -> None:
        address = os.environ.get(CONTROL_ENV, "")
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise SystemExit(f"{CONTROL_ENV} must be host:port (set by python "
                             f"benchmarks/step.py, which starts this worker), got {address!r}")
        self._sock = socket.create_connection((host, int(port)))
        self._file = self._sock.makefile("rw", encoding="utf-8")

    def send(self, message: Mapping[str, Any]) -> None:
        self._file.write(json.dumps(message) + "\n")
        self._file.flush()

    def recv(self) -> dict[str, Any]:
        line = self._file.readline()
        if not line:
            raise SystemExit("the orchestrator closed the control channel")
        message: dict[str, Any] = json.loads(line)
        return message

    def close(self) -> None:
        self._file.close()
        self._sock.close()


def serve(job: str, rank: int, size: int, variants: Mapping[str, Variant],
          barrier: Callable[[], None], info: Mapping[str, Any]) -> None:
    """Report this process's variants, then run what the orchestrator asks until it says quit.

    Before connecting, every variant trains :data:`CHECK_STEPS` untimed steps from the
    initial weights; their losses go to the orchestrator, which compares them across variants
    and jobs. ``{"cmd": "run", "variant": v, "steps": n}`` runs ``n`` steps of ``v``, each
    after ``barrier()``, and answers this process's seconds per step (the orchestrator takes
    the slowest rank's per step) and the last loss.
    """
    losses = {name: [v.step(k) for k in range(CHECK_STEPS)] for name, v in variants.items()}
    done = dict.fromkeys(variants, CHECK_STEPS)
    channel = Channel()
    channel.send({"job": job, "rank": rank, "size": size, "info": dict(info),
                  "variants": {name: {"losses": losses[name], "comm": v.comm}
                               for name, v in variants.items()}})
    while True:
        message = channel.recv()
        if message["cmd"] == "quit":
            channel.close()
            return
        name, steps = message["variant"], int(message["steps"])
        step = variants[name].step
        times, loss = [], float("nan")
        for _ in range(steps):
            barrier()
            start = perf_counter()
            loss = step(done[name])
            times.append(perf_counter() - start)
            done[name] += 1
        channel.send({"times": times, "loss": loss})
