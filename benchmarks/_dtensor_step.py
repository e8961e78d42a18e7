"""Variant (e) of benchmarks/step.py: PyTorch DTensor's Megatron MLP step over gloo, on CPU.

step.py starts it, one process per rank, as

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 8 benchmarks/_dtensor_step.py

with ``SIMPAR_STEP_CONTROL`` naming its control port; it is not meant to be run alone. The
model is ``nn.Sequential(Linear(1024, 4096), GELU("tanh"), Linear(4096, 1024))``, tensor
parallel through ``parallelize_module`` (ColwiseParallel on the first Linear, RowwiseParallel
on the second) on a 1-D mesh of every rank, trained with ``torch.optim.SGD`` on
``nn.MSELoss``: the same weights, batches and learning rate as the numpy and simpar variants
(benchmarks/_step_shared.py). One intra-op thread and one inter-op thread per rank. While
another job is timed, these processes wait in a blocking socket read; between steps they wait
in gloo's barrier.
"""

# ruff: noqa: E402  (the thread count must be in the environment before torch starts)
from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import torch
import torch.distributed as dist
from _step_shared import FFN, HIDDEN, LR, N_BATCHES, Variant, mlp_batch, mlp_weights, serve
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)


def build() -> tuple[Variant, dict[str, object]]:
    """The DTensor step and what to print about it; every rank of the job calls it."""
    size = dist.get_world_size()
    mesh = init_device_mesh("cpu", (size,))
    model = nn.Sequential(nn.Linear(HIDDEN, FFN), nn.GELU(approximate="tanh"),
                          nn.Linear(FFN, HIDDEN))
    w = mlp_weights()
    with torch.no_grad():
        for k, key in ((0, "fc1"), (2, "fc2")):
            layer = model[k]
            assert isinstance(layer, nn.Linear)
            layer.weight.copy_(torch.from_numpy(w[f"{key}.weight"]))
            layer.bias.copy_(torch.from_numpy(w[f"{key}.bias"]))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    loss_fn = nn.MSELoss()
    batches = [tuple(torch.from_numpy(a) for a in mlp_batch(k)) for k in range(N_BATCHES)]

    def step(k: int) -> float:
        x, target = batches[k % N_BATCHES]
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), target)
        loss.backward()
        opt.step()
        return float(loss.item())

    # Count one step's collectives, then put the weights back: the checked losses must start
    # from the shared initial weights (plain SGD keeps no state to restore).
    saved = {name: p.detach().clone() for name, p in model.named_parameters()}
    with warnings.catch_warnings(), CommDebugMode() as debug:
        # Its module tracker hooks the backward; torch warns that the input needs no gradient.
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        step(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(saved[name])
    counts = {str(op).rsplit(".", 1)[-1]: n for op, n in debug.get_comm_counts().items()}
    comm = ", ".join(f"{op} x{n}" for op, n in sorted(counts.items())) or "none"
    info = {"torch": torch.__version__, "threads": torch.get_num_threads(),
            "interop_threads": torch.get_num_interop_threads(), "backend": dist.get_backend(),
            "numpy": np.__version__}
    return Variant(step, comm), info


def main() -> None:
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    dist.init_process_group("gloo")
    try:
        variant, info = build()
        serve("dtensor", dist.get_rank(), dist.get_world_size(), {"mlp/e": variant},
              dist.barrier, info)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
