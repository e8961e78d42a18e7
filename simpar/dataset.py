"""Data shipped with the package: a small character corpus, and deterministic batches.

Nothing is downloaded. Tokens are byte values (vocabulary 128, ASCII). Batch ``k`` of seed
``s`` is the same on every rank and for every rank count, so parallel runs and the
single-device reference see the same global batch; each rank then takes its slice.
"""

from __future__ import annotations

from importlib import resources

import numpy as np

__all__ = ["VOCAB_SIZE", "CharCorpus", "load_corpus", "random_classification"]

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

    def batch(self, step: int, batch_size: int, seq_length: int) -> tuple[np.ndarray, np.ndarray]:
        """The global batch for ``step``: (ids, labels), each (batch_size, seq_length) int32."""
        if len(self.tokens) <= seq_length + 1:
            raise ValueError(f"CharCorpus: seq_length {seq_length} is too long for a corpus of "
                             f"{len(self.tokens)} tokens")
        rng = np.random.default_rng([self.seed, step])
        starts = rng.integers(0, len(self.tokens) - seq_length - 1, size=batch_size)
        idx = starts[:, None] + np.arange(seq_length + 1)[None, :]
        window = self.tokens[idx]
        return window[:, :-1].copy(), window[:, 1:].copy()


def random_classification(step: int, batch_size: int, features: int, classes: int,
                          seed: int = 0, dtype: object = np.float32
                          ) -> tuple[np.ndarray, np.ndarray]:
    """A learnable synthetic task for the MLP: labels from a fixed random linear teacher."""
    teacher = np.random.default_rng([seed, 10**6]).standard_normal((features, classes))
    x = np.random.default_rng([seed, step]).standard_normal((batch_size, features))
    y = np.argmax(x @ teacher, axis=1).astype(np.int32)
    return x.astype(dtype), y  # type: ignore[call-overload]
