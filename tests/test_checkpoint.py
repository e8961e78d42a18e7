"""Distributed checkpoints, in one process (ranks simulated by looping over rank numbers): a
round trip on 8 ranks, one writer per replica group, a reshard to 4 ranks and another cut
that reads exactly the overlapping bytes, merge and transform, and every refusal: truncated
and corrupt files, an unfinished save, a checkpoint for other shapes, paths that leave the
directory, a crash in the middle of a save, and the command line.

    python -m pytest tests/test_checkpoint.py -q
"""

from __future__ import annotations

import ast
import json
import math
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from simpar import checkpoint
from simpar.checkpoint import (
    MANIFEST,
    check_against,
    finish_checkpoint,
    latest_checkpoint,
    load_shard,
    load_tensor,
    merge_checkpoint,
    read_manifest,
    save_shards,
    shard_sources,
    transform_checkpoint,
    writer_rank,
)
from simpar.layout import TensorLayout, distribute
from simpar.search import StrategyMap
from simpar.strategy_file import save_strategy

WORLD = 8
STEP = 10
# Layout A, on 8 ranks: every kind of cut, and every dtype kind.
LAYOUTS_A = {
    "params/fc1.weight": TensorLayout((2, 4), (1, 0), (8, 16)),        # split over 2 axes
    "params/fc1.bias": TensorLayout((8,), (-1,), (16,)),               # replicated
    "opt/fc1.weight/m": TensorLayout((2, 4), (1, -1), (8, 16)),        # rows in 2, replica 4
    "params/emb.table": TensorLayout((8,), (0, -1), (16, 4)),          # rows in 8
    "params/mask": TensorLayout((2, 2, 2), ((2, 1), -1), (8, 4)),      # rows over 2 axes
    "opt/t": TensorLayout((8,), (), ()),                               # a scalar
    "params/empty": TensorLayout((8,), (-1, 0), (0, 8)),               # no elements
}
DTYPES = {"params/fc1.weight": np.float32, "params/fc1.bias": np.float64,
          "opt/fc1.weight/m": np.float32, "params/emb.table": np.int32, "params/mask": np.bool_,
          "opt/t": np.int64, "params/empty": np.float32}
# Layout B, on 4 ranks: other cuts of the same tensors.
LAYOUTS_B = {
    "params/fc1.weight": TensorLayout((4,), (-1, 0), (8, 16)),         # columns in 4
    "params/fc1.bias": TensorLayout((2, 2), (0,), (16,)),              # in 2, replica 2
    "opt/fc1.weight/m": TensorLayout((4,), (-1, 0), (8, 16)),
    "params/emb.table": TensorLayout((2, 2), (0, 1), (16, 4)),         # rows 2, columns 2
    "params/mask": TensorLayout((4,), (-1, 0), (8, 4)),
    "opt/t": TensorLayout((4,), (), ()),
    "params/empty": TensorLayout((4,), (-1, 0), (0, 8)),
}


def _globals() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {name: (rng.standard_normal(lay.shape) * 10).astype(DTYPES[name])
            for name, lay in LAYOUTS_A.items()}


GLOBALS = _globals()


def _save(directory: Path, layouts: dict[str, TensorLayout] = LAYOUTS_A,
          world: int = WORLD, step: int = STEP, finish: bool = True) -> dict[int, list[str]]:
    """Every rank saves its shards of GLOBALS, then rank 0 finishes (as an MPI job would)."""
    written = {}
    for rank in range(world):
        shards = {name: distribute(GLOBALS[name], lay, rank) for name, lay in layouts.items()}
        written[rank] = save_shards(directory, rank, layouts, shards, step=step,
                                    extra={"optimizer_t": step})
    if finish:
        finish_checkpoint(directory, world, layouts, step=step, extra={"optimizer_t": step})
    return written


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("ckpt") / "step_000010"
    _save(directory)
    return directory


def _manifest_doc(directory: Path) -> dict:
    return json.loads((directory / MANIFEST).read_text())


def _rewrite_manifest(directory: Path, doc: dict) -> None:
    (directory / MANIFEST).write_text(json.dumps(doc))


