"""``python -m simpar.checkpoint``: ``inspect DIR [--verify]``, ``merge DIR OUT`` (``OUT`` a
directory, or a ``.npz`` file), ``export DIR OUT`` (MindSpore's safetensors files: per rank
into the directory ``OUT``, or merged into ``OUT.safetensors``) and ``transform SRC DST
--strategy FILE.json``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from typing import NoReturn

from simpar.checkpoint.export import export_merged, export_per_rank
from simpar.checkpoint.load import merge_checkpoint, transform_checkpoint, verify_file
from simpar.checkpoint.manifest import (
    Manifest,
    param_of,
    path_inside,
    read_manifest,
    size_text,
)
from simpar.layout import TensorLayout
from simpar.strategy_file import load_strategy

__all__ = ["main"]

_PROG = "python -m simpar.checkpoint"


class _UsageError(Exception):
    """A bad command line: main prints it on one line and returns 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _UsageError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog=_PROG, description="Inspect, merge or transform a simpar distributed "
                "checkpoint (a directory with manifest.json and rank_N/*.npy).")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    inspect = sub.add_parser("inspect", help="print step, world size, tensors, files, bytes")
    inspect.add_argument("directory", metavar="DIR")
    inspect.add_argument("--verify", action="store_true",
                         help="also check every file's size and sha256")
    merge = sub.add_parser("merge", help="write every tensor whole")
    merge.add_argument("directory", metavar="DIR")
    merge.add_argument("out", metavar="OUT", help="a new directory, or a .npz file")
    export = sub.add_parser("export", help="write MindSpore's safetensors files: per rank "
                                           "(OUT a new directory) or merged (OUT.safetensors)")
    export.add_argument("directory", metavar="DIR")
    export.add_argument("out", metavar="OUT", help="a new directory (rank_{r}/ folders and "
                                                  "strategy.json), or a .safetensors or "
                                                  ".ckpt file")
    export.add_argument("--format", default="safetensors", choices=("safetensors", "ckpt"),
                        help="the per-rank files' format (default safetensors; a merged "
                             "file's is its suffix)")
    transform = sub.add_parser("transform", help="rewrite for another strategy or device count")
    transform.add_argument("src", metavar="SRC")
    transform.add_argument("dst", metavar="DST")
    transform.add_argument("--strategy", required=True, metavar="FILE.json",
                           help="the destination's strategy file (simpar or MindSpore JSON)")
    return p


def _strategy_layouts(manifest: Manifest, params: Mapping[str, TensorLayout],
                      world: int) -> dict[str, TensorLayout]:
    """The destination layout of every tensor: its parameter's layout from the strategy file
    (optimizer state follows its parameter), or held whole on every rank if the file does not
    lay out its parameter."""
    out = {}
    for name, entry in manifest.tensors.items():
        lay = params.get(param_of(name))
        if lay is None:
            out[name] = TensorLayout((world,), [-1] * len(entry.shape), entry.shape)
        elif lay.shape != entry.shape:
            raise ValueError(f"tensor {name!r} has shape {list(entry.shape)} in the checkpoint, "
                             f"but the strategy lays out parameter {param_of(name)!r} with "
                             f"shape {list(lay.shape)}")
        else:
            out[name] = lay
    return out


def _inspect(directory: str, verify: bool) -> None:
    manifest = read_manifest(directory)
    print(manifest)
    if manifest.strategy_file is not None:
        print(f"  strategy file {manifest.strategy_file.path}")
    for entry in manifest.tensors.values():
        print(f"  {entry}")
    if verify:
        for shard in manifest.files:
            path = path_inside(manifest.directory, shard.path, manifest.directory)
            verify_file(path, shard, None)
        print(f"verified {len(manifest.files)} files: sizes and sha256 match the manifest")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m simpar.checkpoint``; returns the exit status: 0, or 2 with one line on
    stderr for a bad command line or a checkpoint that cannot be read or written."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    try:
        args = _parser().parse_args(args_list)
    except _UsageError as e:
        print(f"{_PROG}: error: {e} (--help lists the commands)", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        if args.command == "inspect":
            _inspect(args.directory, args.verify)
        elif args.command == "merge":
            merge_checkpoint(args.directory, args.out, progress=progress)
            print(f"merged {args.directory} into {args.out}")
        elif args.command == "export":
            if str(args.out).endswith((".safetensors", ".ckpt")):
                if args.format == "ckpt" and not str(args.out).endswith(".ckpt"):
                    raise ValueError(f"--format ckpt with OUT {args.out!r}: a merged file's "
                                     "format is its suffix, .safetensors or .ckpt")
                export_merged(args.directory, args.out, progress=progress)
                print(f"exported {args.directory} whole into {args.out}")
            else:
                files = export_per_rank(args.directory, args.out, progress=progress,
                                        file_format=args.format)
                print(f"exported {args.directory} into {args.out}: {len(files) - 1} rank files "
                      "and strategy.json")
        else:
            smap = load_strategy(args.strategy)
            manifest = read_manifest(args.src)
            layouts = _strategy_layouts(manifest, smap.params, smap.device_num)
            stats = transform_checkpoint(args.src, args.dst, layouts, smap.device_num,
                                         strategy_file=args.strategy, progress=progress)
            print(f"transformed {args.src} ({manifest.world_size} ranks) into {args.dst} "
                  f"({smap.device_num} ranks), {size_text(stats.get('bytes_read', 0))} read")
    except (ValueError, TypeError, OSError) as e:
        print(f"{_PROG}: error: {e}", file=sys.stderr)
        return 2
    return 0
