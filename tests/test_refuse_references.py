"""Issue 47, item 6: a check refuses its references whatever the route, not only under their own names.

For each exercise, kvcourse's own answer is handed in by every route a learner might take (an alias, a wrapper,
``functools.partial``, ``getattr`` with a computed name, ``importlib``, a callable class, a bound method), and each
is refused with a message naming the reference; an honest answer, and the check's own use of the references,
pass. Each of these answers passed when the checks matched names in the learner's code.
"""

from __future__ import annotations

import functools
import importlib
import math
import sys
import threading
import time

import pytest
import torch

import kvcourse
from kvcourse import causal_attention as ca  # the alias route: another name for the reference
from kvcourse import decode_attention_ref as dar
from kvcourse.exercises import ExerciseError, ch01, ch02, ch03, ch04
from kvcourse.exercises._core import call_learner, lend, passed, refuse_references, reports_unfinished
from kvcourse.memory import CATALOG
from kvcourse.memory import kv_bytes_per_token as per_token
from kvcourse.memory import max_concurrent_sequences as fits
from kvcourse.paged import BlockManager as BM
from kvcourse.paged import slot_mapping as slots_of


def _through(adapt, ref, *args):
    return adapt(ref)(*args)


class _Holder:
    def __init__(self, answer):
        self.answer = answer

    def run(self, *args):
        return self.answer(*args)


def routes(module, name: str, ref, adapt):
    """kvcourse's ``module.<name>`` (``ref``) as the answer, by every route; ``adapt(ref)`` turns it into a function
    of the exercise's signature. None of these names the reference in its code."""
    computed = "".join(name)  # a name the learner's code never spells
    found = {
        "alias": adapt(ref),
        "wrapper": lambda *a: adapt(ref)(*a),
        "partial": functools.partial(_through, adapt, ref),
        "getattr": lambda *a: adapt(getattr(module, computed))(*a),
        "importlib": lambda *a: adapt(getattr(importlib.import_module(module.__name__), computed))(*a),
        "callable class": type("Answer", (), {"__call__": staticmethod(adapt(ref))})(),
        "bound method": _Holder(adapt(ref)).run,
    }
    if adapt(ref) is ref:  # the same signature: the reference itself, with no frame of the learner's around it
        found["bare partial"] = functools.partial(ref)
    return found


def _same(ref):
    return ref


def honest_attention(q, k, v):
    t, s = q.shape[2], k.shape[2]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    allowed = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v


def honest_decode(q, k, v, seq_lens):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("bhd,bhsd->bhs", q, k) / math.sqrt(q.shape[-1])
    lens = torch.as_tensor(seq_lens, device=q.device)
    valid = torch.arange(k.shape[2], device=q.device)[None, :] < lens[:, None]
    return torch.einsum("bhs,bhsd->bhd", torch.softmax(scores.masked_fill(~valid[:, None], float("-inf")), -1), v)


def honest_bytes(config, bytes_per_value):
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return 2 * config["num_hidden_layers"] * config.get("num_key_value_heads", heads) * head_dim * bytes_per_value


