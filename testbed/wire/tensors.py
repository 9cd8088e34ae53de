"""numpy arrays <-> protocol Tensors: raw little-endian bytes, row-major, with shape and dtype.

Used by both sides, so it needs only numpy (the agent runs on phones without torch).
"""

from __future__ import annotations

import math

import numpy as np

from testbed.wire import testbed_pb2 as pb
from testbed.wire.cache import BlockCache

_TO_WIRE = {np.dtype("<f4"): pb.FLOAT32, np.dtype("<f8"): pb.FLOAT64}
_FROM_WIRE = {v: k for k, v in _TO_WIRE.items()}


class TensorError(ValueError):
    """A Tensor message that does not describe a valid array."""


class MissingBlock(RuntimeError):
    """A tile names a cached block the device does not hold (its cache and the PS's mirror
    disagree: a bug; the device starts a fresh session rather than guess)."""


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
    # exact (Python ints): numpy's int64 product wraps, and a shape such as (2**33, 2**31)
    # would then "need" 0 bytes and fail in reshape, past this check
    expected = math.prod(shape) * dtype.itemsize
    if len(msg.data) != expected:
        raise TensorError(f"tensor of shape {shape} and dtype {dtype} needs {expected} bytes, "
                          f"got {len(msg.data)}")
    try:
        return np.frombuffer(msg.data, dtype=dtype).reshape(shape)
    except ValueError as exc:  # more than numpy's 64 dimensions, or one past its index range
        raise TensorError(f"tensor of shape {shape} cannot be made: {exc}") from None


def operand_array(operand: pb.Operand, cache: BlockCache[np.ndarray], k_axis: int = 1
                  ) -> np.ndarray:
    """The block a tile computes with, as the device resolves it.

    A sent block is decoded and cached under its key (an empty key: not cached); a key alone is
    a cache hit (the PS mirrors the cache, so it is there); ``held`` marks it held either way
    (:class:`~testbed.wire.cache.BlockCache`). The block is stored as it travels, in its
    tensor's stored orientation; a ``transposed`` operand is used as a C-ordered copy of its
    transpose, so the product is the same whether the block arrived now or was cached. An
    operand of ``parts`` is each resolved in order (as the PS's mirror applied them) and joined
    along the contraction, ``k_axis`` (1 for A, 0 for B): the same array as the one block.
    """
    if operand.parts:
        parts = [operand_array(p, cache, k_axis) for p in operand.parts]
        if len({p.shape[1 - k_axis] for p in parts}) != 1 or any(p.ndim != 2 for p in parts):
            raise TensorError(f"operand parts of shapes {[p.shape for p in parts]} do not join "
                              f"along axis {k_axis}")
        return np.concatenate(parts, axis=k_axis)
    if operand.HasField("tensor"):
        stored = from_tensor(operand.tensor)
        if operand.key:
            cache.put(operand.key, operand.version, stored.nbytes, stored, operand.held)
    else:
        cached = cache.get(operand.key, operand.held)
        if cached is None:
            raise MissingBlock(f"block {operand.key!r} is not in the cache")
        stored = cached
    return np.ascontiguousarray(stored.T) if operand.transposed else stored


def operand_nbytes(operand: pb.Operand) -> int:
    """Bytes of tensor data an operand carries (its parts' included)."""
    return len(operand.tensor.data) + sum(operand_nbytes(p) for p in operand.parts)
