"""The grader's wire: data crosses as exact built-in types and tensors, objects as proxies, nothing as code."""

from __future__ import annotations

import math
import threading
from multiprocessing import Pipe

import numpy as np
import pytest
import torch

from kvcourse.instructor.wire import Endpoint, RemoteObject, WireError


def _roundtrip(value, *, checker=True):
    sender = Endpoint(None, lends_calls_only=not checker)
    receiver = Endpoint(None, lends_calls_only=checker)
    buffers: list[bytes] = []
    return receiver.decode(sender.encode(value, buffers), buffers)


def test_plain_data_arrives_as_exact_builtin_types():
    class Sneaky(list):
        def __eq__(self, other):
            return True

    value = {
        "a": [1, 2.5, None, True],
        ("t", 1): {3, 4},
        "f": frozenset({"x"}),
        "b": b"\x00\x01",
        "special": [math.inf, -math.inf],
        "n": np.int64(7),
        "sneaky": Sneaky([1]),
    }
    got = _roundtrip(value)
    assert got["a"] == [1, 2.5, None, True] and type(got["a"][3]) is bool
    assert got[("t", 1)] == {3, 4} and got["f"] == frozenset({"x"}) and got["b"] == b"\x00\x01"
    assert got["special"] == [math.inf, -math.inf] and got["n"] == 7 and type(got["n"]) is int
    assert type(got["sneaky"]) is list and got["sneaky"] != [2]  # the subclass's __eq__ stayed behind
    assert math.isnan(_roundtrip(float("nan")))
    array = _roundtrip(np.arange(6, dtype=np.float32).reshape(2, 3))
    assert isinstance(array, np.ndarray) and array.tolist() == [[0, 1, 2], [3, 4, 5]]


def test_tensor_views_keep_their_storage_from_message_to_message():
    sender, receiver = Endpoint(None, lends_calls_only=False), Endpoint(None, lends_calls_only=True)
    buffer = torch.arange(24.0).reshape(2, 3, 4)
    received = []
    for end in (1, 2, 3):
        buffers: list[bytes] = []
        received.append(receiver.decode(sender.encode(buffer[:, :end], buffers), buffers))
    assert [t.shape[1] for t in received] == [1, 2, 3] and torch.equal(received[2], buffer)
    ptrs = {t.untyped_storage().data_ptr() for t in received}
    assert len(ptrs) == 1  # one mirror storage: a view of one buffer stays a view of one buffer
    copies = []
    for _ in range(2):
        buffers = []
        copies.append(receiver.decode(sender.encode(buffer.clone(), buffers), buffers))
    assert copies[0].untyped_storage().data_ptr() != copies[1].untyped_storage().data_ptr()


def test_the_mirrors_the_checker_keeps_are_bounded_there(monkeypatch):
    # issue 36, item 5: an answer returning a view of a fresh storage on every call made the grader keep a mirror
    # of each (11 x 60 MiB). The bound lives on the receiving side, whatever the student's side sends.
    import kvcourse.instructor.wire as wire

    monkeypatch.setattr(wire, "MIRROR_BUDGET", 1 << 20)
    sender, receiver = Endpoint(None, lends_calls_only=False), Endpoint(None, lends_calls_only=True)
    kept = []
    for i in range(11):
        fresh = torch.full((300_000,), float(i), dtype=torch.uint8)  # 300 kB, a new storage each call
        buffers: list[bytes] = []
        got = receiver.decode(sender.encode(fresh[10:], buffers), buffers)
        assert int(got[0]) == i
        kept.append(receiver.mirror_bytes)
    assert max(kept) <= 1 << 20 and kept[-1] == 3 * 300_000  # three fit in the budget; older ones were let go
    # the recently used storage keeps its identity: a second view of it arrives in the same mirror
    again = torch.arange(100, dtype=torch.uint8)
    views = []
    for part in (again[:10], again[5:]):
        buffers = []
        views.append(receiver.decode(sender.encode(part, buffers), buffers))
    assert views[0].untyped_storage().data_ptr() == views[1].untyped_storage().data_ptr()


def test_a_tensor_that_reaches_outside_its_storage_is_refused():
    sender, receiver = Endpoint(None, lends_calls_only=False), Endpoint(None, lends_calls_only=True)
    buffers: list[bytes] = []
    tree = sender.encode(torch.zeros(4), buffers)
    tree["X"][1] = [400]  # a shape that would read 1.6 kB past the 16 bytes sent
    with pytest.raises(WireError):
        receiver.decode(tree, buffers)
    for bad in ({"X": "nonsense"}, {"Q": 1}, [1, 2], {"R": [1, "type", "Evil"]}):
        with pytest.raises(WireError):
            Endpoint(None, lends_calls_only=False).decode(bad, [])  # the student side accepts callables only