def honest_slots(block_tables, seq_lens, query_lens, block_size):
    return [
        table[p // block_size] * block_size + p % block_size
        for table, n, q in zip(block_tables, seq_lens, query_lens)
        for p in range(n - q, n)
    ]


EXERCISES = {
    "ch01-ex-attention": (ch01.check_attention, kvcourse, "causal_attention", ca, _same, honest_attention),
    "ch02-ex-decode": (ch02.check_decode_attention, kvcourse, "decode_attention_ref", dar, _same, honest_decode),
    "ch03-ex-per-token": (
        ch03.check_bytes_per_token,
        kvcourse.memory,
        "kv_bytes_per_token",
        per_token,
        lambda ref: lambda c, b: ref(c, "fp32") * b // 4,
        honest_bytes,
    ),
    "ch04-ex-slot-mapping": (
        ch04.check_slot_mapping,
        kvcourse.paged,
        "slot_mapping",
        slots_of,
        lambda ref: (
            lambda tables, lens, qs, bs: sum((ref(t, range(n - q, n), bs) for t, n, q in zip(tables, lens, qs)), [])
        ),
        honest_slots,
    ),
}
CASES = [
    (label, route)
    for label, (_, module, name, ref, adapt, _) in EXERCISES.items()
    for route in routes(module, name, ref, adapt)
]


@pytest.mark.parametrize("label,route", CASES, ids=[f"{label}-{route}" for label, route in CASES])
def test_the_reference_is_refused_whatever_the_route(label, route):
    check, module, name, ref, adapt, _ = EXERCISES[label]
    answer = routes(module, name, ref, adapt)[route]
    with pytest.raises(ExerciseError, match=f"kvcourse's (own )?{name}") as caught:
        check(answer)
    assert "Correct" not in str(caught.value)
    assert sys.getprofile() is None  # the watch ends with the check


@pytest.mark.parametrize("label", EXERCISES)
def test_an_honest_answer_passes_and_the_check_may_use_the_reference(label):
    check, *_, honest = EXERCISES[label]
    assert check(honest)  # the check itself computes what it expects with the reference meanwhile


def test_the_message_names_the_reference_and_says_the_exercise_is_to_write_it():
    with pytest.raises(ExerciseError) as caught:
        ch01.check_attention(lambda q, k, v: getattr(kvcourse, "causal_" + "attention")(q, k, v))
    message = str(caught.value)
    assert "calls kvcourse's causal_attention" in message and "the exercise is to write it" in message
    assert __file__ in message  # where the learner's code called it


def test_fit_refuses_max_concurrent_sequences():
    def via_the_package(config, num_parameters, seq_len, gpu_bytes, w, k, u):
        name = next(n for n, e in CATALOG.items() if dict(e.config) == config)
        dtypes = {2: "bf16", 1: "fp8"}
        return fits(name, gpu_bytes, seq_len, dtype=dtypes[k], weight_dtype=dtypes[w], gpu_memory_utilization=u)

    with pytest.raises(ExerciseError, match="kvcourse's max_concurrent_sequences"):
        ch03.check_max_sequences(via_the_package)


def test_fit_passes_with_the_learners_own_bytes_per_token():
    def max_sequences(config, num_parameters, seq_len, gpu_bytes, w, k, utilization=0.9):
        budget = utilization * gpu_bytes - w * num_parameters
        return max(0, int(budget // (honest_bytes(config, k) * seq_len)))  # an earlier answer, reused

    assert ch03.check_max_sequences(max_sequences)


def test_the_sharing_formula_refuses_a_simulation_on_the_chapters_block_manager():
    def simulated(p, n, new_tokens, b):
        bm = BM(n * -(-(p + new_tokens) // b) + 1, b)
        bm.allocate(0, p)
        for child in range(1, n):
            bm.fork(0, child)
        for _ in range(new_tokens):
            for seq in range(n):
                bm.append_slot(seq)
        return bm.num_used_blocks

    with pytest.raises(ExerciseError, match="kvcourse's BlockManager"):
        ch04.check_parallel_sampling_blocks(simulated)


def test_a_cache_class_that_borrows_the_package_methods_is_refused():
    class Borrowed:  # not a subclass: the package's methods, bound to the learner's own class
        __init__ = kvcourse.KVCache.__init__
        _empty = kvcourse.KVCache._empty
        update = kvcourse.KVCache.update
        _grow = kvcourse.KVCache._grow
        seq_len = kvcourse.KVCache.seq_len

    with pytest.raises(ExerciseError, match="kvcourse's KVCache"):
        ch02.check_cache_update(Borrowed, device="cpu")


# ---- the mechanism, on a check written here ------------------------------------------------------
def _check_softmax(fn, *, lent=None):
    """A check refusing ``torch.softmax`` (a C function: no code object) and kvcourse's causal_attention."""
    refuse_references(
        fn, {"softmax": torch.softmax, "causal_attention": kvcourse.causal_attention}, "write the softmax yourself."
    )
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    # The check's own use of the reference. A check in kvcourse/exercises calls it directly; this one lives in a
    # test file, which the watch takes for the learner's code, so it lends the call to itself.
    want = lend(torch.softmax)(x, dim=-1)
    got = call_learner("softmax", fn, x, *([lend(lent)] if lent else []))
    assert torch.allclose(got, want)
    return passed("ok")


check_softmax = reports_unfinished(_check_softmax)


def test_a_c_function_is_refused_when_the_learners_code_calls_it():
    assert check_softmax(lambda x: x.exp() / x.exp().sum(-1, keepdim=True))
    with pytest.raises(ExerciseError, match="kvcourse's softmax"):
        check_softmax(lambda x: torch.softmax(x, dim=-1))
    with pytest.raises(ExerciseError, match="own softmax"):
        check_softmax(functools.partial(torch.softmax, dim=-1))  # the reference itself, partially applied


def test_a_reference_lent_by_the_check_may_be_called():
    def uses_lent(x, attend):  # the check lends kvcourse's causal_attention, which it refuses as an answer
        q = x[None, None]
        attend(q, q, q)
        e = x.exp()
        return e / e.sum(-1, keepdim=True)

    assert check_softmax(uses_lent, lent=kvcourse.causal_attention)
    with pytest.raises(ExerciseError, match="kvcourse's causal_attention"):  # not lent: refused
        check_softmax(lambda x: uses_lent(x, kvcourse.causal_attention))


def test_a_thread_the_learners_code_starts_is_watched():
    def in_a_thread(x):
        out = {}
        worker = threading.Thread(target=lambda: out.setdefault("y", torch.softmax(x, dim=-1)))
        worker.start()
        worker.join()
        return out["y"]

    with pytest.raises(ExerciseError, match="kvcourse's softmax"):
        check_softmax(in_a_thread)


def test_taking_the_watch_away_is_refused():
    def unwatched(x):
        sys.setprofile(None)
        return torch.softmax(x, dim=-1)

    with pytest.raises(ExerciseError, match="sys.setprofile"):
        check_softmax(unwatched)
    assert sys.getprofile() is None


def test_refuse_references_outside_a_check_is_a_clear_error():
    with pytest.raises(RuntimeError, match="@check"):
        refuse_references(print, {"print": print}, "x")


def _sharing(p, n, new_tokens, b):
    return p // b + n * (-(-(p + new_tokens) // b) - p // b)


def test_the_watch_costs_little(capsys):
    # The check simulates a BlockManager (its refused reference) for every expected answer; watching only while
    # the learner's code runs keeps that at full speed. Compared with the same check, its refusal taken out.
    module = sys.modules["kvcourse.exercises._core"]  # where @check refuses the references
    times = {}
    for watched in (False, True, False, True):
        module.refuse_references = refuse_references if watched else (lambda *a: None)
        try:
            start = time.perf_counter()
            assert ch04.check_parallel_sampling_blocks(_sharing)
            times[watched] = min(times.get(watched, 1e9), time.perf_counter() - start)
        finally:
            module.refuse_references = refuse_references
    with capsys.disabled():
        print(
            f"\ncheck_parallel_sampling_blocks: {times[False] * 1e3:.1f} ms unwatched, {times[True] * 1e3:.1f} ms "
            f"watched"
        )
    assert times[True] < 2 * times[False] + 0.05  # a shared 2-core machine: a loose bound, the figure is printed
