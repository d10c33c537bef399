"""Radix prefix cache (token sequence -> slots) with LRU eviction, lock counts and a chain export."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from kvcanary.hostcopy import packed

from .errors import ConfigError

_EMPTY = torch.empty(0, dtype=torch.int64)


class RadixNode:
    """A run of tokens and their slots, below its parent's run."""

    def __init__(self, parent: RadixNode | None, key: tuple[int, ...], value: torch.Tensor,
                 start: int) -> None:
        self.parent, self.key, self.value, self.start = parent, key, value, start
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.lock_ref = 0
        self.last_access = 0
        self.holders: tuple[str, ...] = ()  # the requests that last held (matched or inserted) this run
        self.poisoned = False  # quarantined: never matched again, dropped once no request holds it

    @property
    def end(self) -> int:
        """Position after this node's last token."""
        return self.start + len(self.key)


@dataclass(frozen=True)
class MatchResult:
    """Slots of the longest cached page-aligned prefix and the deepest node reached."""

    slots: torch.Tensor
    node: RadixNode

    @property
    def length(self) -> int:
        """Matched tokens."""
        return int(self.slots.numel())


@dataclass(frozen=True)
class CachedChains:
    """Flat export of every cached node for a sweep (one chain per node)."""

    slots: torch.Tensor
    chain_starts: torch.Tensor
    chain_lens: torch.Tensor
    first_positions: torch.Tensor
    prev_slots: torch.Tensor
    unlocked: torch.Tensor
    holders: tuple[tuple[str, ...], ...] = ()

    @property
    def num_chains(self) -> int:
        """Number of chains (nodes)."""
        return int(self.chain_lens.numel())


@dataclass(frozen=True)
class HostChains:
    """:class:`CachedChains` on the host: numpy int64 fields, ``unlocked`` bool."""

    slots: np.ndarray
    chain_starts: np.ndarray
    chain_lens: np.ndarray
    first_positions: np.ndarray
    prev_slots: np.ndarray
    unlocked: np.ndarray
    holders: tuple[tuple[str, ...], ...] = ()

    def to(self, device: torch.device) -> CachedChains:
        """The chains on ``device``, in one copy."""
        fields = (self.slots, self.chain_starts, self.chain_lens, self.first_positions, self.prev_slots)
        ints, unlocked = packed(fields, self.unlocked, device)
        slots, starts, lens, first, prev = torch.split(ints, [f.size for f in fields])
        return CachedChains(slots, starts, lens, first, prev, unlocked, self.holders)


