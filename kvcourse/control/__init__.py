"""The control plane: the objects that decide what runs, and none that compute. No torch, no Triton.

vLLM's v1 core keeps its scheduler and its KV-cache manager free of torch, and so does kvcourse: a
request's state, the block manager and its prefix cache, the radix tree, the host tier's bookkeeping and
the scheduler import only the standard library and numpy. They are what chapter 6's engine runs between
two forwards, and they run where torch does not: in a reader's browser, under Pyodide, or in a test that
forbids ``import torch`` (``tests/test_control_plane.py``).

The names live where the chapters introduce them (:mod:`kvcourse.sequence`, :mod:`kvcourse.paged`,
:mod:`kvcourse.serving.scheduler`) and are importable from there too; this package gathers them, and
none of its modules imports torch, Triton or numpy. (Where torch is installed, ``import kvcourse`` itself
still imports :mod:`kvcourse.kernels` first, to settle where Triton kernels run.) The data plane -- the
model, the K/V pools, the kernels, :func:`~kvcourse.paged.apply_transfers` -- is everything else.
"""

from ..paged.block_hash import CachedBlock, hash_block_tokens
from ..paged.block_manager import BlockManager, NoFreeBlocksError
from ..paged.offload import BlockTransfer, HostBlockPool, OffloadedBlock
from ..paged.pool import Admission, CopyOnWrite, KVPool, PagedKVPool, PrefixCachingPool
from ..paged.prefix_cache import FreeBlockQueue, PrefixCachingBlockManager
from ..paged.radix import RadixCache, longest_prefix_first
from ..sequence import SamplingParams, Sequence, SequenceStatus
from ..serving.scheduler import ScheduledSeq, Scheduler, SchedulerOutput, preempt_newest

__all__ = [
    "Admission",
    "BlockManager",
    "BlockTransfer",
    "CachedBlock",
    "CopyOnWrite",
    "FreeBlockQueue",
    "HostBlockPool",
    "KVPool",
    "NoFreeBlocksError",
    "OffloadedBlock",
    "PagedKVPool",
    "PrefixCachingBlockManager",
    "PrefixCachingPool",
    "RadixCache",
    "SamplingParams",
    "ScheduledSeq",
    "Scheduler",
    "SchedulerOutput",
    "Sequence",
    "SequenceStatus",
    "hash_block_tokens",
    "longest_prefix_first",
    "preempt_newest",
]