def _file_of(directory: Path, name: str, rank: int) -> Path:
    return directory / next(f.path for f in read_manifest(directory).tensors[name].files
                            if f.rank == rank)


# ---------------------------------------------------------------- round trip and writers
def test_round_trip_on_8_ranks_gives_every_rank_its_own_shard(saved: Path) -> None:
    manifest = read_manifest(saved)
    assert (manifest.step, manifest.world_size, manifest.extra) == (STEP, WORLD,
                                                                     {"optimizer_t": STEP})
    for name, lay in LAYOUTS_A.items():
        entry = manifest.tensors[name]
        assert (entry.shape, entry.dtype, entry.layout) == (lay.shape, np.dtype(DTYPES[name]),
                                                           lay)
        for rank in range(WORLD):
            got = load_shard(saved, name, lay, rank)
            assert got.dtype == DTYPES[name] and got.shape == lay.local_shape()
            np.testing.assert_array_equal(got, GLOBALS[name][lay.slices(rank)])


def test_only_the_lowest_rank_of_each_replica_group_writes(saved: Path) -> None:
    manifest = read_manifest(saved)
    for name, lay in LAYOUTS_A.items():
        for rank in range(WORLD):  # the closed form against a scan of every rank
            same = [r for r in range(WORLD) if lay.slice_of(r) == lay.slice_of(rank)]
            expected = 0 if math.prod(lay.shape) == 0 else min(same)
            assert writer_rank(lay, rank) == expected, (name, rank)
        writers = sorted(f.rank for f in manifest.tensors[name].files)
        assert writers == sorted({writer_rank(lay, r) for r in range(WORLD)}), name
    by_tensor = {name: sorted(f.rank for f in t.files) for name, t in manifest.tensors.items()}
    assert by_tensor["params/fc1.bias"] == [0]
    assert by_tensor["opt/fc1.weight/m"] == [0, 4]
    assert by_tensor["params/mask"] == [0, 2, 4, 6]
    assert by_tensor["params/fc1.weight"] == list(range(8))
    on_disk = sorted(str(p.relative_to(saved)) for p in saved.glob("rank_*/*.npy"))
    assert on_disk == sorted(f.path for f in manifest.files)
    assert len(on_disk) == 8 + 1 + 2 + 8 + 4 + 1 + 1
    assert sorted(saved.glob("rank_*/.*")) == []  # no temporary file left


@pytest.mark.parametrize("lay", [
    TensorLayout((2, 1, 4), (2, 0), (8, 16)),          # DESIGN.md's example: a size-1 axis
    TensorLayout((2, 1, 4), (1, -1), (8, 16)),         # split along the size-1 axis only
    TensorLayout((2, 2, 2), (-1, (2, 0)), (4, 8)),     # one dimension over non-adjacent axes
    TensorLayout((4, 2, 1), (-1, 1), (4, 8)),          # replicas on the outer axis
], ids=str)
def test_the_writer_is_the_lowest_rank_with_the_same_block(lay: TensorLayout) -> None:
    for rank in range(lay.device_num):
        same = [r for r in range(lay.device_num) if lay.slice_of(r) == lay.slice_of(rank)]
        assert writer_rank(lay, rank) == min(same)


def test_save_returns_the_files_each_rank_wrote(tmp_path: Path) -> None:
    written = _save(tmp_path / "c", finish=False)
    assert written[5] == ["rank_5/params%2Ffc1.weight.npy", "rank_5/params%2Femb.table.npy"]
    assert "rank_0/opt%2Ft.npy" in written[0] and written[0][0].startswith("rank_0/")


