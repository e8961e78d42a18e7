"""``mindspore.Tensor`` and MindSpore's dtype names. A simpar Tensor is a numpy array (a
subclass with MindSpore's ``asnumpy()``): simpar's Cells and primitives take numpy arrays,
and each rank holds its shards as numpy arrays."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["DTYPES", "Tensor", "bool_", "float16", "float32", "float64", "int8", "int16",
           "int32", "int64", "uint8"]

float16, float32, float64 = np.float16, np.float32, np.float64
int8, int16, int32, int64, uint8 = np.int8, np.int16, np.int32, np.int64, np.uint8
bool_ = np.bool_
#: MindSpore's dtype names and the numpy types simpar uses for them.
DTYPES = {"float16": float16, "float32": float32, "float64": float64, "int8": int8,
          "int16": int16, "int32": int32, "int64": int64, "uint8": uint8, "bool_": bool_}


class Tensor(np.ndarray):
    """``Tensor(input_data, dtype=None)``: ``input_data`` (an array, a number, a list) as an
    array of ``dtype`` (a MindSpore dtype name of this module, or any numpy dtype)."""

    def __new__(cls, input_data: Any = None, dtype: Any = None, shape: Any = None,
                init: Any = None, **kwargs: Any) -> Tensor:
        if init is not None or kwargs:
            raise NotImplementedError("Tensor: simpar takes input_data and dtype (and shape "
                                      "for zeros); initialize Parameters with "
                                      "nn.initializer")
        if input_data is None:
            if shape is None:
                raise ValueError("Tensor: give input_data, or a shape and a dtype")
            return np.zeros(shape, dtype=dtype or np.float32).view(cls)
        if isinstance(input_data, np.ndarray) and dtype is None:
            return np.array(input_data).view(cls)
        array = np.array(input_data, dtype=dtype)
        if dtype is None and array.dtype == np.float64:   # Python floats: MindSpore's float32
            array = array.astype(np.float32)
        return array.view(cls)

    def asnumpy(self) -> np.ndarray:
        """The values as a plain numpy array (a copy)."""
        return np.array(self)
