"""Operand cache keys by tensor identity: shared operands hit, anything else never does."""

from __future__ import annotations

import numpy as np
import torch

from testbed.ps_backend.executor import OperandKeys


def test_same_tensor_same_key_and_copy() -> None:
    keys = OperandKeys()
    x = torch.randn(8, 4)
    ka, ca = keys.get(x.reshape(-1, 4), 0)  # q_proj's X
    kb, cb = keys.get(x.reshape(-1, 4), 0)  # k_proj's X: another view of the same data
    assert ka == kb and ca is cb
    assert np.array_equal(ca, x.numpy())


def test_transpose_inplace_and_step_make_new_keys() -> None:
    keys = OperandKeys()
    w = torch.randn(6, 4)
    k_n, _ = keys.get(w, 0)
    k_t, c_t = keys.get(w.t(), 0)
    assert k_n != k_t and c_t.shape == (4, 6) and c_t.flags.c_contiguous
    w.add_(1.0)  # in place: same storage, new contents
    k_n2, c_n2 = keys.get(w, 0)
    assert k_n2 != k_n and np.array_equal(c_n2, w.numpy())
    k_next, _ = keys.get(w, 1)
    assert k_next not in (k_n, k_n2, k_t) and k_next.endswith("@1")


def test_freed_tensor_address_is_not_reused_as_a_hit() -> None:
    keys = OperandKeys()
    seen = set()
    for i in range(20):  # the allocator reuses addresses of freed tensors
        t = torch.full((64, 64), float(i))
        key, copy = keys.get(t, 0)
        assert key not in seen and float(copy[0, 0]) == float(i)
        seen.add(key)
        del t