# ---------------------------------------------------------------- reshard
@pytest.mark.parametrize("name", sorted(LAYOUTS_A))
def test_reshard_8_to_4_ranks_reads_exactly_the_overlap(saved: Path, name: str) -> None:
    a, b = LAYOUTS_A[name], LAYOUTS_B[name]
    saved_blocks = {writer_rank(a, r): a.slice_of(r) for r in range(WORLD)}
    manifest = read_manifest(saved)
    itemsize = np.dtype(DTYPES[name]).itemsize
    for rank in range(b.device_num):
        want = b.slice_of(rank)
        overlaps = {r: math.prod(max(0, min(s1, w1) - max(s0, w0))
                                 for (s0, s1), (w0, w1) in zip(block, want))
                    for r, block in saved_blocks.items()}
        needed = sorted(r for r, n in overlaps.items() if n > 0)
        assert sorted(f.rank for f in shard_sources(manifest, name, b, rank)) == needed
        stats: dict[str, int] = {}
        got = load_shard(saved, name, b, rank, stats=stats)
        np.testing.assert_array_equal(got, GLOBALS[name][b.slices(rank)])
        assert stats.get("bytes_read", 0) == sum(overlaps.values()) * itemsize
        assert stats.get("bytes_read", 0) == got.nbytes
        assert stats.get("files_read", 0) == len(needed)
        if b.local_size() < math.prod(b.shape):
            assert stats.get("bytes_read", 0) < GLOBALS[name].nbytes


def test_a_rank_never_opens_a_file_it_does_not_overlap(tmp_path: Path) -> None:
    directory = tmp_path / "c"
    _save(directory)
    name, b = "params/fc1.weight", LAYOUTS_B["params/fc1.weight"]  # rank 0: columns 0..3
    manifest = read_manifest(directory)
    needed = {f.rank for f in shard_sources(manifest, name, b, 0)}
    assert needed == {0, 4}
    untouched = _file_of(directory, name, 1)  # columns 4..7
    data = bytearray(untouched.read_bytes())
    data[-1] ^= 0xFF
    untouched.write_bytes(bytes(data))
    np.testing.assert_array_equal(load_shard(directory, name, b, 0), GLOBALS[name][:, 0:4])
    with pytest.raises(ValueError, match=r"rank_1/params%2Ffc1\.weight\.npy.*checksum"):
        load_shard(directory, name, b, 1)


# ---------------------------------------------------------------- merge and transform
def test_merge_gives_the_full_arrays(saved: Path, tmp_path: Path) -> None:
    merge_checkpoint(saved, tmp_path / "merged")
    merged = read_manifest(tmp_path / "merged")
    assert merged.world_size == 1 and merged.step == STEP
    merge_checkpoint(saved, tmp_path / "all.npz")
    with np.load(tmp_path / "all.npz", allow_pickle=False) as npz:
        assert sorted(npz.files) == sorted(LAYOUTS_A)
        for name, full in GLOBALS.items():
            np.testing.assert_array_equal(npz[name], full)
            assert npz[name].dtype == full.dtype
            np.testing.assert_array_equal(load_tensor(tmp_path / "merged", name), full)
            whole = merged.tensors[name].files[0]
            np.testing.assert_array_equal(
                np.load(tmp_path / "merged" / whole.path, allow_pickle=False), full)


def test_transform_to_4_ranks_and_back(saved: Path, tmp_path: Path) -> None:
    lines: list[str] = []
    stats = transform_checkpoint(saved, tmp_path / "b", LAYOUTS_B, 4, progress=lines.append)
    assert lines and lines[-1].startswith("transform: done")
    # Each destination writer read its own block once: the bytes of its blocks, no more.
    assert stats["bytes_read"] == sum(
        lay.local_size() * np.dtype(DTYPES[name]).itemsize
        for name, lay in LAYOUTS_B.items() for r in range(4) if writer_rank(lay, r) == r)
    moved = read_manifest(tmp_path / "b")
    assert (moved.world_size, moved.step, moved.extra) == (4, STEP, {"optimizer_t": STEP})
    for name, lay in LAYOUTS_B.items():
        assert moved.tensors[name].layout == lay
        for rank in range(4):
            np.testing.assert_array_equal(load_shard(tmp_path / "b", name, lay, rank),
                                          GLOBALS[name][lay.slices(rank)])
    transform_checkpoint(tmp_path / "b", tmp_path / "a", LAYOUTS_A, WORLD)
    for name, lay in LAYOUTS_A.items():
        for rank in range(WORLD):
            np.testing.assert_array_equal(load_shard(tmp_path / "a", name, lay, rank),
                                          GLOBALS[name][lay.slices(rank)])


