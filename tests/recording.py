"""A Model callback for the tests: every step's loss, as simpar.mindspore's Model returned
it."""

from __future__ import annotations

from typing import Any

import simpar.mindspore as ms


class Record(ms.train.Callback):
    """Every step's loss, in order."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_step_end(self, run_context: Any) -> None:
        self.losses.append(float(run_context.original_args().net_outputs))
