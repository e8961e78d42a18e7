"""Ops written into the executor's code as expressions (Primitive.inline): bit for bit their
kernels and VJPs, on the shapes and flags each op offers one for.

    python -m pytest tests/test_ops_inline.py -q
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simpar import ops
from simpar.ops._base import Primitive
from simpar.ops.kernels import INLINE_NAMES, Inline


def _eval(template: str, **values: Any) -> Any:
    names = {k: k for k in values}
    return eval(template.format(**names), dict(INLINE_NAMES), values)  # noqa: S307


def _same(got: Any, want: Any) -> bool:
    return (type(got) is np.ndarray and got.dtype == want.dtype and got.shape == want.shape
            and np.array_equal(got, want) and got.flags.c_contiguous == want.flags.c_contiguous)


def _check(op: Primitive, xs: list[np.ndarray], rng: np.random.Generator) -> Inline | None:
    inline = op.inline(tuple(x.shape for x in xs))
    if inline is None:
        return None
    y = op.kernel(*xs)
    args = {f"x{k}": x for k, x in enumerate(xs)}
    assert _same(_eval(inline.forward, **args), y), inline.forward
    dy = rng.standard_normal(y.shape).astype(y.dtype)
    want = op.vjp(xs, y, dy)
    assert len(inline.grads) == len(xs)
    for k, template in enumerate(inline.grads):
        if template is not None:
            got = _eval(template, **args, y=y, dy=dy)
            assert _same(np.asarray(got), want[k]), (k, template)
    return inline


DTYPES = st.sampled_from([np.float32, np.float64])
SIZES = st.integers(1, 5)


@settings(max_examples=60, derandomize=True)
@given(DTYPES, st.booleans(), st.booleans(), st.integers(0, 2), SIZES, SIZES, SIZES, SIZES)
def test_matmul_and_batch_matmul(dtype: Any, ta: bool, tb: bool, batch_dims: int, i: int,
                                 k: int, j: int, b: int) -> None:
    rng = np.random.default_rng([i, k, j, b])
    batch = (b, 2)[:batch_dims]
    a_shape = batch + ((k, i) if ta else (i, k))
    b_shape = batch + ((j, k) if tb else (k, j))
    op = ops.MatMul(ta, tb) if not batch else ops.BatchMatMul(ta, tb)
    xs = [rng.standard_normal(s).astype(dtype) for s in (a_shape, b_shape)]
    inline = _check(op, xs, rng)
    assert inline is not None and None not in inline.grads


def test_batch_matmul_with_broadcast_batch_dims_calls_its_kernel() -> None:
    assert ops.BatchMatMul().inline(((2, 3, 4), (4, 5))) is None
    assert ops.BatchMatMul().inline(((2, 3, 4), (1, 4, 5))) is None


@settings(max_examples=40, derandomize=True)
@given(DTYPES, st.sampled_from(["NCHW", "NHWC"]), st.integers(2, 4), SIZES, SIZES)
def test_bias_add(dtype: Any, data_format: str, ndim: int, n: int, c: int) -> None:
    rng = np.random.default_rng([ndim, n, c])
    shape = (n, c, 3, 2)[:ndim] if data_format == "NCHW" else (n, 3, 2)[:ndim - 1] + (c,)
    xs = [rng.standard_normal(shape).astype(dtype), rng.standard_normal(c).astype(dtype)]
    assert _check(ops.BiasAdd(data_format), xs, rng) is not None


@settings(max_examples=60, derandomize=True)
@given(DTYPES, st.sampled_from(["Add", "Sub", "Mul"]),
       st.sampled_from([((3, 4), (3, 4)), ((2, 3, 4), (4,)), ((1, 4), (3, 4)), ((5,), ()),
                        ((2, 1), (1, 3))]))
def test_binary_ops_give_a_gradient_where_no_sum_is_needed(
        dtype: Any, name: str, shapes: tuple[tuple[int, ...], ...]) -> None:
    rng = np.random.default_rng(len(shapes[0]))
    op = getattr(ops, name)()
    xs = [rng.standard_normal(s).astype(dtype) for s in shapes]
    inline = _check(op, xs, rng)
    assert inline is not None
    out = np.broadcast_shapes(*shapes)
    assert [g is not None for g in inline.grads] == [s == out for s in shapes]


@pytest.mark.parametrize("name", ["Add", "Mul"])
def test_zero_d_shards_call_the_kernel(name: str) -> None:
    """numpy's operators on 0-d arrays give scalars, the kernel arrays."""
    assert getattr(ops, name)().inline(((), ())) is None


def test_ops_without_an_expression_call_their_kernels() -> None:
    assert ops.Softmax().inline(((2, 3),)) is None
    assert ops.RealDiv().inline(((2, 3), (2, 3))) is None