def test_transform_refuses_layouts_for_other_tensors(saved: Path, tmp_path: Path) -> None:
    wrong = dict(LAYOUTS_B, **{"params/fc1.weight": TensorLayout((4,), (0, -1), (16, 8))})
    with pytest.raises(ValueError, match=r"'params/fc1\.weight' has shape \[8, 16\] in the "
                                         r"checkpoint, expected \[16, 8\]"):
        transform_checkpoint(saved, tmp_path / "x", wrong, 4)
    with pytest.raises(ValueError, match="dst_dir .* already holds a complete checkpoint"):
        transform_checkpoint(saved, saved, LAYOUTS_A, WORLD)


# ---------------------------------------------------------------- refusals
def test_a_layout_with_pending_sums_cannot_be_saved(tmp_path: Path) -> None:
    lay = TensorLayout((2, 4), (-1, 0), (8, 16), partial=(1,))
    with pytest.raises(ValueError, match=r"'params/w'.*pending sums.*complete the sums"):
        save_shards(tmp_path, 0, {"params/w": lay}, {"params/w": np.zeros((8, 4))}, step=0)


def test_a_truncated_file_is_named_with_its_size(tmp_path: Path) -> None:
    directory = tmp_path / "c"
    _save(directory)
    path = _file_of(directory, "params/emb.table", 3)
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(ValueError, match=r"'rank_3/params%2Femb\.table\.npy' has the wrong "
                                         r"size: \d+ bytes on disk, \d+ in the manifest"):
        load_shard(directory, "params/emb.table", LAYOUTS_A["params/emb.table"], 3)


def test_a_flipped_byte_fails_the_checksum(tmp_path: Path) -> None:
    directory = tmp_path / "c"
    _save(directory)
    path = _file_of(directory, "params/fc1.bias", 0)
    data = bytearray(path.read_bytes())
    data[len(data) // 2 + 40] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"'rank_0/params%2Ffc1\.bias\.npy' fails its checksum"):
        load_shard(directory, "params/fc1.bias", LAYOUTS_A["params/fc1.bias"], 5)
    assert checkpoint.main(["inspect", str(directory), "--verify"]) == 2


def test_a_save_without_finish_is_not_a_checkpoint(tmp_path: Path) -> None:
    directory = tmp_path / "c"
    _save(directory, finish=False)
    for call in (lambda: read_manifest(directory),
                 lambda: load_shard(directory, "opt/t", LAYOUTS_A["opt/t"], 0)):
        with pytest.raises(ValueError, match=r"is not a complete checkpoint \(no manifest\.json\)"):
            call()


def test_finish_refuses_a_missing_rank_a_missing_block_and_another_step(tmp_path: Path) -> None:
    directory = tmp_path / "c"
    _save(directory, finish=False)
    index = directory / "rank_4" / "index.json"
    doc = json.loads(index.read_text())
    index.unlink()
    with pytest.raises(ValueError, match=r"rank 4 has not saved"):
        finish_checkpoint(directory, WORLD, LAYOUTS_A, step=STEP)
    del doc["tensors"]["opt/fc1.weight/m"]
    index.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"'opt/fc1\.weight/m' \(shape \[8, 16\]\) is not saved "
                                         r"exactly once: region \[\[4, 8\], \[0, 16\]\] is "
                                         r"missing"):
        finish_checkpoint(directory, WORLD, LAYOUTS_A, step=STEP)
    with pytest.raises(ValueError, match=r"\['step'\] is 10, but this checkpoint is for step 11"):
        finish_checkpoint(directory, WORLD, LAYOUTS_A, step=11)
    assert not (directory / MANIFEST).exists()


