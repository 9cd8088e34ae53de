"""The committed gRPC stubs match the .proto; tensors round-trip; every field has a comment."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from testbed.wire import generate
from testbed.wire import testbed_pb2 as pb
from testbed.wire.tensors import TensorError, from_tensor, to_tensor


def test_committed_stubs_are_fresh(tmp_path: Path) -> None:
    for fresh in generate.generate(tmp_path):
        committed = generate.PROTO_DIR / fresh.name
        assert committed.read_bytes() == fresh.read_bytes(), \
            f"{committed.name} is stale: run `make protos`"


def test_every_field_is_commented() -> None:
    text = generate.PROTO.read_text()
    fields = [line for line in text.splitlines()
              if re.match(r"\s+(repeated |map<.*> )?[\w.]+ \w+ = \d+;", line)]
    assert fields
    uncommented = [f for f in fields if "//" not in f]
    assert not uncommented


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_tensor_round_trip(dtype: type) -> None:
    a = np.arange(12, dtype=dtype).reshape(3, 4).T  # non-contiguous on purpose
    msg = to_tensor(a)
    assert list(msg.shape) == [4, 3]
    assert msg.data == np.ascontiguousarray(a).astype(np.dtype(dtype).newbyteorder("<")).tobytes()
    np.testing.assert_array_equal(from_tensor(msg), a)


def test_tensor_with_wrong_byte_count_is_refused() -> None:
    msg = pb.Tensor(data=b"\0" * 7, shape=[2], dtype=pb.FLOAT32)
    with pytest.raises(TensorError, match="needs 8 bytes"):
        from_tensor(msg)
    with pytest.raises(TensorError):
        from_tensor(pb.Tensor(data=b"", shape=[0], dtype=0))
    # a device's shape whose product wraps a 64-bit integer to the bytes sent (here 0)
    for shape in ([2**33, 2**31], [2**62, 4], [3, 2**63 - 1]):
        with pytest.raises(TensorError, match="needs"):
            from_tensor(pb.Tensor(data=b"", shape=shape, dtype=pb.FLOAT32))
    # shapes whose byte count matches but numpy cannot make: a Reject, not a broken stream
    for shape, data in (([1] * 100, b"\0" * 8), ([2**62, 0], b"")):
        with pytest.raises(TensorError, match="cannot be made"):
            from_tensor(pb.Tensor(data=data, shape=shape, dtype=pb.FLOAT64))


def test_an_operand_of_parts_is_joined_along_k_and_each_part_is_cached() -> None:
    from testbed.wire.cache import BlockCache
    from testbed.wire.tensors import operand_array, operand_nbytes

    rng = np.random.default_rng(5)
    a = rng.standard_normal((3, 8))
    cache: BlockCache[np.ndarray] = BlockCache(1 << 20)
    op = pb.Operand()
    for j, (k0, k1) in enumerate(((0, 3), (3, 8))):
        part = op.parts.add(key=f"a/{j}", version=0)
        to_tensor(a[:, k0:k1], part.tensor)
    assert operand_nbytes(op) == a.nbytes
    np.testing.assert_array_equal(operand_array(op, cache, 1), a)
    again = pb.Operand()  # the same parts by key alone: cache hits
    again.parts.add(key="a/0")
    again.parts.add(key="a/1")
    assert operand_nbytes(again) == 0
    np.testing.assert_array_equal(operand_array(again, cache, 1), a)
    # B's parts join along rows; a part stored transposed (W for Wᵀ) is used transposed
    w = rng.standard_normal((4, 8))
    b = pb.Operand()
    to_tensor(w[:, :3], b.parts.add(key="w/0", transposed=True).tensor)
    to_tensor(w[:, 3:], b.parts.add(key="w/1", transposed=True).tensor)
    joined = operand_array(b, cache, 0)
    np.testing.assert_array_equal(joined, w.T)
    assert joined.shape == (8, 4)
    bad = pb.Operand()
    to_tensor(np.ones((3, 2)), bad.parts.add().tensor)
    to_tensor(np.ones((4, 2)), bad.parts.add().tensor)
    with pytest.raises(TensorError, match="do not join"):
        operand_array(bad, cache, 1)


def test_a_held_operand_is_cached_held() -> None:
    """``Operand.held`` reaches the device's cache: a held block outlives the blocks after it."""
    from testbed.wire.cache import BlockCache
    from testbed.wire.tensors import operand_array

    block = np.zeros((4, 4))  # 128 bytes
    cache: BlockCache[np.ndarray] = BlockCache(2 * block.nbytes)
    for key, held in (("w", True), ("x0", False), ("x1", False)):
        op = pb.Operand(key=key, held=held)
        to_tensor(block, op.tensor)
        operand_array(op, cache)
    assert list(cache.keys()) == ["x1", "w"]
    operand_array(pb.Operand(key="w"), cache)  # a key alone: a hit, still held