class RadixCache:
    """Page-aligned radix tree; locked nodes are never evicted; `on_evict` receives evicted slots."""

    def __init__(self, page_size: int = 1, on_evict: Callable[[torch.Tensor], None] | None = None
                 ) -> None:
        if page_size < 1:
            raise ConfigError("page_size must be >= 1")
        self.page_size = page_size
        self.root = RadixNode(None, (), _EMPTY, 0)
        self.root.lock_ref = 1
        self._on_evict = on_evict
        self._clock = itertools.count(1)
        # bumped by every change an export shows (structure, slots, locks, holders): the export is rebuilt only then
        self.version = 0
        self._exported: tuple[int, torch.device, CachedChains] | None = None
        self._host: tuple[int, HostChains] | None = None

    def _child_key(self, key: tuple[int, ...]) -> tuple[int, ...]:
        return key[:self.page_size]

    def _common(self, a: tuple[int, ...], b: tuple[int, ...]) -> int:
        """Page-aligned common prefix length."""
        n = 0
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            n += 1
        return n - n % self.page_size

    def _split(self, node: RadixNode, at: int) -> RadixNode:
        """Split node so that its first `at` tokens become a new parent; return that parent."""
        parent = node.parent
        if parent is None:
            raise ConfigError("cannot split the root")
        self.version += 1
        head = RadixNode(parent, node.key[:at], node.value[:at], node.start)
        head.lock_ref, head.last_access = node.lock_ref, node.last_access
        head.holders, head.poisoned = node.holders, node.poisoned
        parent.children[self._child_key(head.key)] = head
        node.parent, node.key, node.value, node.start = head, node.key[at:], node.value[at:], node.start + at
        head.children[self._child_key(node.key)] = node
        return head

    def match(self, tokens: list[int] | tuple[int, ...]) -> MatchResult:
        """Longest cached page-aligned prefix of tokens; touches the nodes on the path (LRU)."""
        key = tuple(tokens[:len(tokens) - len(tokens) % self.page_size])
        node, parts, stamp = self.root, [], next(self._clock)
        while key:
            child = node.children.get(self._child_key(key))
            if child is None or child.poisoned:  # a quarantined run is a cache miss
                break
            n = self._common(child.key, key)
            if n < len(child.key):
                child = self._split(child, n) if n else node
                if child is node:
                    break
            child.last_access = stamp
            parts.append(child.value)
            node, key = child, key[n:]
        return MatchResult(torch.cat(parts) if parts else _EMPTY, node)

    def insert(self, tokens: list[int] | tuple[int, ...], slots: torch.Tensor,
               holder: str | None = None) -> tuple[int, RadixNode]:
        """Insert a page-aligned key (written by request ``holder``); return (tokens already cached, deepest node)."""
        if len(tokens) % self.page_size or len(tokens) != slots.numel():
            raise ConfigError("insert needs a page-aligned key with one slot per token")
        key, node, pos, stamp = tuple(tokens), self.root, 0, next(self._clock)
        self.version += 1
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                new = RadixNode(node, key, slots[pos:].clone(), pos)
                new.last_access, new.poisoned = stamp, node.poisoned  # below a quarantined run: never matched
                _hold(new, holder)
                node.children[self._child_key(key)] = new
                return pos, new
            n = self._common(child.key, key)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = stamp
            _hold(child, holder)
            node, key, pos = child, key[n:], pos + n
        return pos, node

    def lock(self, node: RadixNode, holder: str | None = None) -> None:
        """Protect node and its ancestors from eviction (held by request ``holder``)."""
        self.version += 1
        cur: RadixNode | None = node
        while cur is not None and cur is not self.root:
            cur.lock_ref += 1
            _hold(cur, holder)
            cur = cur.parent

    def unlock(self, node: RadixNode) -> None:
        """Undo one lock()."""
        self.version += 1
        cur: RadixNode | None = node
        while cur is not None and cur is not self.root:
            if cur.lock_ref <= 0:
                raise ConfigError("unlock of an unlocked radix node")
            cur.lock_ref -= 1
            cur = cur.parent
        self._drop_poisoned()

    def quarantine(self, slots: set[int]) -> int:
        """Never reuse a cached run holding one of ``slots`` (table space), nor anything cached after it: those
        nodes are poisoned (a match stops before them) and dropped, slots freed, as soon as no request holds them.
        Returns the slots freed now."""
        for node in list(self.nodes()):
            if not node.poisoned and any(int(s) in slots for s in node.value.tolist()):
                stack = [node]
                while stack:
                    cur = stack.pop()
                    cur.poisoned = True
                    stack.extend(cur.children.values())
        return self._drop_poisoned()

    def _drop_poisoned(self) -> int:
        """Remove poisoned leaves no request holds, until none is left; returns the slots freed."""
        freed, again = 0, True
        while again:
            again = False
            for node in [n for n in self.nodes() if n.poisoned and not n.children and n.lock_ref == 0]:
                freed += self._remove_leaf(node)
                again = True
        return freed

    def nodes(self) -> Iterator[RadixNode]:
        """All nodes except the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def path(self, node: RadixNode) -> tuple[tuple[int, ...], torch.Tensor]:
        """Full key and slots from the root down to node."""
        keys, vals = [], []
        cur: RadixNode | None = node
        while cur is not None and cur is not self.root:
            keys.append(cur.key)
            vals.append(cur.value)
            cur = cur.parent
        key = tuple(t for k in reversed(keys) for t in k)
        return key, torch.cat(list(reversed(vals))) if vals else _EMPTY

    def evictable_slots(self) -> int:
        """Slots held by unlocked nodes."""
        return sum(int(n.value.numel()) for n in self.nodes() if n.lock_ref == 0)

    def total_slots(self) -> int:
        """Slots held by the whole tree."""
        return sum(int(n.value.numel()) for n in self.nodes())

    def evict(self, num_slots: int) -> int:
        """Evict least recently used unlocked leaves until `num_slots` slots were freed."""
        heap = [(n.last_access, id(n), n) for n in self.nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_slots:
            _, _, node = heapq.heappop(heap)
            freed += self._remove_leaf(node)
            parent = node.parent
            if parent is not None and parent is not self.root and not parent.children \
                    and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def _remove_leaf(self, node: RadixNode) -> int:
        parent = node.parent
        if parent is None:
            raise ConfigError("cannot evict the root")
        self.version += 1
        del parent.children[self._child_key(node.key)]
        if self._on_evict is not None:
            self._on_evict(node.value)
        return int(node.value.numel())

    def reset(self) -> None:
        """Drop every unlocked node (flush); locked paths stay."""
        self.evict(self.total_slots())

    def export_host(self) -> HostChains:
        """Every cached node as one chain, on the host: node slots concatenated, with start, length, first position
        and prev slot. The same object while the tree is unchanged."""
        if self._host is not None and self._host[0] == self.version:
            return self._host[1]
        nodes = list(self.nodes())
        n = len(nodes)
        lens = np.fromiter((nd.value.numel() for nd in nodes), np.int64, n)
        chains = HostChains(
            torch.cat([nd.value for nd in nodes]).numpy() if nodes else np.empty(0, np.int64), np.cumsum(lens) - lens,
            lens, np.fromiter((nd.start for nd in nodes), np.int64, n),
            np.fromiter((int(nd.parent.value[-1]) if nd.parent is not None and nd.parent is not self.root else -1
                         for nd in nodes), np.int64, n),
            np.fromiter((nd.lock_ref == 0 for nd in nodes), bool, n), tuple(nd.holders for nd in nodes))
        self._host = (self.version, chains)
        return chains

    def export_chains(self, device: torch.device | str = "cpu") -> CachedChains:
        """:meth:`export_host` on ``device`` (one copy). The same object while the tree is unchanged (a sweep derives
        what it needs once per export object)."""
        device = torch.device(device)
        if self._exported is not None and self._exported[:2] == (self.version, device):
            return self._exported[2]
        chains = self.export_host().to(device)
        self._exported = (self.version, device, chains)
        return chains


_MAX_HOLDERS = 4


def _hold(node: RadixNode, holder: str | None) -> None:
    """Remember ``holder`` among the node's last holders (newest last)."""
    if holder is not None and (not node.holders or node.holders[-1] != holder):
        node.holders = (*node.holders, holder)[-_MAX_HOLDERS:]