def test_a_manifest_for_other_shapes_says_what_differs(saved: Path) -> None:
    manifest = read_manifest(saved)
    expected: dict[str, TensorLayout | Sequence[int] | tuple[Sequence[int], Any]] = dict(
        LAYOUTS_A)
    check_against(manifest, expected)
    expected["params/fc1.weight"] = (16, 8)
    expected["params/fc2.weight"] = (4, 4)
    del expected["opt/t"]
    expected["params/emb.table"] = ((16, 4), np.float32)
    with pytest.raises(ValueError) as info:
        check_against(manifest, expected)
    message = str(info.value)
    assert "tensor 'params/fc1.weight' has shape [8, 16] in the checkpoint, expected [16, 8]" \
        in message
    assert "tensor 'params/fc2.weight' is missing from the checkpoint" in message
    assert "tensor 'opt/t' is in the checkpoint but not expected" in message
    assert "tensor 'params/emb.table' has dtype int32 in the checkpoint, expected float32" \
        in message
    with pytest.raises(ValueError, match=r"layout \[8\]:\[-1,0\] \[8, 16\] is for shape "
                                         r"\[8, 16\], but tensor 'params/emb\.table' has shape"):
        load_shard(saved, "params/emb.table", TensorLayout((8,), (-1, 0), (8, 16)), 0)
    with pytest.raises(ValueError, match=r"no tensor 'params/emb\.tabel' \(closest: "
                                         r"'params/emb\.table'\)"):
        load_shard(saved, "params/emb.tabel", LAYOUTS_A["params/emb.table"], 0)


@pytest.mark.parametrize("bad", ["../x.npy", "/etc/passwd", "rank_0/../../x.npy"])
def test_a_manifest_path_that_leaves_the_directory_is_refused(tmp_path: Path, bad: str) -> None:
    directory = tmp_path / "c"
    _save(directory)
    doc = _manifest_doc(directory)
    doc["tensors"]["params/fc1.bias"]["files"][0]["path"] = bad
    _rewrite_manifest(directory, doc)
    with pytest.raises(ValueError, match=re.escape(repr(bad))):
        read_manifest(directory)


def test_an_index_path_that_leaves_the_directory_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "c"
    _save(directory, finish=False)
    index = directory / "rank_2" / "index.json"
    doc = json.loads(index.read_text())
    doc["tensors"]["params/fc1.weight"]["path"] = "../x.npy"
    index.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"path '\.\./x\.npy' leaves the checkpoint directory"):
        finish_checkpoint(directory, WORLD, LAYOUTS_A, step=STEP)


def test_a_symbolic_link_out_of_the_directory_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "c"
    _save(directory)
    outside = tmp_path / "elsewhere"
    (directory / "rank_1").rename(outside)
    (directory / "rank_1").symlink_to(outside, target_is_directory=True)
    with pytest.raises(ValueError, match=r"'rank_1/params%2Ffc1\.weight\.npy' resolves to .*, "
                                         "outside the checkpoint directory"):
        load_shard(directory, "params/fc1.weight", LAYOUTS_A["params/fc1.weight"], 1)


def test_a_manifest_whose_blocks_overlap_or_of_a_newer_version_is_refused(tmp_path: Path
                                                                          ) -> None:
    directory = tmp_path / "c"
    _save(directory)
    doc = _manifest_doc(directory)
    files = doc["tensors"]["params/emb.table"]["files"]
    files[1]["block"] = files[0]["block"]
    _rewrite_manifest(directory, doc)
    with pytest.raises(ValueError, match=r"'params/emb\.table'.*region \[\[0, 2\], \[0, 4\]\] "
                                         "is held by more than one file"):
        read_manifest(directory)
    _rewrite_manifest(directory, dict(_manifest_doc(directory), version=99))
    with pytest.raises(ValueError, match="newer simpar.*version 99"):
        read_manifest(directory)
    (directory / MANIFEST).write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        read_manifest(directory)


@pytest.mark.parametrize("name", ["../w", "/w", "a//b", "a/./b", ""])
def test_tensor_names_that_could_leave_the_directory_are_refused(tmp_path: Path,
                                                                 name: str) -> None:
    lay = TensorLayout((1,), (-1,), (2,))
    with pytest.raises(ValueError, match="tensor name"):
        save_shards(tmp_path, 0, {name: lay}, {name: np.zeros(2)}, step=0)


