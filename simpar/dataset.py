"""Data shipped with the package: a small character corpus, and deterministic batches.

Nothing is downloaded. Tokens are byte values (vocabulary 128, ASCII). Batch ``k`` of seed
``s`` is the same on every rank and for every rank count, so parallel runs and the
single-device reference see the same global batch; a rank may load only its rows of it.
"""

from __future__ import annotations

from importlib import resources

import numpy as np

from simpar import counter_rng

__all__ = ["VOCAB_SIZE", "CharCorpus", "load_corpus", "random_classification", "random_images"]

VOCAB_SIZE = 128


def load_corpus() -> str:
    """The shipped corpus (about 50 kB of generated sentences about sharding and sums)."""
    return resources.files("simpar").joinpath("data/corpus.txt").read_text(encoding="ascii")


class CharCorpus:
    """Next-character prediction batches: ``ids[b, t]`` predicts ``labels[b, t] = ids[b, t+1]``."""

    def __init__(self, text: str | None = None, seed: int = 0) -> None:
        raw = load_corpus() if text is None else text
        codes = np.frombuffer(raw.encode("ascii", errors="replace"), dtype=np.uint8)
        if codes.max(initial=0) >= VOCAB_SIZE:
            raise ValueError("CharCorpus: the text must be ASCII (byte values < 128)")
        self.tokens = codes.astype(np.int32)
        self.seed = seed

    def batch(self, step: int, batch_size: int, seq_length: int,
              rows: tuple[int, int] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The global batch for ``step``: (ids, labels), each (batch_size, seq_length) int32;
        with ``rows=(a, b)`` only its rows a..b-1, which is all a rank holding them loads."""
        if len(self.tokens) <= seq_length + 1:
            raise ValueError(f"CharCorpus: seq_length {seq_length} is too long for a corpus of "
                             f"{len(self.tokens)} tokens")
        a, b = _rows(rows, batch_size)
        rng = np.random.default_rng([self.seed, step])
        starts = rng.integers(0, len(self.tokens) - seq_length - 1, size=batch_size)[a:b]
        idx = starts[:, None] + np.arange(seq_length + 1)[None, :]
        window = self.tokens[idx]
        return window[:, :-1].copy(), window[:, 1:].copy()


def random_classification(step: int, batch_size: int, features: int, classes: int,
                          seed: int = 0, dtype: object = np.float32,
                          rows: tuple[int, int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """A learnable synthetic task for the MLP: labels from a fixed random linear teacher.
    Each sample is a function of (seed, step, its global row), so ``rows=(a, b)`` draws only
    rows a..b-1, bit for bit those of the whole batch."""
    a, b = _rows(rows, batch_size)
    teacher = np.random.default_rng([seed, 10**6]).standard_normal((features, classes))
    key = counter_rng.mix_int(counter_rng.mix_int(seed) ^ step)
    x = counter_rng.normal(key, (batch_size, features), ((a, b), (0, features)))
    y = np.argmax(x @ teacher, axis=1).astype(np.int32)
    return x.astype(dtype), y  # type: ignore[call-overload]


def random_images(step: int, batch_size: int, channels: int, size: int, classes: int,
                  seed: int = 0, dtype: object = np.float32,
                  rows: tuple[int, int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """A learnable synthetic image set for the ResNet: (N, channels, size, size) images, each
    its class's fixed random pattern plus as much noise, and int32 labels. Each image is a
    function of (seed, step, its global row), so ``rows=(a, b)`` draws only rows a..b-1, bit
    for bit those of the whole batch."""
    a, b = _rows(rows, batch_size)
    patterns = np.random.default_rng([seed, 2 * 10**6]).standard_normal(
        (classes, channels, size, size))
    key = counter_rng.mix_int(counter_rng.mix_int(seed) ^ step ^ 0x5EED)
    labels = np.minimum((counter_rng.uniform(key, (batch_size,), ((a, b),)) * classes
                         ).astype(np.int32), classes - 1)
    noise = counter_rng.normal(counter_rng.mix_int(key), (batch_size, channels, size, size),
                               ((a, b), (0, channels), (0, size), (0, size)))
    return (patterns[labels] + noise).astype(dtype), labels


def _rows(rows: tuple[int, int] | None, batch_size: int) -> tuple[int, int]:
    if rows is None:
        return 0, batch_size
    a, b = rows
    if not 0 <= a < b <= batch_size:
        raise ValueError(f"rows must be (start, stop) with 0 <= start < stop <= batch_size "
                         f"{batch_size}, got {rows}")
    return a, b
