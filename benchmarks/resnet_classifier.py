"""Where the search moves ResNet-50's classifier from data parallel to model parallel as the
class count grows: the textbook case of MindSpore's auto-parallel documentation.

For each class count and device count, ResNet-50 (224 x 224 images, float32, 32 images per
device, Adam) is planned as ``python -m simpar.plan --model resnet50`` plans it (in this
process; shapes only), by dynamic programming minimising (a) simpar's cost model on the
``ascend910b`` profile and (b) MindSpore's own cost model. The table gives the strategy
chosen for the classifier's MatMul (``end_point``: features (N, 2048) times the weight
(classes, 2048) transposed) read as data parallel (the weight whole on every device, the
batch cut), model parallel (the weight's rows, the classes, cut over k devices) or mixed,
and the plan's predicted step on ascend910b (every plan is priced by simpar's model).

    python benchmarks/resnet_classifier.py                        # into RESULTS.md
    python benchmarks/resnet_classifier.py --devices 8 --classes 1000 64000 --no-write
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import host_line, markdown_table, today, write_section  # noqa: E402

from simpar.cost import load_profile  # noqa: E402
from simpar.plan import PlanOptions, make_plan  # noqa: E402

SCRIPT = "python benchmarks/resnet_classifier.py"
CLASSES = (10, 100, 1000, 4000, 16000, 64000, 256000)
DEVICES = (8, 64)
PER_DEVICE = 32


def classifier(plan: object) -> tuple[str, str]:
    """(the end_point MatMul's strategy, what it is) of a plan."""
    program = plan.program  # type: ignore[attr-defined]
    step = next(s for s in program.steps if "end_point" in s.node.name
                and s.node.op.name == "MatMul")
    (rows, k), (classes, k2) = step.sharding.strategy
    used = rows * k * classes
    if classes == 1 and k == 1:
        kind = "data parallel" if rows > 1 else "replicated"
    elif classes > 1 and k == 1:
        kind = f"model parallel (classes / {classes})" + (f", batch / {rows}" if rows > 1
                                                         else "")
    else:
        kind = f"split-k ({k})" + (f", classes / {classes}" if classes > 1 else "")
    if used < program.device_num:
        kind += f", x{program.device_num // used} repeated"
    return str(((rows, k), (classes, k2))), kind


def run(devices: int, classes: int, cost_model: str) -> dict[str, object]:
    opts = PlanOptions("resnet50", hidden=64, layers=50, batch=PER_DEVICE * devices,
                       device_num=devices, search_mode="dynamic_programming",
                       profile=load_profile("ascend910b"), classes=classes, image_size=224,
                       cost_model=cost_model, dataset_strategy="data_parallel")
    t = time.perf_counter()
    plan = make_plan(opts)
    strategy, kind = classifier(plan)
    return {"strategy": strategy, "kind": kind, "step": plan.report.step_seconds * 1e3,
            "seconds": time.perf_counter() - t}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, nargs="+", default=list(DEVICES))
    p.add_argument("--classes", type=int, nargs="+", default=list(CLASSES))
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    rows = []
    for n in args.devices:
        for c in args.classes:
            got = {m: run(n, c, m) for m in ("simpar", "mindspore")}
            rows.append([n, c, got["simpar"]["strategy"], got["simpar"]["kind"],
                         f"{got['simpar']['step']:.2f}", got["mindspore"]["strategy"],
                         got["mindspore"]["kind"], f"{got['mindspore']['step']:.2f}",
                         f"{got['simpar']['seconds']:.1f} / {got['mindspore']['seconds']:.1f}"])
            print(" | ".join(map(str, rows[-1])), flush=True)
    body = "\n".join([
        f"Command: `{SCRIPT}` · date: {today()}",
        "",
        __doc__.split("\n\n")[1].replace("\n", " "),
        "",
        markdown_table(["devices", "classes", "simpar model: MatMul strategy", "reads as",
                        "predicted step ms", "MindSpore model: MatMul strategy", "reads as",
                        "predicted step ms", "planning s (simpar / MindSpore)"], rows),
        "",
        host_line(),
    ])
    if not args.no_write:
        write_section("resnet_classifier", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
