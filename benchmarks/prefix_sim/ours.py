"""A standalone model of our prefix-sharing policy (sglang_dsv4/srt/radix_cache.py + state.py).

- A token-granular radix tree over token ids. Every cached token is charged its compressed
  entries (``V4Costs.ours_token``); nothing else lives in the tree.
- Snapshots (window ring + compressor partial state, ``V4Costs.ours_snapshot`` each) sit at exact
  positions P of a path (owned by the token at P-1). They are taken where the server takes them:
  at every checkpoint (each prefill chunk end, the prompt end), at the finish (prompt + output - 1:
  the last generated token has no KV), and at the divergence point D of a request whose match
  ran past its deepest snapshot (D = the full match length, so the next request leaving the path
  there resumes at D), and at prompt_len - 1 of a fan-out prefix request (``max_new_tokens=0``,
  as n>1 sampling and frontend forks send the shared prompt first; the copies that follow can
  match at most prompt_len - 1 tokens). ``fan_out_snapshot=False`` models the server before that
  last rule.
- A match is capped at prompt_len - 1, as SGLang's is, and resumes at the deepest snapshot at or
  before the full match; everything after it is recomputed.
- One byte budget for cached tokens, snapshots and the running request (its ring and its own
  not-yet-cached tokens). Eviction is LRU over unlocked leaves (dropping their tokens and the
  snapshots on them) and snapshots (alone).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from .common import H200_CHUNK, V4Costs
from .traces import Request


@dataclass(eq=False)
class _Node:
    key: list[int]
    start: int                                   # absolute position of key[0]
    parent: "_Node | None"
    children: dict[int, "_Node"] = field(default_factory=dict)
    snaps: dict[int, "_Snap"] = field(default_factory=dict)  # position P -> snapshot (start < P <= end)
    lock: int = 0
    access: int = 0

    @property
    def end(self) -> int:
        return self.start + len(self.key)


@dataclass(eq=False)
class _Snap:
    node: _Node
    pos: int
    access: int = 0


class OursSim:
    """Our policy at a total byte budget; ``serve`` requests one at a time."""

    name = "ours"

    def __init__(self, budget_bytes: float, costs: V4Costs | None = None, chunk: int = H200_CHUNK,
                 fan_out_snapshot: bool = True):
        self.budget = budget_bytes
        self.fan_out_snapshot = fan_out_snapshot
        self.costs = costs or V4Costs.flash()
        self.chunk = chunk
        self.root = _Node([], 0, None)
        self.root.lock = 1
        self.tokens = 0          # tokens held by the tree
        self.num_snaps = 0
        self.running = 0.0       # bytes of the request being served (ring + its uncached tokens)
        self._tick = itertools.count(1)

    # ---- accounting ------------------------------------------------------------------
    def used(self) -> float:
        return self.tokens * self.costs.ours_token + self.num_snaps * self.costs.ours_snapshot + self.running

    def _evict(self) -> None:
        """LRU-evict unlocked leaves and snapshots until the budget holds (or nothing is left)."""
        if self.used() <= self.budget:
            return
        heap: list[tuple[int, int, object]] = []
        seq = itertools.count()
        stack = [self.root]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            for s in n.snaps.values():
                heap.append((s.access, next(seq), s))
            if not n.children and n.lock == 0:
                heap.append((n.access, next(seq), n))
        heapq.heapify(heap)
        while heap and self.used() > self.budget:
            _, _, item = heapq.heappop(heap)
            if isinstance(item, _Snap):
                if item.node.snaps.get(item.pos) is item:
                    del item.node.snaps[item.pos]
                    self.num_snaps -= 1
                continue
            node = item
            if node.children or node.lock or node.parent is None or node.parent.children.get(node.key[0]) is not node:
                continue
            del node.parent.children[node.key[0]]
            self.tokens -= len(node.key)
            self.num_snaps -= len(node.snaps)
            node.snaps.clear()
            parent = node.parent
            if parent is not self.root and not parent.children and parent.lock == 0:
                heapq.heappush(heap, (parent.access, next(seq), parent))

    # ---- tree ------------------------------------------------------------------------
    def _split(self, node: _Node, k: int) -> _Node:
        """Split ``node`` after its first ``k`` tokens; return the new upper node."""
        upper = _Node(node.key[:k], node.start, node.parent, lock=node.lock, access=node.access)
        upper.children[node.key[k]] = node
        node.parent.children[node.key[0]] = upper
        node.key, node.start, node.parent = node.key[k:], node.start + k, upper
        for p in [p for p in node.snaps if p <= upper.end]:
            s = node.snaps.pop(p)
            s.node = upper
            upper.snaps[p] = s
        return upper

    def _walk(self, ids: tuple[int, ...], split: bool) -> tuple[list[_Node], int]:
        """Nodes along the longest cached prefix of ``ids`` and its length. With ``split`` the
        last node is split so the path ends exactly at the match."""
        path, node, pos = [], self.root, 0
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                break
            k, key = 0, child.key
            lim = min(len(key), len(ids) - pos)
            while k < lim and key[k] == ids[pos + k]:
                k += 1
            if k < len(key):
                if split:
                    child = self._split(child, k)
                path.append(child)
                pos += k
                break
            path.append(child)
            node, pos = child, pos + k
        return path, pos

    def _insert(self, ids: tuple[int, ...]) -> list[_Node]:
        """Cache ``ids``; return its path."""
        path, n = self._walk(ids, split=True)
        if n < len(ids):
            parent = path[-1] if path else self.root
            leaf = _Node(list(ids[n:]), n, parent)
            parent.children[ids[n]] = leaf
            self.tokens += len(ids) - n
            path.append(leaf)
        self._touch(path)
        return path

    def _touch(self, path: list[_Node]) -> None:
        t = next(self._tick)
        for node in path:
            node.access = t

    def _lock(self, path: list[_Node], delta: int) -> None:
        """Lock (+1) or unlock (-1) the path from its last node up to the root; walked through the
        parent links, so nodes split into the path since it was taken are covered too."""
        node = path[-1] if path else None
        while node is not None and node is not self.root:
            node.lock += delta
            node = node.parent

    def locked_nodes(self) -> int:
        """Nodes with a lock held (0 between requests)."""
        count, stack = 0, list(self.root.children.values())
        while stack:
            n = stack.pop()
            count += n.lock != 0
            stack.extend(n.children.values())
        return count

    def _deepest_snapshot(self, path: list[_Node], limit: int) -> _Snap | None:
        for node in reversed(path):
            best = max((p for p in node.snaps if p <= limit), default=None)
            if best is not None:
                return node.snaps[best]
        return None

    def _snapshot(self, path: list[_Node], pos: int) -> None:
        """Snapshot at ``pos`` on the cached ``path`` (which reaches at least ``pos``)."""
        node = next(n for n in path if n.start < pos <= n.end)
        snap = node.snaps.get(pos)
        if snap is None:
            snap = node.snaps[pos] = _Snap(node, pos)
            self.num_snaps += 1
        snap.access = next(self._tick)

    # ---- the policy ------------------------------------------------------------------
    def match(self, prompt: tuple[int, ...]) -> tuple[int, int]:
        """(resume point, full match length) of ``prompt`` (no side effects)."""
        path, full = self._walk(prompt[: max(len(prompt) - 1, 0)], split=False)
        snap = self._deepest_snapshot(path, full)
        return (snap.pos if snap else 0), full

    def serve(self, req: Request) -> int:
        L, o = len(req.prompt), len(req.output)
        kv_len = L + o - 1 if o else L
        path, full = self._walk(req.prompt[: max(L - 1, 0)], split=True)
        self._touch(path)
        snap = self._deepest_snapshot(path, full)
        resume = snap.pos if snap else 0
        if snap:
            snap.access = next(self._tick)
        self._lock(path, 1)
        self.running = self.costs.ours_snapshot + (kv_len - resume) * self.costs.ours_token
        self._evict()
        held = path
        forks = {full} | ({L - 1} if self.fan_out_snapshot and o == 0 and L > 1 else set())
        ends = sorted(set(range(resume + self.chunk, L, self.chunk)) | {L} | {p for p in forks if p > resume})
        for end in ends:                       # prefill checkpoints (and the divergence snapshot)
            new = self._insert(req.prompt[:end])
            self._lock(new, 1)
            self._lock(held, -1)
            held = new
            self.running = self.costs.ours_snapshot + (kv_len - end) * self.costs.ours_token
            self._snapshot(held, end)
            self._evict()
        if kv_len > L:                          # finish: publish prompt + output - 1
            new = self._insert(req.history[:kv_len])
            self._lock(new, 1)
            self._lock(held, -1)
            held = new
            self._snapshot(held, kv_len)
        self._lock(held, -1)
        self.running = 0.0
        self._evict()
        return resume

    def resumable(self, history: tuple[int, ...]) -> int:
        return self.match(history + (-1,))[0]

    def resume_points(self) -> int:
        return self.num_snaps
