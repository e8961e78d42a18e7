"""``mindspore.dataset``: in-memory datasets as MindSpore's scripts build them.

* :class:`NumpySlicesDataset` (arrays, sliced along their first dimension) and
  :class:`GeneratorDataset` (a random-access source, ``source[i]`` and ``len(source)``, or an
  iterable / generator function);
* ``num_shards``/``shard_id`` give each rank its share of the samples: with MindSpore's
  ``full_batch=False`` each rank then feeds its own batch
  (:class:`simpar.mindspore.train.Model`);
* ``shuffle`` (the source's sampler) and :meth:`Dataset.shuffle` draw from the dataset seed
  (:func:`config.set_seed`, which ``mindspore.set_seed`` sets too) and the epoch, the same on
  every rank, so the shards of one epoch cover every sample (padded, as MindSpore's sampler
  pads, by repeating the first ones when the shards do not divide the samples);
* :meth:`Dataset.batch`, :meth:`Dataset.map` (Python callables), :meth:`Dataset.repeat`,
  :meth:`Dataset.create_tuple_iterator` and :meth:`Dataset.create_dict_iterator`.

The sampler's order is simpar's own: the samples are permuted (if shuffled) with a
generator seeded by (seed, epoch), padded by wrapping around to a multiple of
``num_shards``, and shard ``s`` takes positions ``s, s + num_shards, ...``. MindSpore's
samplers draw other permutations: the same seed does not give MindSpore's order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from simpar.mindspore._missing import missing
from simpar.mindspore.tensor import Tensor

__all__ = ["Dataset", "GeneratorDataset", "NumpySlicesDataset", "config"]

Row = tuple[np.ndarray, ...]


class _Config:
    """``mindspore.dataset.config``: the dataset seed (``set_seed``/``get_seed``)."""

    def __init__(self) -> None:
        self._seed = 0

    def set_seed(self, seed: int) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 32:
            raise ValueError(f"config.set_seed: seed must be an int in [0, 2**32), got "
                             f"{seed!r}")
        self._seed = seed

    def get_seed(self) -> int:
        return self._seed


config = _Config()


def _positive(func: str, name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{func}: {name} must be a positive int, got {value!r}")
    return int(value)


def _shards(func: str, num_shards: object, shard_id: object) -> tuple[int, int]:
    if num_shards is None and shard_id is None:
        return 1, 0
    if num_shards is None or shard_id is None:
        raise ValueError(f"{func}: num_shards and shard_id must be given together, got "
                         f"num_shards={num_shards!r}, shard_id={shard_id!r}")
    n = _positive(func, "num_shards", num_shards)
    if isinstance(shard_id, bool) or not isinstance(shard_id, (int, np.integer)) \
            or not 0 <= shard_id < n:
        raise ValueError(f"{func}: shard_id must be an int in [0, {n}) (num_shards={n}), got "
                         f"{shard_id!r}")
    return n, int(shard_id)


def _row(func: str, item: object, columns: int | None) -> Row:
    values = item if isinstance(item, tuple) else (item,)
    row = tuple(np.asarray(v) for v in values)
    if columns is not None and len(row) != columns:
        raise ValueError(f"{func}: a sample has {len(row)} columns, but column_names names "
                         f"{columns}")
    return row


class Dataset:
    """A pipeline of samples: each step yields rows (tuples of numpy arrays, one per column);
    :meth:`batch` stacks rows. Iterating runs one epoch; the epoch numbers the shuffles."""

    def __init__(self, column_names: Sequence[str]) -> None:
        self._columns = list(column_names)

    # -- what a stage yields
    def _rows(self, epoch: int) -> Iterator[Row]:
        raise NotImplementedError

    def _size(self) -> int:
        raise NotImplementedError

    # -- MindSpore's operations
    def batch(self, batch_size: int, drop_remainder: bool = False, **kwargs: Any) -> Dataset:
        """Stack ``batch_size`` rows into one (the last, shorter batch kept unless
        ``drop_remainder``)."""
        if kwargs:
            raise NotImplementedError(f"Dataset.batch: simpar takes batch_size and "
                                      f"drop_remainder only, got {sorted(kwargs)}")
        if not isinstance(drop_remainder, bool):
            raise TypeError(f"Dataset.batch: drop_remainder must be a bool, got "
                            f"{drop_remainder!r}")
        return _Batch(self, _positive("Dataset.batch", "batch_size", batch_size), drop_remainder)

    def shuffle(self, buffer_size: int) -> Dataset:
        """Shuffle through a buffer of ``buffer_size`` rows (seeded by the dataset seed and the
        epoch)."""
        return _Shuffle(self, _positive("Dataset.shuffle", "buffer_size", buffer_size))

    def map(self, operations: Callable[..., Any] | Sequence[Callable[..., Any]],
            input_columns: str | Sequence[str] | None = None, **kwargs: Any) -> Dataset:
        """Apply Python callables, in order, as MindSpore does: each takes the
        ``input_columns`` (default: the first column) as its arguments and returns their new
        values (one value for one column, else a tuple of as many)."""
        if kwargs:
            raise NotImplementedError(f"Dataset.map: simpar takes operations and "
                                      f"input_columns only, got {sorted(kwargs)}")
        ops = [operations] if callable(operations) else list(operations)
        if not ops or not all(callable(f) for f in ops):
            raise TypeError(f"Dataset.map: operations must be callables, got {operations!r}")
        names = ([input_columns] if isinstance(input_columns, str) else
                 list(self._columns[:1] if input_columns is None else input_columns))
        unknown = [c for c in names if c not in self._columns]
        if unknown:
            raise ValueError(f"Dataset.map: input_columns {unknown} are not columns of the "
                             f"dataset ({self._columns})")
        return _Map(self, ops, [self._columns.index(c) for c in names])

    def repeat(self, count: int | None = None) -> Dataset:
        """The epoch's samples ``count`` times (MindSpore's None, forever, is refused)."""
        if count is None or count == -1:
            raise NotImplementedError("Dataset.repeat: simpar repeats a finite count; pass an "
                                      "int >= 1 (Model.train's epochs repeat the dataset)")
        return _Repeat(self, _positive("Dataset.repeat", "count", count))

    # -- reading
    def get_dataset_size(self) -> int:
        """Rows (batches, after :meth:`batch`) in one epoch of this shard."""
        return self._size()

    def get_col_names(self) -> list[str]:
        return list(self._columns)

    def get_batch_size(self) -> int:
        """Rows per batch: the batch size after :meth:`batch`, else 1."""
        child = getattr(self, "_child", None)
        return child.get_batch_size() if isinstance(child, Dataset) else 1

    def last_batch_short(self) -> bool:
        """Whether an epoch ends in a batch smaller than the others (``batch`` without
        ``drop_remainder`` of rows it does not divide)."""
        child = getattr(self, "_child", None)
        return child.last_batch_short() if isinstance(child, Dataset) else False

    def create_tuple_iterator(self, columns: Sequence[str] | None = None,
                              num_epochs: int = -1, output_numpy: bool = False,
                              do_copy: bool = True) -> _EpochIterator:
        """An iterator of rows, each a list (Tensors, or numpy arrays with ``output_numpy``).
        As MindSpore's, a ``for`` loop over it runs one epoch; looping over it again runs the
        next, up to ``num_epochs`` (-1: without end)."""
        picks = self._picks(columns)
        _check_epochs("create_tuple_iterator", num_epochs)
        return _EpochIterator(self, num_epochs, lambda row: [
            row[k] if output_numpy else Tensor(row[k]) for k in picks])

    def create_dict_iterator(self, num_epochs: int = -1, output_numpy: bool = False,
                             do_copy: bool = True) -> _EpochIterator:
        """As :meth:`create_tuple_iterator`, each row a dict {column name: value}."""
        _check_epochs("create_dict_iterator", num_epochs)
        return _EpochIterator(self, num_epochs, lambda row: {
            name: v if output_numpy else Tensor(v) for name, v in zip(self._columns, row)})

    def __iter__(self) -> Iterator[list[Any]]:
        return iter(self.create_tuple_iterator(num_epochs=1))

    def epoch(self, epoch: int) -> Iterator[Row]:
        """The rows of epoch ``epoch`` as numpy tuples (what :class:`Model` trains on)."""
        return self._rows(epoch)

    def _picks(self, columns: Sequence[str] | None) -> list[int]:
        if columns is None:
            return list(range(len(self._columns)))
        unknown = [c for c in columns if c not in self._columns]
        if unknown:
            raise ValueError(f"create_tuple_iterator: columns {unknown} are not columns of "
                             f"the dataset ({self._columns})")
        return [self._columns.index(c) for c in columns]


def _check_epochs(func: str, num_epochs: object) -> None:
    if isinstance(num_epochs, bool) or not isinstance(num_epochs, int) or (
            num_epochs < 1 and num_epochs != -1):
        raise ValueError(f"{func}: num_epochs must be -1 or an int >= 1, got {num_epochs!r}")


class _EpochIterator:
    """MindSpore's dataset iterator: ``next`` gives the rows of one epoch, then raises
    StopIteration; iterating it again starts the next epoch, until ``num_epochs`` ran."""

    def __init__(self, dataset: Dataset, num_epochs: int, shape: Callable[[Row], Any]) -> None:
        self._dataset, self._left, self.shape = dataset, num_epochs, shape
        self._epoch = 0
        self._rows: Iterator[Row] | None = None

    def __iter__(self) -> _EpochIterator:
        if self._rows is None and self._left != 0:
            self._rows = self._dataset.epoch(self._epoch)
        return self

    def __next__(self) -> Any:
        if self._rows is None:
            self.__iter__()
            if self._rows is None:
                raise StopIteration
        try:
            return self.shape(next(self._rows))
        except StopIteration:
            self._rows = None
            self._epoch += 1
            self._left -= 1 if self._left > 0 else 0
            raise


class _Source(Dataset):
    """Samples read by index from a random-access source, through the sampler (shuffle,
    shard)."""

    def __init__(self, func: str, count: int, read: Callable[[int], Row],
                 column_names: Sequence[str], shuffle: bool, num_shards: int, shard_id: int,
                 num_samples: int | None) -> None:
        super().__init__(column_names)
        self._func, self._count, self._read = func, count, read
        self._shuffle, self._num_shards, self._shard_id = shuffle, num_shards, shard_id
        self._num_samples = num_samples

    def _indices(self, epoch: int) -> list[int]:
        order = np.arange(self._count)
        if self._shuffle:
            order = np.random.default_rng([config.get_seed(), epoch]).permutation(self._count)
        per_shard = math.ceil(self._count / self._num_shards)
        padded = np.resize(order, per_shard * self._num_shards)   # wraps around
        mine = padded[self._shard_id::self._num_shards]
        if self._num_samples is not None:
            mine = mine[:self._num_samples]
        return [int(i) for i in mine]

    def _rows(self, epoch: int) -> Iterator[Row]:
        for i in self._indices(epoch):
            yield self._read(i)

    def _size(self) -> int:
        per_shard = math.ceil(self._count / self._num_shards) if self._count else 0
        return per_shard if self._num_samples is None else min(per_shard, self._num_samples)


class _Stream(Dataset):
    """Samples of an iterable source, in its order, read again each epoch."""

    def __init__(self, func: str, source: Callable[[], Any] | Any,
                 column_names: Sequence[str], num_samples: int | None) -> None:
        super().__init__(column_names)
        if not callable(source) and iter(source) is source:   # one pass only: keep its rows
            source = list(source)
        self._func, self._source, self._num_samples = func, source, num_samples

    def _rows(self, epoch: int) -> Iterator[Row]:
        items = self._source() if callable(self._source) else iter(self._source)
        for k, item in enumerate(items):
            if self._num_samples is not None and k >= self._num_samples:
                return
            yield _row(self._func, item, len(self._columns))

    def _size(self) -> int:
        return sum(1 for _ in self._rows(0))


def _names(func: str, column_names: str | Sequence[str] | None, count: int) -> list[str]:
    if column_names is None:
        return [f"column_{k}" for k in range(count)]
    names = [column_names] if isinstance(column_names, str) else list(column_names)
    if not all(isinstance(c, str) for c in names) or len(set(names)) != len(names):
        raise ValueError(f"{func}: column_names must be distinct strings, got {column_names!r}")
    if len(names) != count:
        raise ValueError(f"{func}: column_names names {len(names)} columns, but the data has "
                         f"{count}")
    return names


def _unsupported(func: str, kwargs: Mapping[str, Any]) -> None:
    given = {k: v for k, v in kwargs.items() if v is not None and k not in (
        "num_parallel_workers", "python_multiprocessing", "max_rowsize")}
    if given:
        raise NotImplementedError(f"{func}: simpar does not implement {sorted(given)}")


def NumpySlicesDataset(data: Any, column_names: str | Sequence[str] | None = None,  # noqa: N802
                       num_samples: int | None = None, num_parallel_workers: int | None = None,
                       shuffle: bool | None = None, sampler: Any = None,
                       num_shards: int | None = None, shard_id: int | None = None) -> Dataset:
    """Samples sliced from ``data`` along its first dimension: an array, a list or tuple of
    arrays (one column each) or a dict {column name: array}. ``shuffle`` defaults to True, as
    MindSpore's does."""
    func = "NumpySlicesDataset"
    _unsupported(func, {"sampler": sampler})
    if isinstance(data, Mapping):
        names = list(data) if column_names is None else _names(func, column_names, len(data))
        arrays = [np.asarray(v) for v in data.values()]
    else:
        # As MindSpore's: a tuple is one column per entry; a list or an array is one column.
        arrays = [np.asarray(v) for v in data] if isinstance(data, tuple) else [np.asarray(data)]
        names = _names(func, column_names, len(arrays))
    if not arrays or any(a.ndim == 0 for a in arrays):
        raise ValueError(f"{func}: data must hold arrays with a first dimension to slice, got "
                         f"shapes {[a.shape for a in arrays]}")
    count = len(arrays[0])
    if any(len(a) != count for a in arrays):
        raise ValueError(f"{func}: every column must have the same number of samples, got "
                         f"{[len(a) for a in arrays]}")
    shards, shard_id = _shards(func, num_shards, shard_id)
    if shuffle is not None and not isinstance(shuffle, bool):
        raise TypeError(f"{func}: shuffle must be a bool or None, got {shuffle!r}")
    return _Source(func, count, lambda i: tuple(a[i] for a in arrays), names,
                   True if shuffle is None else shuffle, shards, shard_id,
                   None if num_samples is None else _positive(func, "num_samples", num_samples))


