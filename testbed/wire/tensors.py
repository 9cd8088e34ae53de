"""numpy arrays <-> protocol Tensors: raw little-endian bytes, row-major, with shape and dtype.

Used by both sides, so it needs only numpy (the agent runs on phones without torch).
"""

from __future__ import annotations

import numpy as np

from testbed.wire import testbed_pb2 as pb

_TO_WIRE = {np.dtype("<f4"): pb.FLOAT32, np.dtype("<f8"): pb.FLOAT64}
_FROM_WIRE = {v: k for k, v in _TO_WIRE.items()}


class TensorError(ValueError):
    """A Tensor message that does not describe a valid array."""


def wire_dtype(dtype: np.dtype | str) -> int:
    """The protocol DType of a numpy dtype (float32 or float64)."""
    try:
        return _TO_WIRE[np.dtype(dtype).newbyteorder("<")]
    except KeyError:
        raise TensorError(f"unsupported dtype {dtype}; expected float32 or float64") from None


def numpy_dtype(wire: int) -> np.dtype:
    """The numpy dtype of a protocol DType."""
    try:
        return _FROM_WIRE[wire]
    except KeyError:
        raise TensorError(f"unknown tensor dtype code {wire}") from None


def to_tensor(array: np.ndarray, out: pb.Tensor | None = None) -> pb.Tensor:
    """Encode an array (copied to little-endian row-major bytes)."""
    msg = out if out is not None else pb.Tensor()
    wire = wire_dtype(array.dtype)
    msg.dtype = wire
    msg.shape[:] = array.shape
    msg.data = np.ascontiguousarray(array, dtype=_FROM_WIRE[wire]).tobytes()
    return msg


def from_tensor(msg: pb.Tensor) -> np.ndarray:
    """Decode a Tensor; raise TensorError if its bytes do not match its shape and dtype."""
    dtype = numpy_dtype(msg.dtype)
    shape = tuple(int(d) for d in msg.shape)
    if any(d < 0 for d in shape):
        raise TensorError(f"negative dimension in shape {shape}")
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(msg.data) != expected:
        raise TensorError(f"tensor of shape {shape} and dtype {dtype} needs {expected} bytes, "
                          f"got {len(msg.data)}")
    return np.frombuffer(msg.data, dtype=dtype).reshape(shape)
