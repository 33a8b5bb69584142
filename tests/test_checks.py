"""kvcourse.checks: the shared argument checks, and the rules they encode."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvcourse import checks
from kvcourse.checks import (check_bool, check_callable, check_choice, check_fits_in_memory, check_float,
                             check_hashable, check_int, check_token_ids, is_int)  # fmt: skip


def test_an_int_is_an_int_or_a_numpy_integer_never_a_bool():
    assert [is_int(x) for x in (3, np.int64(3), np.uint8(3), -1)] == [True] * 4
    assert [is_int(x) for x in (True, np.bool_(True), 3.0, "3", None, torch.tensor(3))] == [False] * 6


def test_check_int_returns_a_plain_int_and_names_the_argument():
    got = check_int("n", np.int32(7), min=1)
    assert got == 7 and type(got) is int
    assert check_int("limit", None, min=1, none_ok=True) is None
    with pytest.raises(TypeError, match=r"^layer_idx must be an int in \[0, 3\], got bool True$"):
        check_int("layer_idx", True, min=0, max=3)
    with pytest.raises(TypeError, match=r"^n must be an int >= 1, got float 2.0$"):
        check_int("n", 2.0, min=1)
    with pytest.raises(ValueError, match=r"^n must be an int >= 1, got 0$"):
        check_int("n", 0, min=1)
    with pytest.raises(ValueError, match=r"^k must be an int <= 5, got 6$"):
        check_int("k", 6, max=5)
    with pytest.raises(TypeError, match=r"^limit must be an int >= 1 or None, got str 'x'$"):
        check_int("limit", "x", min=1, none_ok=True)


def test_check_float_refuses_nan_always_and_inf_unless_asked():
    assert check_float("t", np.float32(0.5), min=0) == 0.5 and check_float("t", 2, min=0) == 2.0
    assert check_float("x", math.inf, min=0, finite=False) == math.inf
    with pytest.raises(ValueError, match=r"^t must be a finite number >= 0, got inf \(not finite\)$"):
        check_float("t", math.inf, min=0)
    with pytest.raises(ValueError, match="got nan"):
        check_float("x", math.nan, finite=False)
    with pytest.raises(ValueError, match=r"^p must be a finite number in \(0, 1\], got 0.0$"):
        check_float("p", 0.0, min=0, max=1, min_open=True)
    with pytest.raises(ValueError, match=r"^w must be a finite number in \[0, 1\), got 1.0$"):
        check_float("w", 1.0, min=0, max=1, max_open=True)
    with pytest.raises(TypeError, match="got bool True"):
        check_float("t", True)


def test_check_bool_refuses_truthy_strings():
    assert check_bool("flag", np.bool_(False)) is False
    for bad in ("no", "false", 0, 1, None):
        with pytest.raises(TypeError, match=r"flag must be a bool \(True or False\)"):
            check_bool("flag", bad)


def test_choice_callable_hashable():
    assert check_choice("mode", "swap", ("recompute", "swap")) == "swap"
    with pytest.raises(ValueError, match=r"mode must be one of \['recompute', 'swap'\], got 'x'"):
        check_choice("mode", "x", ("recompute", "swap"))
    with pytest.raises(ValueError, match="must be one of"):
        check_choice("mode", ["x"], {"a"})  # unhashable: not a member, not a crash
    with pytest.raises(TypeError, match="clock must be a function"):
        check_callable("clock", "x")
    with pytest.raises(TypeError, match=r"request_id must be hashable \(usable as a dict key\), got tuple"):
        check_hashable("request_id", (1, [2]))


def test_check_token_ids():
    assert check_token_ids("ids", np.array([1, 2]), 10) == [1, 2]
    assert check_token_ids("ids", torch.tensor([1, 2], dtype=torch.int32), 10) == [1, 2]
    assert check_token_ids("ids", (np.int64(9),), 10) == [9]
    with pytest.raises(ValueError, match=r"ids has token ids outside the vocabulary \[0, 10\): \[10, -1\]"):
        check_token_ids("ids", [1, 10, -1], 10)
    with pytest.raises(TypeError, match="ids must hold int token ids, got float 1.0"):
        check_token_ids("ids", [1.0], 10)
    with pytest.raises(TypeError, match="ids must hold integer token ids, got an array of torch.float32"):
        check_token_ids("ids", torch.tensor([1.0]), 10)
    with pytest.raises(TypeError, match=r"ids must be a list of token ids \(use tok.encode\(text\)\), got str"):
        check_token_ids("ids", "hello", 10)
    with pytest.raises(ValueError, match="ids is empty"):
        check_token_ids("ids", [], 10)
    with pytest.raises(ValueError, match="1-D"):
        check_token_ids("ids", torch.zeros(1, 2, dtype=torch.int64), 10)


def test_check_fits_in_memory(monkeypatch):
    monkeypatch.setattr(checks, "available_memory", lambda device: 2**30)
    check_fits_in_memory("num_blocks", 2**30, "cpu", "a pool")
    with pytest.raises(ValueError, match=r"num_blocks: a pool needs 2.00 GiB but only 1.00 GiB is available on cpu"):
        check_fits_in_memory("num_blocks", 2**31, "cpu", "a pool")
    monkeypatch.setattr(checks, "available_memory", lambda device: None)  # the system does not say: no check
    check_fits_in_memory("num_blocks", 2**60, "cpu", "a pool")


def test_available_memory_on_this_machine():
    free = checks.available_memory("cpu")
    assert free is None or free > 0