def _pair():
    a, b = Pipe()
    checker = Endpoint(a, lends_calls_only=True)
    student = Endpoint(b, lends_calls_only=False)
    return checker, student


def _serving(student):
    """A thread answering the student side's requests until the returned event is set."""
    done = threading.Event()

    def serve():
        while not done.is_set():
            if student.conn.poll(0.05):
                header, bufs = student.receive()
                if header.get("kind") == "req":
                    student.serve_one(header, bufs)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return done, thread


def test_a_checks_tensors_reach_the_student_on_the_host_and_come_back_written(device):
    """The check may work on a GPU (chapter 5's kernels): the student's code gets host copies, and what it writes
    into them is copied back into the check's own tensors, on their device."""
    checker, student = _pair()
    seen = []

    def kernel_like(x, out):
        seen.append((x.device.type, out.device.type))
        out[:] = x * 2  # in place, as a kernel writes its output

    buffers: list[bytes] = []
    proxy = checker.decode(student.encode(kernel_like, buffers), buffers)
    done, thread = _serving(student)
    try:
        x, out = torch.arange(6.0, device=device), torch.zeros(6, device=device)
        proxy(x, out)
    finally:
        done.set()
        thread.join(5)
    assert seen == [("cpu", "cpu")]
    assert out.device.type == device.type and out.cpu().tolist() == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]


def test_a_strided_view_reaches_the_student_with_its_layout_from_any_device(device):
    """Chapter 5's hidden cases pad K/V's rows and interleave K and V in one buffer, and hand the kernel the
    strides: the view must arrive with them, on its whole buffer, from a GPU too (``.cpu()`` packed it there, and
    the kernel read outside it). What the student writes through the view comes back into the check's buffer."""
    checker, student = _pair()
    seen = []

    def kernel_like(k, v):
        seen.append((k.stride(), v.stride(), k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()))
        v.mul_(-1)

    buffers: list[bytes] = []
    proxy = checker.decode(student.encode(kernel_like, buffers), buffers)
    done, thread = _serving(student)
    try:
        kv = torch.arange(2 * 3 * 12, dtype=torch.float32, device=device).reshape(3, 2, 12)  # K and V side by side
        k, v = kv[:, 0, :8], kv[:, 1, :8]  # padded rows: 8 values of 12
        before = kv.clone()
        proxy(k, v)
    finally:
        done.set()
        thread.join(5)
    assert seen == [((24, 1), (24, 1), True)]  # the strides the check drew, on one shared buffer
    assert torch.equal(kv[:, 1, :8], -before[:, 1, :8]) and torch.equal(kv[:, 0], before[:, 0])
    assert torch.equal(kv[:, 1, 8:], before[:, 1, 8:])  # the padding is untouched


def test_objects_cross_as_proxies_and_the_checker_lends_calls_only():
    checker, student = _pair()
    secrets = {"reference": "the answer"}

    def hash_fn(x):  # what the checker lends, e.g. chapter 7's hash function
        return x * 2

    hash_fn.secrets = secrets

    class Cache:
        def __init__(self, n):
            self.buffer = torch.zeros(n)

        @property
        def seq_len(self):
            return int((self.buffer != 0).sum())

        def write(self, i, value, out):
            self.buffer[i] = value
            out[i] = value  # in place, as a kernel writes its output
            return self.buffer[: i + 1]

    def answer(fn):
        return fn(21)

    def peek(fn):
        return fn.secrets

    lent = {"Cache": Cache, "answer": answer, "peek": peek}
    buffers: list[bytes] = []
    tree = student.encode(lent, buffers)
    done, thread = _serving(student)
    try:
        proxies = checker.decode(tree, buffers)
        cls = proxies["Cache"]
        assert isinstance(cls, type) and cls.__name__ == "Cache"
        cache = cls(4)
        assert isinstance(cache, RemoteObject) and repr(cache) == "<Cache object>"
        out = torch.zeros(4)
        first = cache.write(1, 5.0, out)
        assert cache.seq_len == 1 and first.tolist() == [0.0, 5.0]
        assert out.tolist() == [0.0, 5.0, 0.0, 0.0]  # written back into the checker's tensor
        second = cache.write(2, 7.0, out)
        assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
        with pytest.raises(AttributeError):
            cache.missing
        assert proxies["answer"](hash_fn) == 42  # the student's code called back into the checker
        with pytest.raises(AttributeError, match="can only be called"):
            proxies["peek"](hash_fn)
    finally:
        done.set()
        thread.join(5)