def GeneratorDataset(source: Any, column_names: str | Sequence[str] | None = None,  # noqa: N802
                     column_types: Any = None, schema: Any = None,
                     num_samples: int | None = None, num_parallel_workers: int | None = None,
                     shuffle: bool | None = None, sampler: Any = None,
                     num_shards: int | None = None, shard_id: int | None = None,
                     python_multiprocessing: bool | None = None,
                     max_rowsize: Any = None) -> Dataset:
    """Samples from ``source``: random access (``source[i]`` and ``len(source)``: shuffled by
    default, and shardable), or an iterable or a function returning an iterator (in order;
    ``shuffle`` and ``num_shards`` need random access, as in MindSpore). Each sample is an
    array or a tuple of arrays, one per column of ``column_names`` (required)."""
    func = "GeneratorDataset"
    _unsupported(func, {"column_types": column_types, "schema": schema, "sampler": sampler})
    if column_names is None:
        raise ValueError(f"{func}: column_names is required (e.g. ['data', 'label'])")
    names = [column_names] if isinstance(column_names, str) else list(column_names)
    _names(func, names, len(names))
    if shuffle is not None and not isinstance(shuffle, bool):
        raise TypeError(f"{func}: shuffle must be a bool or None, got {shuffle!r}")
    samples = None if num_samples is None else _positive(func, "num_samples", num_samples)
    shards, shard_id = _shards(func, num_shards, shard_id)
    if hasattr(source, "__getitem__") and hasattr(source, "__len__"):
        count = len(source)
        return _Source(func, count, lambda i: _row(func, source[i], len(names)), names,
                       True if shuffle is None else shuffle, shards, shard_id, samples)
    if not (callable(source) or hasattr(source, "__iter__")):
        raise TypeError(f"{func}: source must be random-access (__getitem__ and __len__), "
                        f"iterable, or a function returning an iterator, got {source!r}")
    if shuffle or shards > 1:
        raise ValueError(f"{func}: shuffle and num_shards need a random-access source "
                         "(__getitem__ and __len__), as in MindSpore; got an iterable")
    return _Stream(func, source, names, samples)


