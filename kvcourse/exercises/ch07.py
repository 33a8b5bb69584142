"""Checks for chapter 7, *Reusing the cache*.

1. :func:`check_block_hashes` -- the chained hashes of a sequence's full blocks, with a tenant's salt.
2. :func:`check_lru_takes` -- which blocks a free block queue hands out, least recently used first.
3. :func:`check_prefix_lookup` -- the longest cached prefix of a prompt, which the real engine then admits with.
4. :func:`check_replay` -- a step's block moves between the device and host pools, replayed in order.
5. :func:`check_predicted_prefix_ttft` -- the time to first token a prefix-cache hit predicts, from the step cost.

The prefix-caching checks live in :mod:`.ch07_prefix`, the offloading check in :mod:`.ch07_offload` and the
prediction check in :mod:`.ch07_predict` (one job each); the chapter imports all of them from here, as
``from kvcourse.exercises import ch07``.
"""

from __future__ import annotations

from .ch07_offload import check_replay
from .ch07_predict import check_predicted_prefix_ttft
from .ch07_prefix import check_block_hashes, check_lru_takes, check_prefix_lookup

__all__ = [
    "check_block_hashes",
    "check_lru_takes",
    "check_predicted_prefix_ttft",
    "check_prefix_lookup",
    "check_replay",
]
