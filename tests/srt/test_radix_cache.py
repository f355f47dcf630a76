"""``SnapshotRadixCache``'s snapshot placement on SGLang's radix tree (host objects only): a match
finds the deepest live snapshot on its path by walking nodes, and node splits carry them."""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from sglang_dsv4.srt.radix_cache import SnapshotRadixCache
from sglang_dsv4.srt.state import SlotSnapshot


def _tree() -> SnapshotRadixCache:
    return SnapshotRadixCache(CacheInitParams(disable=False, req_to_token_pool=None,
                                              token_to_kv_pool_allocator=None, page_size=1))


def _insert(tree: SnapshotRadixCache, ids: list[int]):
    tree.insert(InsertParams(key=RadixKey(ids), value=torch.arange(len(ids), dtype=torch.int64) + 100))
    return _match(tree, ids)


def _match(tree: SnapshotRadixCache, ids: list[int]):
    """(last node, matched length) of ``ids`` (the plain match: no request)."""
    result = tree.match_prefix(MatchPrefixParams(key=RadixKey(ids)))
    return result.last_device_node, result.device_prefix_len


def _snap(n: int) -> SlotSnapshot:
    return SlotSnapshot(n, {"ring": torch.zeros(1)})


def test_a_match_finds_the_deepest_live_snapshot_on_its_path_across_node_splits():
    tree = _tree()
    a = list(range(1, 11))
    node, end = _insert(tree, a)
    s4, s10 = _snap(4), _snap(10)
    tree._place_snapshots(node, [s4, s10])
    assert tree._deepest_snapshot(node, end) == (10, s10)
    # another prompt shares 6 tokens: the node splits at 6, s4 goes to the new parent
    b = a[:6] + [99, 98]
    node_b, end_b = _insert(tree, b)
    assert tree._deepest_snapshot(node_b, end_b) == (4, s4)
    node_a, end_a = _match(tree, a)
    assert tree._deepest_snapshot(node_a, end_a) == (10, s10)
    # a match that ends inside a node splits it again: s10 stays on the part holding position 9
    node_9, end_9 = _match(tree, a[:9])
    assert end_9 == 9 and tree._deepest_snapshot(node_9, end_9) == (4, s4)
    node_a, end_a = _match(tree, a)
    assert tree._deepest_snapshot(node_a, end_a) == (10, s10)
    # a released snapshot (its slot freed, or evicted) is skipped and pruned
    s10.release()
    assert tree._deepest_snapshot(node_a, end_a) == (4, s4)
    assert not any(getattr(n, "dsv4_snaps", None) and 3 in n.dsv4_snaps and n.dsv4_snaps[3] is s10
                   for n in (node_a, node_a.parent))


def test_a_live_snapshot_keeps_its_place_and_snapshots_past_the_path_are_not_placed():
    tree = _tree()
    ids = list(range(1, 21))
    node, end = _insert(tree, ids)
    first, second, past = _snap(12), _snap(12), _snap(25)
    tree._place_snapshots(node, [first])
    tree._place_snapshots(node, [second, past])
    assert tree._deepest_snapshot(node, end) == (12, first)
    assert node.dsv4_snaps == {11: first}
    first.release()
    tree._place_snapshots(node, [second])  # the place is free again
    assert tree._deepest_snapshot(node, end) == (12, second)