class _Batch(Dataset):
    def __init__(self, child: Dataset, size: int, drop: bool) -> None:
        super().__init__(child.get_col_names())
        self._child, self._size_, self._drop = child, size, drop

    def _rows(self, epoch: int) -> Iterator[Row]:
        rows: list[Row] = []
        for row in self._child._rows(epoch):
            rows.append(row)
            if len(rows) == self._size_:
                yield self._stack(rows)
                rows = []
        if rows and not self._drop:
            yield self._stack(rows)

    @staticmethod
    def _stack(rows: list[Row]) -> Row:
        return tuple(np.stack(column) for column in zip(*rows))

    def _size(self) -> int:
        n = self._child._size()
        return n // self._size_ if self._drop else math.ceil(n / self._size_)

    def get_batch_size(self) -> int:
        return self._size_

    def last_batch_short(self) -> bool:
        return not self._drop and self._child._size() % self._size_ != 0


class _Shuffle(Dataset):
    def __init__(self, child: Dataset, buffer: int) -> None:
        super().__init__(child.get_col_names())
        self._child, self._buffer = child, buffer

    def _rows(self, epoch: int) -> Iterator[Row]:
        rng = np.random.default_rng([config.get_seed(), epoch, 1])
        buffer: list[Row] = []
        for row in self._child._rows(epoch):
            buffer.append(row)
            if len(buffer) == self._buffer:
                yield buffer.pop(int(rng.integers(len(buffer))))
        while buffer:
            yield buffer.pop(int(rng.integers(len(buffer))))

    def _size(self) -> int:
        return self._child._size()


