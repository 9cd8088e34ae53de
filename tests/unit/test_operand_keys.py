"""Operand cache keys by tensor identity: shared operands hit, anything else never does."""

from __future__ import annotations

import numpy as np
import torch

from testbed.ps_backend.executor import OperandKeys


def test_same_tensor_same_key_and_copy() -> None:
    keys = OperandKeys()
    x = torch.randn(8, 4)
    ka, ta, ca = keys.get(x.reshape(-1, 4), 0)  # q_proj's X
    kb, tb, cb = keys.get(x.reshape(-1, 4), 0)  # k_proj's X: another view of the same data
    assert ka == kb and ca is cb and not ta and not tb
    assert np.array_equal(ca, x.numpy())


def test_a_transpose_is_the_stored_tensor_with_a_flag() -> None:
    keys = OperandKeys()
    w = torch.randn(6, 4)
    k_t, t_t, c_t = keys.get(w.t(), 0)  # forward's Wᵀ first
    k_n, t_n, c_n = keys.get(w, 0)  # then the input gradient's W
    assert k_n == k_t and t_t and not t_n
    assert c_t.shape == (4, 6) and np.array_equal(c_t, w.t().numpy())
    assert c_n.flags.c_contiguous and c_t.base is c_n  # one PS copy, seen both ways
    dy = torch.randn(5, 6)
    k_dy, t_dy, _ = keys.get(dy, 0)
    k_dyt, t_dyt, _ = keys.get(dy.t(), 0)
    assert k_dy == k_dyt and not t_dy and t_dyt and k_dy != k_n


def test_inplace_step_and_other_views_make_new_keys() -> None:
    keys = OperandKeys()
    w = torch.randn(6, 4)
    k_n, _, _ = keys.get(w, 0)
    k_s, t_s, c_s = keys.get(w[::2], 0)  # a strided view is no transpose: its own key
    assert k_s != k_n and not t_s and c_s.flags.c_contiguous
    w.add_(1.0)  # in place: same storage, new contents
    k_n2, _, c_n2 = keys.get(w, 0)
    assert k_n2 != k_n and np.array_equal(c_n2, w.numpy())
    k_t2, _, c_t2 = keys.get(w.t(), 0)
    assert k_t2 == k_n2 and np.array_equal(c_t2, w.t().numpy())
    k_next, _, _ = keys.get(w, 1)
    assert k_next not in (k_n, k_n2, k_s) and k_next.endswith("@1")


def test_freed_tensor_address_is_not_reused_as_a_hit() -> None:
    keys = OperandKeys()
    seen = set()
    for i in range(20):  # the allocator reuses addresses of freed tensors
        t = torch.full((64, 64), float(i))
        key, _, copy = keys.get(t, 0)
        assert key not in seen and float(copy[0, 0]) == float(i)
        seen.add(key)
        del t


def test_an_activation_is_shared_and_a_weight_copied() -> None:
    keys = OperandKeys()
    x = torch.randn(8, 4)
    k_x, _, view = keys.get(x, 0, own_copy=False)  # an activation: no copy of its memory
    assert np.shares_memory(view, x.numpy()) and view.flags.c_contiguous
    k_w, _, copy = keys.get(x, 0)  # the same tensor asked as a weight: a copy of its own
    assert k_w == k_x and not np.shares_memory(copy, x.numpy())
    assert keys.get(x, 0, own_copy=False)[2] is copy  # a copy serves an activation too
    x.mul_(2.0)  # what the optimizer does to a weight after the step's GEMMs
    assert np.array_equal(copy * 2.0, x.numpy())
    k_s, _, strided = keys.get(torch.randn(8, 4)[::2], 0, own_copy=False)
    assert strided.flags.c_contiguous  # a strided view is copied into C order regardless
