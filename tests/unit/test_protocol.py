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