class _Map(Dataset):
    def __init__(self, child: Dataset, ops: list[Callable[..., Any]], columns: list[int]
                 ) -> None:
        super().__init__(child.get_col_names())
        self._child, self._ops, self._which = child, ops, columns

    def _rows(self, epoch: int) -> Iterator[Row]:
        for row in self._child._rows(epoch):
            out = list(row)
            values = [out[k] for k in self._which]
            for f in self._ops:
                result = f(*values)
                values = list(result) if len(self._which) > 1 else [result]
                if len(values) != len(self._which):
                    raise ValueError(f"Dataset.map: an operation returned {len(values)} "
                                     f"values for the {len(self._which)} input columns")
            for k, v in zip(self._which, values):
                out[k] = np.asarray(v)
            yield tuple(out)

    def _size(self) -> int:
        return self._child._size()


class _Repeat(Dataset):
    def __init__(self, child: Dataset, count: int) -> None:
        super().__init__(child.get_col_names())
        self._child, self._count = child, count

    def _rows(self, epoch: int) -> Iterator[Row]:
        for k in range(self._count):
            yield from self._child._rows(epoch * self._count + k)

    def _size(self) -> int:
        return self._child._size() * self._count


__getattr__ = missing("mindspore.dataset", {
    "MnistDataset": "NumpySlicesDataset or GeneratorDataset over arrays you load (simpar "
                    "reads no dataset files and fetches nothing)",
    "Cifar10Dataset": "NumpySlicesDataset or GeneratorDataset over arrays you load",
    "ImageFolderDataset": "GeneratorDataset over a random-access source you write",
    "MindDataset": "GeneratorDataset over a random-access source you write",
    "TFRecordDataset": "GeneratorDataset over a random-access source you write",
    "DistributedSampler": "num_shards and shard_id on the dataset",
    "RandomSampler": "shuffle=True on the dataset",
    "SequentialSampler": "shuffle=False on the dataset",
    "vision": "Dataset.map with numpy callables",
    "transforms": "Dataset.map with numpy callables",
})
