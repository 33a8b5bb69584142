"""Chapter 7's offloading check: the reference agrees with the package, a right answer passes, mistakes get a hint."""

from __future__ import annotations

import random

import pytest
import torch

from kvcourse.exercises import ExerciseError, ch07
from kvcourse.exercises import ch07_offload
from kvcourse.paged import BlockTransfer, PagedKVStore, apply_transfers


def test_the_reference_equals_apply_transfers():
    """The package's batched mover, on one-layer pools, gives the reference's pools on every hidden case."""
    for device, host, moves in ch07_offload._cases(random.Random(3)):
        stores = []
        for pool in (device, host):
            store = PagedKVStore(num_layers=1, num_blocks=pool.shape[0], block_size=2, num_kv_heads=1, head_dim=1)
            store.k_cache[0].copy_(pool.view(store.k_cache[0].shape))
            stores.append(store)
        apply_transfers(*stores, [BlockTransfer(*m) for m in moves])
        want_device, want_host = ch07_offload._replay(device, host, moves)
        assert torch.equal(stores[0].k_cache[0].view(device.shape), want_device)
        assert torch.equal(stores[1].k_cache[0].view(host.shape), want_host)


def right_replay(device, host, transfers):
    for direction, src, dst in transfers:
        if direction == "to_host":
            host[dst] = device[src]
        else:
            device[dst] = host[src]


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_a_right_answer_passes(seed, device):
    assert ch07.check_replay(right_replay, seed=seed, device=device)


def test_the_device_pool_is_on_the_devices_argument_and_the_host_pool_on_the_cpu(device):
    seen = set()

    def spy(device_pool, host_pool, transfers):
        seen.add((device_pool.device.type, host_pool.device.type))
        right_replay(device_pool, host_pool, transfers)

    assert ch07.check_replay(spy, device=device) and seen == {(device.type, "cpu")}


def grouped(first):
    def replay(device, host, transfers):
        right_replay(device, host, sorted(transfers, key=lambda t: t[0] != first))  # stable: order kept within

    return replay


def gathered(device, host, transfers):
    d0, h0 = device.clone(), host.clone()
    for direction, src, dst in transfers:
        if direction == "to_host":
            host[dst] = d0[src]
        else:
            device[dst] = h0[src]


def swapped_roles(device, host, transfers):
    right_replay(device, host, [("to_device" if d == "to_host" else "to_host", s, t) for d, s, t in transfers])


def not_in_place(device, host, transfers):
    device, host = device.clone(), host.clone()
    right_replay(device, host, transfers)
    return device, host


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (grouped("to_host"), "not all copies to the host first"),
        (grouped("to_device"), "not all copies to the device first"),
        (lambda d, h, t: right_replay(d, h, t[::-1]), "front to back"),
        (swapped_roles, "copies device block src into host block dst"),
        (gathered, "reads its source as the moves before it left it"),
        (not_in_place, "in place"),
        (lambda d, h, t: right_replay(d, h, t[:1]), "For each"),
    ],
)
def test_wrong_answers_get_their_hint(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch07.check_replay(wrong)


def test_handing_in_the_package_is_refused():
    def uses_it(device, host, transfers):
        apply_transfers(device, host, transfers)

    with pytest.raises(ExerciseError, match="apply_transfers"):
        ch07.check_replay(uses_it)
