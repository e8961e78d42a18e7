"""The pipeline search on GPTs from 1.3B to 1T parameters (issue 31), against Megatron-LM's
configurations priced by the same cost model.

    python benchmarks/pipeline_search.py              # writes "## pipeline_search"
    python benchmarks/search.py --pipelines           # the same
    python benchmarks/pipeline_search.py --models 175B --no-write

Each model is planned by ``simpar.pipeline.search.search_pipeline`` on the ``ascend910b``
profile (64 GiB per device), float32 (whose weights, gradients and Adam state take the 16
bytes per parameter mixed-precision training takes), in one process: the stage count, the
layer ranges, each stage's Megatron layout or the operator-level search's cuts (recursive
programming), its memory dimensions and the micro-batches.
Megatron-LM's configuration (Narayanan et al. 2021), where ``simpar.plan.MEGATRON`` has
one, is priced alike. The sizes: GPT-3 XL 1.3B and GPT-3 13B (Brown et al. 2020, Table 2.1,
with 32 and 40 heads so that a head's width divides the model's; the GPT-3 batches of 1M and
2M tokens), GPT-3 175B, and Megatron-LM's 1-trillion-parameter GPT.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import host_line, markdown_table, publish, today  # noqa: E402

from simpar.pipeline.search import (  # noqa: E402
    GPTShape,
    StageChoice,
    price_choice,
    search_pipeline,
)
from simpar.plan import MEGATRON  # noqa: E402

SCRIPT = "python benchmarks/pipeline_search.py"
#: name: (shape, devices)
MODELS = {
    "1.3B": (GPTShape(51200, 2048, 2048, 24, 32, 512, "float32"), 8),
    "13B": (GPTShape(51200, 2048, 5120, 40, 40, 1024, "float32"), 64),
    "175B": (GPTShape(51200, 2048, 12288, 96, 96, 1536, "float32"), 1024),
    "1T": (GPTShape(51200, 2048, 25600, 128, 160, 3072, "float32"), 3072),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=SCRIPT, description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    rows = []
    for name in args.models:
        shape, devices = MODELS[name]
        found = search_pipeline(shape, devices, "ascend910b")
        best = found.best
        mega = MEGATRON.get((shape.hidden, shape.layers))
        ref = None
        if mega is not None:
            tp, pp = mega
            ref = price_choice(shape, devices, pp,
                               StageChoice(tp, devices // (tp * pp), 1, None, True))
        searched = (f"{best.describe()}; peak {best.peak_memory / 2**30:.1f} GiB"
                    if best else "nothing fits")
        rows.append([name, str(devices), searched,
                     f"{best.step_seconds:.2f}" if best else "-",
                     (f"pp {ref.stages} x tp {ref.choice.tp} x dp {ref.choice.dp}, "
                      f"recompute: {ref.step_seconds:.2f} s"
                      + ("" if ref.fits else " (does not fit)")) if ref else "-",
                     f"{ref.step_seconds / best.step_seconds:.2f}" if ref and best else "-",
                     f"{found.seconds:.1f}", str(len(found.candidates))])
        print(name, devices, rows[-1], flush=True)
    table = markdown_table(["model", "devices", "searched plan", "predicted step s",
                            "Megatron-LM's configuration", "Megatron / searched",
                            "search s", "candidates priced"], rows)
    body = "\n\n".join([
        f"`{SCRIPT}` ({today()}; ascend910b, 64 GiB per device, float32, 1F1B; each "
        "candidate priced from one embedding, block and head planned on its sub-mesh)",
        table, host_line()])
    publish("pipeline_search", body, not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
