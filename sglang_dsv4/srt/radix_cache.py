"""SGLang's token-granular RadixCache, with matches limited to where V4 can resume exactly.

The tree itself is upstream's (page size 1): it owns token slots, and through them the
compressed entries (``state.SglangV4Cache``). What it cannot share is the window ring and the
compressor's partial group, so a cached prefix is usable only up to a position P whose token
slot P-1 owns a snapshot. This class
  - cuts each request's match back to the deepest such P (``cached_tokens`` then reports exactly
    what is not recomputed), and asks for a snapshot where the request's tokens leave the cached
    path (the divergence point D > P), so the next request diverging there hits it, and at
    prompt_len - 1 of a fan-out prefix request (n>1 and frontend forks send the shared prompt
    with max_new_tokens=0 first; the copies can match at most prompt_len - 1 tokens) and of a
    prompt ending in ``<think>`` (V4 drops reasoning from history: the next turn continues
    before it);
  - takes a snapshot when a request's tokens are published (``checkpoint``: chunk ends and the
    finish), and moves snapshots from slots the tree deduplicates to the tree's own slots.

Each snapshot is also placed on the tree, on the node holding its position - 1 (``SNAPS_ATTR``:
{offset in the node: snapshot}, carried along when a node splits), when the tree takes the
request's tokens up to there. A match then finds its deepest snapshot by walking host objects
up from its last node, with no read of slot values from the device (under the overlap scheduler
such a read waits for the forward in flight). The slots still own the snapshots: a snapshot
goes with its slot's free, or by LRU, and is then ``released``, which the walk skips.
"""

from __future__ import annotations

import logging

from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams, MatchResult
from sglang.srt.mem_cache.radix_cache import RadixCache

from ..tokenizer_files import THINK_START_ID
from .state import serving_cache

logger = logging.getLogger(__name__)

FORK_ATTR = "dsv4_fork_at"
# (P, the snapshot) a request resumes from, as its match found it
RESUME_ATTR = "dsv4_resume_from"
# on a tree node: {offset of position P - 1 in the node: the snapshot at P}
SNAPS_ATTR = "dsv4_snaps"


def _is_fan_out_prefix(req) -> bool:
    params = getattr(req, "sampling_params", None)
    return getattr(params, "max_new_tokens", None) == 0 and len(req.origin_input_ids) > 1


def _opens_thinking(req) -> bool:
    ids = req.origin_input_ids
    return len(ids) > 1 and ids[-1] == THINK_START_ID


class SnapshotRadixCache(RadixCache):
    """RadixCache whose matches end only at V4 snapshot positions."""

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        result = super().match_prefix(params)
        cache, req = serving_cache(), params.req
        if req is None or cache is None:
            return result  # internal re-matches (checkpoint) keep the full path
        forks: set[int] = set()
        if _is_fan_out_prefix(req):
            # n>1 sampling and frontend forks first prefill the shared prompt with
            # max_new_tokens=0; the copies match at most prompt_len - 1 tokens: snapshot there
            forks.add(len(req.origin_input_ids) - 1)
        if _opens_thinking(req):
            # the next chat turn drops this turn's reasoning: its prompt continues the history
            # right before this <think> (with </think>answer), so it resumes there
            forks.add(len(req.origin_input_ids) - 1)
        full_len = result.device_prefix_len
        setattr(req, RESUME_ATTR, (0, None))  # this match's, not an earlier one's (a retracted request)
        if full_len:
            resume, snap = self._deepest_snapshot(result.last_device_node, full_len)
            if snap is not None:
                cache.matched(snap)
            setattr(req, RESUME_ATTR, (resume, snap))
            if resume < full_len:
                # the request passes D = full_len on its own: snapshot it there for the next one
                forks.add(full_len)
                result = (super().match_prefix(MatchPrefixParams(key=params.key[:resume], req=req))
                          if resume else self._empty_match_result)
        setattr(req, FORK_ATTR, sorted(p for p in forks if p > result.device_prefix_len))
        return result

    def _deepest_snapshot(self, node, end: int):
        """(P, snapshot) of the deepest live snapshot on the path from the root to ``node``,
        which ends at position ``end``; (0, None) if none. Host objects only."""
        while node is not self.root_node:
            start = end - len(node.key)
            snaps = getattr(node, SNAPS_ATTR, None)
            if snaps:
                for offset in sorted(snaps, reverse=True):
                    snap = snaps[offset]
                    if snap.released:
                        del snaps[offset]
                    elif snap.num_tokens == start + offset + 1:
                        return start + offset + 1, snap
            node, end = node.parent, start
        return 0, None

    def _place_snapshots(self, node, snaps) -> None:
        """Put ``snaps`` (positions on the path to ``node``, which ends where the request's
        published tokens end) on the nodes holding their position - 1, where none is live."""
        if not snaps:
            return
        end, n = 0, node
        while n is not self.root_node:
            end += len(n.key)
            n = n.parent
        for snap in sorted(snaps, key=lambda s: -s.num_tokens):
            pos = snap.num_tokens - 1
            if pos >= end:
                continue  # past what the tree took (a window-limited key): not placed
            while node is not self.root_node and end - len(node.key) > pos:
                end -= len(node.key)
                node = node.parent
            if node is self.root_node:
                return
            table = getattr(node, SNAPS_ATTR, None)
            if table is None:
                table = {}
                setattr(node, SNAPS_ATTR, table)
            offset = pos - (end - len(node.key))
            held = table.get(offset)
            if held is None or held.released:
                table[offset] = snap

    def _split_node(self, key, child, split_len: int):
        """Upstream's split; the child's snapshots before ``split_len`` go to the new parent."""
        new_node = super()._split_node(key, child, split_len)
        snaps = getattr(child, SNAPS_ATTR, None)
        if snaps:
            setattr(new_node, SNAPS_ATTR, {o: s for o, s in snaps.items() if o < split_len})
            setattr(child, SNAPS_ATTR, {o - split_len: s for o, s in snaps.items() if o >= split_len})
        return new_node

    def evict(self, params):
        """Upstream's LRU eviction of token slots (their entries and snapshots go with the slots'
        frees), counted as ``tree_tokens_evicted``."""
        result = super().evict(params)
        cache = serving_cache()
        if cache is not None:
            cache.stats["tree_tokens_evicted"] += int(getattr(result, "num_tokens_evicted", 0) or 0)
        return result

    def reset(self):
        """Flushing the tree (``/flush_cache``) releases every token slot at once, without a
        per-slot free: release what the slots owned too."""
        super().reset()
        cache = serving_cache()
        if cache is not None:
            cache.clear_token_state()

    def checkpoint(self, req, *, up_to: int):
        cache = serving_cache()
        if self.disable or cache is None:
            return super().checkpoint(req, up_to=up_to)
        row = req.kv.req_pool_idx
        state = cache.rows.get(row)
        at_end = state.state if state is not None and state.state.num_tokens == up_to else None
        own = self.req_to_token_pool.req_to_token[row, :up_to].clone()
        with cache.deferred_frees():
            super().checkpoint(req, up_to=up_to)
            tree = self.req_to_token_pool.req_to_token[row, :up_to]
            cache.publish(at_end, own, tree)  # a snapshot at up_to; the request's move to the tree's slots
        self._place_snapshots(req.last_node, cache.take_row_snapshots(row, up_to))
        if state is not None:  # the row now reads the tree's slots: list their entries
            cache.refresh_entries(row, up_to)