def test_bad_arguments_name_the_parameter(tmp_path: Path, saved: Path) -> None:
    lay = TensorLayout((2,), (0,), (4,))
    with pytest.raises(ValueError, match=r"arrays\['w'\] has shape \(4,\), but layout .* "
                                         r"shape \(2,\)"):
        save_shards(tmp_path, 0, {"w": lay}, {"w": np.zeros(4)}, step=0)
    with pytest.raises(TypeError, match=r"arrays\['w'\] has dtype object"):
        save_shards(tmp_path, 0, {"w": lay}, {"w": np.zeros(2, dtype=object)}, step=0)
    with pytest.raises(ValueError, match="step must be >= 0, got -1"):
        save_shards(tmp_path, 0, {"w": lay}, {"w": np.zeros(2)}, step=-1)
    with pytest.raises(ValueError, match="rank 2 is outside layout"):
        save_shards(tmp_path, 2, {"w": lay}, {"w": np.zeros(2)}, step=0)
    with pytest.raises(TypeError, match="extra must hold JSON values"):
        save_shards(tmp_path, 0, {"w": lay}, {"w": np.zeros(2)}, step=0, extra={"a": object()})
    with pytest.raises(ValueError, match="already holds a complete checkpoint"):
        save_shards(saved, 0, LAYOUTS_A, {}, step=STEP)


# ---------------------------------------------------------------- faults and resuming
def test_a_crash_in_the_middle_of_a_save_leaves_no_file_and_no_manifest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "run"
    _save(root / "step_000010")
    write_array = np.lib.format.write_array
    calls = []

    def crash_on_third(fp: Any, array: np.ndarray, *args: Any, **kwargs: Any) -> None:
        calls.append(1)
        if len(calls) == 3:
            fp.write(b"\x93NUMPY half a file")
            raise OSError("disk full")
        write_array(fp, array, *args, **kwargs)

    monkeypatch.setattr(np.lib.format, "write_array", crash_on_third)
    with pytest.raises(OSError, match="disk full"):
        _save(root / "step_000020", step=20)
    monkeypatch.undo()
    rank_0 = root / "step_000020" / "rank_0"
    assert len(list(rank_0.glob("*.npy"))) == 2  # the two before the crash, whole
    assert list(rank_0.glob(".*")) == [] and not (rank_0 / "index.json").exists()
    assert latest_checkpoint(root) == str(root / "step_000010")
    lay = LAYOUTS_A["params/mask"]
    np.testing.assert_array_equal(load_shard(latest_checkpoint(root) or "", "params/mask",
                                             lay, 6), GLOBALS["params/mask"][lay.slices(6)])


KILLED_MID_SAVE = """
import os, sys
import numpy as np
from simpar.checkpoint import finish_checkpoint, save_shards
from simpar.layout import TensorLayout
root = sys.argv[1]
lay = TensorLayout((1,), [-1, -1], (64, 64))
layouts = {f"params/w{k}": lay for k in range(6)}
arrays = {name: np.full((64, 64), float(k)) for k, name in enumerate(layouts)}
save_shards(os.path.join(root, "step_000001"), 0, layouts, arrays, step=1)
finish_checkpoint(os.path.join(root, "step_000001"), 1, layouts, step=1)
real, calls = np.lib.format.write_array, []
def killed(fp, array, *args, **kwargs):
    calls.append(1)
    if len(calls) == 4:
        fp.write(b"half a file")
        os._exit(9)  # as a kill: no exception, no cleanup, no finally
    real(fp, array, *args, **kwargs)
np.lib.format.write_array = killed
save_shards(os.path.join(root, "step_000002"), 0, layouts,
            {name: a + 1 for name, a in arrays.items()}, step=2)
"""


