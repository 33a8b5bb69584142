"""A token-level radix tree of cached prefixes (chapter 7): SGLang's RadixAttention, small enough to read.

vLLM finds a cached prefix by hashing **full blocks** (:mod:`.prefix_cache`): reuse comes in whole
blocks, and the tokens of a partly filled last block are recomputed. SGLang (Zheng et al., *SGLang:
Efficient Execution of Structured Language Model Programs*, 2024) keeps every cached sequence in a
**radix tree** instead: each edge is labelled with a run of token ids, a path from the root spells a
cached prefix, and a lookup compares tokens, not hashes, so it matches down to the **token**
(no hash to collide, nothing lost at a block boundary).

* :meth:`RadixCache.match_prefix` walks from the root, comparing tokens; where the match ends inside
  an edge, the edge is **split** so the matched part becomes a node of its own.
* :meth:`RadixCache.insert` adds a sequence's tokens (a finished request's prompt and output), sharing
  the path it has in common with what is there.
* A running request **locks** the path of its prefix (:meth:`RadixCache.lock`): a reference count on
  every node from its last node to the root. Only unlocked nodes are **evictable**.
* :meth:`RadixCache.evict` frees tokens **least recently used leaf first**: a leaf's tokens are a
  suffix nobody else's prefix needs; when a parent loses its last child it becomes a leaf in turn.
* :func:`longest_prefix_first` is SGLang's cache-aware scheduling ("lpm"): waiting requests ordered by
  the length of their cached prefix, so requests that share one run while it is still cached.

The tree only does bookkeeping, in tokens: which prefixes are cached, which are in use. SGLang also
keeps, on each node, the KV-pool slots of its tokens (a page size of 1 by default); a slot per token
is what lets it reuse a prefix to the token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..checks import check_int

__all__ = ["RadixCache", "RadixNode", "longest_prefix_first"]


@dataclass(eq=False)
class RadixNode:
    """One node: the edge into it is labelled ``key`` (token ids); ``children`` are keyed by their first token."""

    key: tuple[int, ...] = ()
    parent: RadixNode | None = None
    children: dict[int, RadixNode] = field(default_factory=dict)
    lock_ref: int = 0  # running requests whose prefix goes through this node
    last_access: int = 0  # the cache's clock at the last match or insert through this node
    locked_here: int = 0  # of those, the requests whose prefix ends here (what unlock() may take back)

    @property
    def is_leaf(self) -> bool:
        return not self.children


def _common_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _check_tokens(token_ids: object) -> tuple[int, ...]:
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
        raise TypeError(f"token_ids must be a sequence of ints, got {type(token_ids).__name__}")
    tokens = tuple(token_ids)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise TypeError("token_ids must hold ints only")
    return tokens


class RadixCache:
    """Cached token sequences in a radix tree, with LRU eviction of unlocked leaves.

    Args:
        capacity: most tokens the tree holds (``None``: no limit). :meth:`insert` evicts least recently
            used unlocked leaves to stay within it, and inserts only what fits.
    """

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = check_int("capacity", capacity, min=0, none_ok=True)
        self.root = RadixNode()
        self.root.lock_ref = 1  # never evicted
        self.num_tokens = 0  # tokens held by the tree (each cached once, however many prefixes share it)
        self.num_evicted_tokens = 0
        self._clock = 0

    # ---- lookup ---------------------------------------------------------------------------------
    def match_prefix(self, token_ids: Sequence[int]) -> tuple[int, RadixNode]:
        """The longest cached prefix of ``token_ids``: ``(its length in tokens, its last node)``.

        A match that ends inside an edge splits it there, so the returned node ends exactly at the
        match (a request can then lock just its prefix). Every node on the path is marked used now.
        """
        tokens = _check_tokens(token_ids)
        self._clock += 1
        node, matched = self.root, 0
        node.last_access = self._clock
        while matched < len(tokens):
            child = node.children.get(tokens[matched])
            if child is None:
                break
            n = _common_length(child.key, tokens[matched:])
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = self._clock
            node, matched = child, matched + n
        return matched, node

    # ---- insert ---------------------------------------------------------------------------------
    def insert(self, token_ids: Sequence[int]) -> int:
        """Cache ``token_ids`` (a finished request's prompt and output); return how many of its tokens were
        cached already (its prefix hit). With a ``capacity``, least recently used unlocked leaves are
        evicted to make room, and only the prefix that fits is added."""
        tokens = _check_tokens(token_ids)
        matched, node = self.match_prefix(tokens)
        rest = tokens[matched:]
        if self.capacity is not None and rest:
            node.lock_ref += 1  # the path we are extending must not be evicted to make room for its own tail
            self.evict(max(0, self.num_tokens + len(rest) - self.capacity))
            node.lock_ref -= 1
            rest = rest[: max(self.capacity - self.num_tokens, 0)]
        if rest:
            leaf = RadixNode(rest, node, last_access=self._clock)
            node.children[rest[0]] = leaf
            self.num_tokens += len(rest)
        return matched

    # ---- running requests -----------------------------------------------------------------------
    def lock(self, node: RadixNode) -> None:
        """A running request uses the prefix ending at ``node``: nothing on its path can be evicted."""
        self._check_node(node)
        node.locked_here += 1
        while node is not None:
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        """The request that locked ``node`` is done with it. Only a node passed to :meth:`lock` can be
        unlocked (an ancestor of one holds the lock too, but taking it back there would undercount)."""
        self._check_node(node)
        if node.locked_here <= 0:
            raise ValueError("node is not locked by a request (unlock the node that lock() was given)")
        node.locked_here -= 1
        while node is not None:
            node.lock_ref -= 1
            node = node.parent

    @property
    def num_evictable_tokens(self) -> int:
        """Tokens on nodes no running request holds."""
        return sum(len(n.key) for n in self._nodes() if n.lock_ref == 0)

    # ---- eviction -------------------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` tokens if that many are evictable, least recently used leaf first;
        return how many were freed."""
        check_int("num_tokens", num_tokens, min=0)
        freed = 0
        while freed < num_tokens:
            leaves = [n for n in self._nodes() if n.is_leaf and n.lock_ref == 0 and n is not self.root]
            if not leaves:
                break
            victim = min(leaves, key=lambda n: n.last_access)  # SGLang keeps a heap; a scan is easier to read
            del victim.parent.children[victim.key[0]]
            freed += len(victim.key)
        self.num_tokens -= freed
        self.num_evicted_tokens += freed
        return freed

    def _check_node(self, node: object) -> None:
        """``node`` is a node of this tree and still in it (not evicted). (The root, an empty match, may be locked.)"""
        if not isinstance(node, RadixNode):
            raise TypeError(f"node must be a RadixNode (from match_prefix), got {type(node).__name__}")
        child = node
        while child.parent is not None:  # every edge on the way up still leads here
            if child.parent.children.get(child.key[0]) is not child:
                raise ValueError("node is no longer in the tree (evicted, or from another RadixCache)")
            child = child.parent
        if child is not self.root:
            raise ValueError("node belongs to another RadixCache")

    def format(self, decode: Callable[[tuple[int, ...]], str] = str) -> str:
        """The tree, one edge per line, indented by depth: ``decode(key)``, its token count and lock count."""
        lines = []

        def walk(node: RadixNode, depth: int) -> None:
            for child in sorted(node.children.values(), key=lambda c: c.key):
                lock = f", locked by {child.lock_ref}" if child.lock_ref else ""
                lines.append(f"{'    ' * depth}{decode(child.key)}  ({len(child.key)} tokens{lock})")
                walk(child, depth + 1)

        walk(self.root, 0)
        return "\n".join(lines)

    # ---- internals ------------------------------------------------------------------------------
    def _split(self, child: RadixNode, n: int) -> RadixNode:
        """Cut ``child``'s edge after ``n`` tokens: a new node takes the first ``n``, ``child`` keeps the rest."""
        parent = child.parent
        mid = RadixNode(child.key[:n], parent, lock_ref=child.lock_ref, last_access=child.last_access)
        parent.children[mid.key[0]] = mid
        child.key, child.parent = child.key[n:], mid
        mid.children[child.key[0]] = child
        return mid

    def _nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def __len__(self) -> int:
        return self.num_tokens

    def __repr__(self) -> str:
        return (
            f"RadixCache(num_tokens={self.num_tokens}, capacity={self.capacity}, "
            f"nodes={sum(1 for _ in self._nodes()) - 1})"
        )


def longest_prefix_first(cache: RadixCache, waiting: Sequence[Sequence[int]]) -> list[int]:
    """SGLang's cache-aware scheduling policy ("lpm", longest prefix match): the indices of ``waiting``
    (prompts) ordered by how many of their tokens are cached, most first; ties keep arrival order.

    Matching marks the prefixes as used, so the ones about to run are the last to be evicted.
    """
    matched = [cache.match_prefix(p)[0] for p in waiting]
    return sorted(range(len(waiting)), key=lambda i: -matched[i])
