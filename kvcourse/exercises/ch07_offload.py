"""Check for chapter 7's offloading exercise: the learner replays a step's block moves between two pools.

:func:`check_replay` -- ``replay(device, host, transfers)`` copies blocks between a device pool and a
host pool, in place, in the order the moves were decided (what :func:`kvcourse.paged.apply_transfers`
does). The hidden cases reuse blocks within one step -- a host block freed by one move and filled by
the next, a device block evicted to the host and then overwritten -- so only the recorded order
gives the right pools. Wrong answers are compared with the typical mistakes
(:class:`~kvcourse.exercises._core.Diagnosis`); ``tests/test_exercises_ch07_offload.py`` proves each
hint and checks the private reference against :func:`~kvcourse.paged.apply_transfers`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ..paged.offload import apply_transfers
from ._core import CheckResult, ExerciseError, call_learner, check, describe, diagnose, hidden_rng, learner_device
from ._core import on_host, passed, same

__all__ = ["check_replay"]


def _replay(device, host, transfers, *, order="recorded", swap_roles=False, gather_first=False):
    """The reference (defaults), and the typical mistakes: returns the two pools after the moves."""
    device, host = device.clone(), host.clone()
    if order == "out_first":
        transfers = [t for t in transfers if t[0] == "to_host"] + [t for t in transfers if t[0] == "to_device"]
    elif order == "in_first":
        transfers = [t for t in transfers if t[0] == "to_device"] + [t for t in transfers if t[0] == "to_host"]
    elif order == "reversed":
        transfers = transfers[::-1]
    before = (device.clone(), host.clone())
    for direction, src, dst in transfers:
        to_host = (direction == "to_host") != swap_roles
        pools = (device, host) if to_host else (host, device)
        read = (before[0], before[1]) if to_host else (before[1], before[0])
        pools[1][dst] = (read[0] if gather_first else pools[0])[src]
    return device, host


_ROLES = (
    '("to_host", src, dst) copies device block src into host block dst; ("to_device", src, dst) copies host '
    "block src into device block dst."
)

_MISTAKES = [
    (
        "Replay the moves in the order they were decided, not all copies to the host first: a device block evicted to "
        "the host can be handed to a swap-in later in the same step, and a host block freed by one move can be filled "
        "by the next.",
        lambda d, h, t: _replay(d, h, t, order="out_first"),
    ),
    (
        "Replay the moves in the order they were decided, not all copies to the device first: a host block read by a "
        "swap-in may be filled by an eviction decided after it.",
        lambda d, h, t: _replay(d, h, t, order="in_first"),
    ),
    (
        "The list is in the order the block manager decided the moves: replay it front to back.",
        lambda d, h, t: _replay(d, h, t, order="reversed"),
    ),
    (_ROLES, lambda d, h, t: _replay(d, h, t, swap_roles=True)),
    (
        "Each move reads its source as the moves before it left it: reading every source first and writing after is "
        "a batched copy that ignores a block filled earlier in the same step.",
        lambda d, h, t: _replay(d, h, t, gather_first=True),
    ),
    (
        "Copy into device and host themselves (in place): the runner's pools are those tensors, and a new tensor you "
        "return is thrown away.",
        lambda d, h, t: (d.clone(), h.clone()),
    ),
]


def _cases(rng) -> list[tuple[torch.Tensor, torch.Tensor, list[tuple[str, int, int]]]]:
    def pools(num_device: int, num_host: int):
        # Every block a different value, device positive and host negative, so any wrong copy shows.
        device = torch.arange(num_device * 2, dtype=torch.float32, device="cpu").view(num_device, 2) + 1
        host = -torch.arange(num_host * 2, dtype=torch.float32, device="cpu").view(num_host, 2) - 1
        return device, host

    cases = [
        # Device block 0 evicted to host 1, then host 0 swapped in to device 0: the eviction reads first.
        (*pools(2, 2), [("to_host", 0, 1), ("to_device", 0, 0)]),
        # Host 0 swapped in to device 1, then device 0 evicted into the freed host 0: the swap-in reads first.
        (*pools(2, 1), [("to_device", 0, 1), ("to_host", 0, 0)]),
        # A block moved twice: device 1 -> host 0 -> device 0.
        (*pools(2, 1), [("to_host", 1, 0), ("to_device", 0, 0)]),
    ]
    for _ in range(25):
        nd, nh = rng.randint(1, 5), rng.randint(1, 5)
        moves = [
            (rng.choice(["to_host", "to_device"]), rng.randrange(nd), rng.randrange(nh))
            for _ in range(rng.randint(1, 10))
        ]
        moves = [(d, a, b) if d == "to_host" else (d, b, a) for d, a, b in moves]  # src/dst in their pools
        cases.append((*pools(nd, nh), moves))
    return cases


def _replayed(label: str, replay: Callable, device_pool, host_pool, transfers, *, pool_device) -> tuple:
    """The two pools after the learner's ``replay`` wrote into them (what it returns is not looked at)."""
    device_pool = device_pool.to(pool_device)  # the device pool where this check runs; the host pool on the CPU
    try:
        call_learner("replay", replay, device_pool, host_pool, transfers)
    except ExerciseError as exc:
        if isinstance(exc.__cause__, IndexError):  # a block number read in the wrong pool
            raise ExerciseError(f"{exc}\nHint: {_ROLES}", case=label, hint=_ROLES) from exc
        raise
    return on_host(device_pool), host_pool


@check(
    "check_replay",
    takes="replay(device, host, transfers)",
    references={"apply_transfers": apply_transfers},
    task="replay the moves yourself.",
)
def check_replay(replay: Callable, seed: int = 0, *, device: torch.device | str | None = None) -> CheckResult:
    """``replay(device, host, transfers)`` copies blocks in place: ``transfers`` lists ``(direction, src,
    dst)`` with ``direction`` ``"to_host"`` (device block ``src`` into host block ``dst``) or
    ``"to_device"`` (host block ``src`` into device block ``dst``); ``device``, ``host`` are
    ``[num_blocks, block_size]`` tensors (one layer's K, say).

    The host pool is on the CPU; the device pool on this check's ``device`` argument (default_device() by
    default: the GPU on Colab, where every move crosses between GPU and CPU memory)."""
    pool_device = learner_device(device)
    diagnose(
        replay,
        _cases(hidden_rng()),
        label=lambda d, h, transfers: (
            f"replay(device {tuple(d.shape)}, host {tuple(h.shape)}, {describe(transfers, limit=6)})"
        ),
        reference=_replay,
        mistakes=_MISTAKES,
        hint="For each (direction, src, dst) in order: host[dst] = device[src] for 'to_host', device[dst] = host[src] "
        "for 'to_device', writing into the tensors you were given.",
        compare=lambda got, want: same(got, want, atol=0.0, rtol=0.0),
        device="cpu",  # copies on the CPU, the device pool then moved to pool_device
        call=functools.partial(_replayed, pool_device=pool_device),
    )
    return passed(
        "every move reads what the moves before it left, so a block reused within a step holds the right data."
    )