def test_a_process_killed_in_the_middle_of_a_save_leaves_the_previous_checkpoint(
        tmp_path: Path) -> None:
    """Killed for real (``os._exit`` inside the fourth file's write): the half-written save has
    no manifest, so the previous checkpoint is still the latest, and it loads whole."""
    done = subprocess.run([sys.executable, "-c", KILLED_MID_SAVE, str(tmp_path)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 9, done.stderr
    assert (tmp_path / "step_000002" / "rank_0").is_dir()
    assert not (tmp_path / "step_000002" / "manifest.json").exists()
    latest = latest_checkpoint(tmp_path)
    assert latest == str(tmp_path / "step_000001")
    lay = TensorLayout((1,), [-1, -1], (64, 64))
    for k in range(6):
        np.testing.assert_array_equal(load_shard(latest, f"params/w{k}", lay, 0),
                                      np.full((64, 64), float(k)))


def test_latest_checkpoint_takes_the_highest_complete_step(tmp_path: Path) -> None:
    root = tmp_path / "run"
    assert latest_checkpoint(root) is None
    _save(root / "step_000010", step=10)
    _save(root / "step_000030", step=30)
    _save(root / "step_000040", step=40, finish=False)
    (root / "notes.txt").write_text("not a checkpoint")
    assert latest_checkpoint(root) == str(root / "step_000030")


# ---------------------------------------------------------------- command line
def test_cli_inspect_merge_and_transform(saved: Path, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert checkpoint.main(["inspect", str(saved), "--verify"]) == 0
    out = capsys.readouterr().out
    assert f"step {STEP}, world size {WORLD}, 7 tensors, 25 files" in out
    assert "params/fc1.weight [8, 16] float32 [2, 4]:[1,0] [8, 16] 8 files" in out
    assert "verified 25 files" in out
    assert checkpoint.main(["merge", str(saved), str(tmp_path / "all.npz")]) == 0
    with np.load(tmp_path / "all.npz", allow_pickle=False) as npz:
        np.testing.assert_array_equal(npz["params/mask"], GLOBALS["params/mask"])
    # The destination strategy lays out two parameters; their optimizer state follows them,
    # and the tensors it does not lay out are held whole on every rank.
    strategy = tmp_path / "strategy.json"
    params = {"fc1.weight": LAYOUTS_B["params/fc1.weight"],
              "emb.table": LAYOUTS_B["params/emb.table"]}
    save_strategy(strategy, StrategyMap(4, "semi_auto_parallel", {}, params))
    dst = tmp_path / "dst"
    assert checkpoint.main(["transform", str(saved), str(dst), "--strategy",
                            str(strategy)]) == 0
    captured = capsys.readouterr()
    assert "transform: done" in captured.err and "(4 ranks)" in captured.out
    moved = read_manifest(dst)
    assert moved.world_size == 4 and moved.strategy_file is not None
    assert moved.tensors["opt/fc1.weight/m"].layout == LAYOUTS_B["params/fc1.weight"]
    assert moved.tensors["params/fc1.bias"].layout == TensorLayout((4,), (-1,), (16,))
    for name in ("opt/fc1.weight/m", "params/emb.table", "params/fc1.bias"):
        lay = moved.tensors[name].layout
        for rank in range(4):
            np.testing.assert_array_equal(load_shard(dst, name, lay, rank),
                                          GLOBALS[name][lay.slices(rank)])


@pytest.mark.parametrize("argv", [[], ["inspect"], ["transform", "a", "b"], ["frobnicate"],
                                  ["inspect", "/no/such/checkpoint"]])
def test_cli_errors_exit_2_with_one_line(argv: list[str],
                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert checkpoint.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("python -m simpar.checkpoint: error: ")


def test_cli_refuses_an_unfinished_checkpoint(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    _save(tmp_path / "c", finish=False)
    assert checkpoint.main(["inspect", str(tmp_path / "c")]) == 2
    assert "not a complete checkpoint" in capsys.readouterr().err


def test_nothing_is_ever_loaded_with_pickle() -> None:
    package = Path(checkpoint.__file__).parent  # every module of simpar.checkpoint
    tree = ast.Module(body=[node for path in sorted(package.glob("*.py"))
                            for node in ast.parse(path.read_text()).body], type_ignores=[])
    loads = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Attribute) and node.func.attr == "load"
             and ast.unparse(node.func.value) in ("np", "numpy")]
    assert loads
    for call in loads:
        flag = {k.arg: k.value for k in call.keywords}.get("allow_pickle")
        assert isinstance(flag, ast.Constant) and flag.value is False, ast.unparse(call)
    imported = {a.name for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                for a in node.names} | {node.module for node in ast.walk(tree)
                                        if isinstance(node, ast.ImportFrom)}
    assert not imported & {"pickle", "cPickle", "dill", "joblib"}
