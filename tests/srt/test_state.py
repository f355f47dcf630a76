"""``SglangV4Cache`` driven as SGLang drives it (request rows, token slots, frees), without a server:
resuming from a snapshot on shared token slots continues exactly, in each storage format."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sglang_dsv4.core.model import V4Model
from sglang_dsv4.core.oracle import OracleModel
from sglang_dsv4.core.step import entry_width
from sglang_dsv4.srt.state import MAX_PENDING_ORPHANS, RATIOS, SglangV4Cache, _InFlight

ROWS, SLOTS, MAX_LEN = 4, 4096, 1024


class Slots:
    """A stand-in for SGLang's token-slot allocator: hands out fresh slot numbers."""

    def __init__(self) -> None:
        self.next = 1  # SGLang keeps slot 0 as padding

    def take(self, n: int) -> torch.Tensor:
        out = torch.arange(self.next, self.next + n, dtype=torch.int32)
        self.next += n
        return out


def _cache(cfg, backend: str) -> SglangV4Cache:
    return SglangV4Cache.with_own_table(cfg, ROWS, SLOTS, max_seq_len=MAX_LEN, backend=backend)


def _run(model, cache, row, gen, prefix_len, ids, chunks):
    state = cache.bind(row, gen, prefix_len)
    out, pos = [], 0
    for c in chunks:
        out.append(model.forward(cache, [state], [ids[pos:pos + c]])[0])
        pos += c
    return state, torch.cat(out)


@pytest.mark.parametrize("backend", ["torch", "torch-fp8"])
def test_resume_from_snapshot_on_shared_slots_matches_a_cold_run(micro, backend):
    cfg, w = micro
    model = V4Model(cfg, w)
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(0, cfg.vocab_size, (261,), generator=g)  # two C128 groups + a partial one
    tails = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in (40, 7)]

    cache, slots = _cache(cfg, backend), Slots()
    # request A (row 0): the shared prefix, a snapshot there (a fork point), then its own tail
    cache.req_to_token[0, :301] = slots.take(301)
    a, _ = _run(model, cache, 0, 1, 0, torch.cat((shared, tails[0])), [261])
    cache.take_snapshot(a)
    model.forward(cache, [a], [tails[0][:20]])
    # request B (row 1) matched A's prefix: the radix tree gives it A's slots for it
    cache.req_to_token[1, :261] = cache.req_to_token[0, :261]
    cache.req_to_token[1, 261:268] = slots.take(7)
    _, resumed = _run(model, cache, 1, 1, 261, tails[1], [3, 1, 1, 1, 1])
    assert cache.stats["snapshots_restored"] == 1 and cache.stats["prompt_tokens_cached"] == 261

    # the same tokens cold, in a fresh cache, same chunking after the prefix
    cold_cache, cold_slots = _cache(cfg, backend), Slots()
    cold_cache.req_to_token[0, :268] = cold_slots.take(268)
    _, cold = _run(model, cold_cache, 0, 1, 0, torch.cat((shared, tails[1])), [261, 3, 1, 1, 1, 1])
    assert torch.equal(resumed, cold[261:])
    if backend == "torch":  # float32 rows: the oracle's numbers up to fp8-QAT rounding-bin flips
        ref = OracleModel(cfg, w).forward(torch.cat((shared, tails[1])))[261:]
        assert ((resumed - ref).norm(dim=-1) / ref.norm(dim=-1)).max() < 2e-3

    # SGLang frees A's and B's slots and rows: nothing stays behind
    used = cache.usage()
    assert used["snapshots"] == 1 and used["rings_in_use"] == 2 and used["c4_entries"] > 0
    cache.free_token_slots(cache.req_to_token[0, :281].clone())
    cache.free_token_slots(cache.req_to_token[1, 261:268].clone())
    cache.release_rows([0, 1])
    assert cache.usage() == {"c4_entries": 0, "c128_entries": 0, "compressed_bytes": 0,
                             "rings_in_use": 0, "snapshots": 0, "snapshot_bytes": 0}


def test_fp8_storage_is_flashmla_sized(micro):
    """With the fp8 layout a ring and a snapshot are FlashMLA's 584-byte rows, not float rows."""
    cfg, _ = micro
    f32, fp8 = _cache(cfg, "torch"), _cache(cfg, "torch-fp8")
    assert fp8.slot_state["ring"].dtype == torch.uint8
    assert fp8.snapshot_bytes_each < f32.snapshot_bytes_each
    assert fp8.pools[4].row_bytes < f32.pools[4].row_bytes


def test_plan_tables_takes_each_requests_completed_groups(micro):
    """The host plan of a step (whole-tensor ops over its positions) equals each request's own
    arithmetic: e // r - s // r entry rows per request, handed out in token order to exactly the
    tokens that complete a group, and tables as wide as the longest request needs."""
    cfg, _ = micro
    cache = _cache(cfg, "torch")
    cache.device = torch.device("cuda")  # only entry_width reads it: the GPU's width buckets
    starts, lens = [0, 3, 126, 127, 250, 5], [4, 1, 3, 130, 6, 1]
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
    free = {r: p.num_free for r, p in cache.pools.items()}
    plan = cache.plan_tables([None] * len(starts), starts, lens, positions)
    for r, pool in cache.pools.items():
        want = sum((s + n) // r - s // r for s, n in zip(starts, lens))
        assert free[r] - pool.num_free == want
        w = plan.write[r]
        done = (positions + 1) % r == 0
        assert int(done.sum()) == want and (w[~done] == pool.scratch_row).all()
        assert len(set(w[done].tolist())) == want and pool.in_use(w[done]).all()
        need = max(s + n for s, n in zip(starts, lens)) // r
        assert plan.widths[r] >= need and plan.widths[r] == entry_width(need, MAX_LEN // r, torch.device("cuda"))


def _filing_case(device: str = "cpu"):
    """A step of 6 tokens over 3 request rows (the last the padding row, at the scratch slot)."""
    g = torch.Generator().manual_seed(3)
    pos = torch.tensor([3, 7, 8, 127, 0, 11])
    tok_slot = torch.randint(0, 50, (6,), generator=g, dtype=torch.int32)
    tok_req_slot = torch.tensor([0, 0, 1, 1, 2, 2])
    slots = torch.tensor([0, 1, 2])
    write = torch.randint(0, 90, (6,), generator=g)
    entry_of_slot = torch.randint(-1, 40, (51,), generator=g, dtype=torch.int32)
    req_entries = torch.randint(-1, 40, (4, 40), generator=g, dtype=torch.int32)
    return [t.to(device) for t in (pos, tok_slot, tok_req_slot, slots, write, entry_of_slot, req_entries)]


@pytest.mark.parametrize("ratio", [4, 128])
def test_file_entries_traced_updates_the_tables_as_eager(ratio):
    """The fused region (traced through AOTAutograd's functionalisation, as Inductor takes it on
    the GPU) writes the same tables in place and returns the same rows and old entries."""
    from sglang_dsv4.srt.state import file_entries

    torch._dynamo.reset()
    traced = torch.compile(file_entries.eager, backend="aot_eager", fullgraph=True)
    for want_old in (False, True):
        a, b = _filing_case(), _filing_case()
        got = traced(*a[:5], a[5], a[6], ratio, 32, want_old)
        want = file_entries.eager(*b[:5], b[5], b[6], ratio, 32, want_old)
        assert torch.equal(a[5], b[5]) and torch.equal(a[6], b[6])  # the tables, in place
        assert torch.equal(got[0], want[0])
        assert (got[1] is None) == (want[1] is None) and (want[1] is None or torch.equal(got[1], want[1]))
    # the completing tokens' entries are filed (ratio 4: positions 3, 7, 11; 128: 127)
    done = (a[0] + 1) % ratio == 0
    assert torch.equal(a[5][a[1][done].long()], a[4][done].int())
    assert torch.equal(a[6][a[2][done], (a[0][done] + 1) // ratio - 1], a[4][done].int())


def test_pending_orphans_stay_bounded_and_keep_their_rows_without_a_free(micro):
    """Every extend hands ``retire`` a replaced-rows tensor per ratio (mostly -1); extends with no
    free in between start a free of them every MAX_PENDING_ORPHANS tensors (bounded, no read of
    a device value), and the rows they hold go back to the pools when it is collected."""
    cfg, w = micro
    model = V4Model(cfg, w)
    cache = _cache(cfg, "torch")
    prompt = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(3))
    slots = Slots()
    cache.req_to_token[0, :40] = slots.take(40)
    first = cache.bind(0, 1, 0)
    model.forward(cache, [first], [prompt])
    cache.release_rows([0])
    cache.req_to_token[1, :20] = cache.req_to_token[0, :20]  # the same slots, owning entries
    cache.req_to_token[1, 20:] = slots.take(MAX_LEN - 20)
    again = cache.bind(1, 1, 0)
    model.forward(cache, [again], [prompt[:20]])  # replaces the rows of 5 ratio-4 groups
    pending = {r: p.num_used for r, p in cache.pools.items()}
    reads = cache.stats["host_reads"]
    for t in range(MAX_PENDING_ORPHANS):  # 2-token extends on fresh slots, no free
        model.forward(cache, [again], [prompt[t % 20:t % 20 + 2]])
        assert len(cache._orphans) <= MAX_PENDING_ORPHANS + len(RATIOS)
        cache.check_integrity()  # the 5 replaced rows: in use and pending, not leaked
    assert cache.stats["host_reads"] == reads  # the orphans' own free copied without a sync
    # one row per 4 new positions; the 5 replaced rows came back when a later step collected
    # the orphans' free (a host copy is done at once)
    assert cache.pools[4].num_used == pending[4] + 2 * MAX_PENDING_ORPHANS // 4 - 5
    cache.check_integrity()
    cache.release_rows([1])
    cache.free_token_slots(cache.req_to_token[1, :20].long())
    cache.collect_pending()
    cache.check_integrity()
    # the 20 freed slots owned 5 ratio-4 rows; the 5 they had replaced went with the orphans' free
    assert cache.pools[4].num_used == pending[4] + 2 * MAX_PENDING_ORPHANS // 4 - 10


class _HostReads(TorchDispatchMode):
    """Counts the reads of a tensor's value into Python (``int()``, ``bool()``, ``.item()``):
    each a host sync when the tensor is on a GPU."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _shared_prefix(cfg, model, cache):
    """Request A (row 0) prefills 261 tokens and snapshots there; request B (row 1) matched them
    (A's slots) and brings 7 of its own. -> B's new tokens, and (P, key) of B's match."""
    g = torch.Generator().manual_seed(9)
    shared, tail = torch.randint(0, cfg.vocab_size, (261,), generator=g), torch.randint(0, cfg.vocab_size, (7,), generator=g)
    slots = Slots()
    cache.req_to_token[0, :261] = slots.take(261)
    a = cache.bind(0, 1, 0)
    model.forward(cache, [a], [shared])
    cache.take_snapshot(a)
    cache.req_to_token[1, :261] = cache.req_to_token[0, :261]
    cache.req_to_token[1, 261:268] = slots.take(7)
    return tail, cache.deepest_snapshot(cache.req_to_token[1, :268])


def test_a_resume_its_match_announced_reads_nothing_back(micro):
    """The radix match found the snapshot's slot on the host (``deepest_snapshot``) and the plugin
    passes it on (``expect_resume``): the bind restores from it without reading a value from the
    device (on a GPU, no sync on the request's path), and the request computes what a bind that
    reads the key from the table computes."""
    cfg, w = micro
    model = V4Model(cfg, w)
    outs = []
    for announced in (True, False):
        cache = _cache(cfg, "torch")
        tail, (resume, key) = _shared_prefix(cfg, model, cache)
        assert resume == 261 and key == int(cache.req_to_token[0, 260])
        if announced:
            cache.expect_resume(1, 1, resume, cache.snapshots[key])
        with _HostReads() as reads:
            b = cache.bind(1, 1, resume)
        assert reads.count == (0 if announced else 1)
        assert cache.stats["resume_keys_read_back"] == (0 if announced else 1)
        outs.append(model.forward(cache, [b], [tail])[0])
        cache.check_integrity()
    assert torch.equal(outs[0], outs[1])


def test_a_stale_resume_announcement_is_not_used(micro):
    """An announcement for another generation of the row, or one the row's release dropped, is
    not taken: the bind reads the key from the table."""
    cfg, w = micro
    model = V4Model(cfg, w)
    cache = _cache(cfg, "torch")
    _, (resume, key) = _shared_prefix(cfg, model, cache)
    cache.expect_resume(1, 7, resume, cache.snapshots[key])  # for an earlier request of row 1 (generation 7)
    cache.bind(1, 8, resume)
    assert cache.stats["resume_keys_read_back"] == 1
    cache.release_rows([1])
    cache.expect_resume(1, 9, resume, cache.snapshots[key])
    cache.release_rows([1])  # aborted before its forward
    cache.bind(1, 9, resume)
    assert cache.stats["resume_keys_read_back"] == 2


def test_a_resume_missing_an_entry_fails_the_integrity_check(micro):
    """A resume lists its entries without a host sync; an entry its prefix should own but does
    not (a radix cache matching past it: a bug) is counted on the device and the next
    integrity check fails on it."""
    cfg, w = micro
    model = V4Model(cfg, w)
    cache = _cache(cfg, "torch")
    _, (resume, key) = _shared_prefix(cfg, model, cache)
    cache.release_rows([0])  # request A finished (its row listed the entries)
    cache.check_integrity()
    slot = int(cache.req_to_token[1, 127])  # completes ratio-4 group 31 and ratio-128 group 0
    rows = {r: int(cache.entry_of_slot[r][slot]) for r in RATIOS}
    for r in RATIOS:  # the slot loses its entries behind the cache's back (rows back to the pool)
        cache.entry_of_slot[r][slot] = -1
        cache.pools[r].free(torch.tensor([rows[r]]))
    cache.expect_resume(1, 1, resume, cache.snapshots[key])
    cache.bind(1, 1, resume)
    with pytest.raises(AssertionError, match="2 compressed entries missing"):
        cache.check_integrity()


def test_a_published_snapshot_is_copied_when_the_next_forward_starts(micro):
    """A hook's snapshot (``publish``: SGLang's checkpoint at a chunk's end or a finish) is copied
    at the next forward's start, on the model's stream, not in the hook (under the overlap
    scheduler the forward in flight may still be writing the row). Pending, it counts its bytes;
    copied before the next request on the row resets it, it holds the state at its position, and
    a request resuming from it continues as from a snapshot copied at once (``take_snapshot``)."""
    cfg, w = micro
    model = V4Model(cfg, w)
    g = torch.Generator().manual_seed(13)
    shared, tail, other = (torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in (261, 7, 5))
    outs = []
    for published in (True, False):
        cache, slots = _cache(cfg, "torch"), Slots()
        own = slots.take(261)
        cache.req_to_token[0, :261] = own
        a = cache.bind(0, 1, 0)
        model.forward(cache, [a], [shared])
        if published:
            cache.publish(a, own, own)  # the tree took the request's own slots
            cache.collect_pending()  # keyed once the slots' copy is done (on the CPU: now)
            snap = cache.snapshots[int(own[-1])]
            assert snap.slot_state is None and snap.pending_row == 0
            cache.check_integrity()  # the bytes gauge counts the pending copy
        else:
            cache.take_snapshot(a)
            cache.collect_pending()  # keyed once its slot's copy is done (on the CPU: now)
            snap = cache.snapshots[int(own[-1])]
        cache.release_rows([0])
        cache.req_to_token[0, :5] = slots.take(5)  # a new request takes row 0 and is reset there
        c = cache.bind(0, 2, 0)
        assert snap.slot_state is not None and snap.pending_row is None
        model.forward(cache, [c], [other])
        cache.req_to_token[1, :261] = own  # request B matched the published prefix
        cache.req_to_token[1, 261:268] = slots.take(7)
        b = cache.bind(1, 1, 261)
        outs.append(model.forward(cache, [b], [tail])[0])
        cache.check_integrity()
        assert cache.end_forward() is None  # no event to publish on the CPU
    assert torch.equal(outs[0], outs[1])


@pytest.fixture
def copies_in_flight(monkeypatch):
    """Every free's and publish's copy to the host reads as still running (as on a GPU under the overlap
    scheduler, its stream behind the forward in flight) until something waits for it."""
    monkeypatch.setattr(_InFlight, "ready", lambda self: False)


def test_a_free_reads_nothing_back_and_its_rows_return_at_the_next_step(micro, copies_in_flight):
    """``free_token_slots`` clears the slots' entries on the device and reads nothing back: the
    rows it freed stay in use (on their way back, accounted by the integrity check) until a
    collect, and the next step's allocation takes them back before the pool would grow."""
    cfg, w = micro
    model = V4Model(cfg, w)
    cache = _cache(cfg, "torch")
    _shared_prefix(cfg, model, cache)
    cache.release_rows([0])
    used = {r: p.num_used for r, p in cache.pools.items()}
    capacity = {r: p.capacity for r, p in cache.pools.items()}
    reads = []
    real = cache._to_host
    cache._to_host = lambda t: reads.append(t.numel()) or real(t)
    freed = cache.req_to_token[0, :261].clone()
    cache.free_token_slots(freed)
    assert reads == [] and len(cache._pending) == 1
    assert {r: p.num_used for r, p in cache.pools.items()} == used  # not back yet
    assert int(cache.entry_of_slot[4][freed.long()].max()) == -1  # the device tables know at once
    cache.check_integrity(live_slots=torch.empty(0, dtype=torch.long))  # rows pending, snapshot going
    assert cache.usage()["c4_entries"] == used[4]
    # a pool short of rows waits for the copy instead of growing
    for r, pool in cache.pools.items():
        pool.alloc(pool.num_free)
    cache.req_to_token[2, :8] = Slots().take(8) + 3000  # slots no request used
    c = cache.bind(2, 1, 0)
    waits = cache.stats["copy_waits"]
    model.forward(cache, [c], [torch.arange(8)])
    assert cache.stats["copy_waits"] == waits + 1 and not cache._pending
    assert {r: p.capacity for r, p in cache.pools.items()} == capacity
    assert cache.stats["snapshots_dropped"] == 1 and not cache.snapshots


def test_a_reused_slot_never_resumes_from_the_snapshot_of_its_freed_owner(micro, copies_in_flight):
    """A snapshot sits on the slot of its position - 1 and goes with the slot's free, collected
    later. Until then the slot may be handed out again: a match of a path through it at the same
    position finds no snapshot, and a snapshot its new owner takes there survives the collect."""
    cfg, w = micro
    model = V4Model(cfg, w)
    g = torch.Generator().manual_seed(4)
    for case in ("match", "snapshot"):
        cache = _cache(cfg, "torch")
        _shared_prefix(cfg, model, cache)
        key = int(cache.req_to_token[0, 260])
        assert cache.snapshots[key].num_tokens == 261
        cache.release_rows([0, 1])
        cache.free_token_slots(cache.req_to_token[0, :261].clone())  # copy in flight
        assert key in cache.snapshots
        if case == "match":  # SGLang hands the slots to another prompt of the same length
            cache.req_to_token[2, :261] = cache.req_to_token[0, :261]
            assert cache.deepest_snapshot(cache.req_to_token[2, :261]) == (0, -1)
            assert key not in cache.snapshots and not cache._pending
        else:  # ... to a longer prompt, whose snapshot lands on the old one's slot
            cache.req_to_token[2, :39] = Slots().take(39) + 3000
            cache.req_to_token[2, 39:300] = cache.req_to_token[0, :261]
            c = cache.bind(2, 1, 0)
            model.forward(cache, [c], [torch.randint(0, cfg.vocab_size, (300,), generator=g)])
            assert cache._pending  # the step had rows enough: nothing waited
            cache.take_snapshot(c)
            cache.collect_pending(wait=True)
            assert cache.snapshots[key].num_tokens == 300 and cache.stats["snapshots_dropped"] == 1
            assert cache.deepest_snapshot(cache.req_to_token[2, :300]) == (300, key)
        cache.check_integrity()


def test_a_publish_reads_nothing_back_and_takes_effect_before_the_frees_after_it(micro, copies_in_flight):
    """SGLang's checkpoint publishes a request's tokens (``publish``), then frees the slots the
    tree already held (the dedup). The publish reads nothing back: its snapshot is keyed and the
    request's snapshots move to the tree's slots when its copy is collected, ahead of the free, so
    the free does not drop them; its state is copied at the next forward's start all the same."""
    cfg, w = micro
    model = V4Model(cfg, w)
    g = torch.Generator().manual_seed(21)
    shared, tail = torch.randint(0, cfg.vocab_size, (261,), generator=g), torch.randint(0, cfg.vocab_size, (7,), generator=g)
    cache, slots = _cache(cfg, "torch"), Slots()
    tree = slots.take(261)  # another request's slots for the same 261 tokens, held by the tree
    own = slots.take(268)
    cache.req_to_token[0, :268] = own
    a = cache.bind(0, 1, 0)
    model.forward(cache, [a], [shared])
    cache.take_snapshot(a)  # a fork point, on the request's own slot of position 260
    cache.collect_pending(wait=True)  # keyed
    model.forward(cache, [a], [tail])
    published = torch.cat((tree, own[261:]))
    reads = []
    real = cache._to_host
    cache._to_host = lambda t: reads.append(t.numel()) or real(t)
    with cache.deferred_frees():
        cache.publish(a, own.clone(), published)
        cache.free_token_slots(own[:261].long())  # the duplicates
    assert reads == [] and len(cache._pending) == 2 and list(cache.snapshots) == [int(own[260])]
    cache.release_rows([0])
    cache.req_to_token[0, :3] = slots.take(3)
    cache.bind(0, 2, 0)  # a new request resets row 0: the published state was copied first
    snap = next(p.snap for p in cache._pending if getattr(p, "snap", None) is not None)
    assert snap.slot_state is not None
    cache._to_host = real
    assert cache.deepest_snapshot(published) == (268, int(own[267]))
    assert cache.snapshots[int(own[267])] is snap and cache.snapshots[int(tree[260])].num_tokens == 261
    assert cache.stats["snapshots_dropped"] == 0 and not cache._pending
    cache.release_rows([0])
    cache.check_integrity(live_slots=published)


def test_a_free_after_an_uncollected_publish_drops_its_snapshot(micro, copies_in_flight):
    """A request finishes: its publish (the first snapshot of the cache) and a free of its slots
    are both in flight; collected in order, the snapshot is keyed and then dropped with its slot."""
    cfg, w = micro
    model = V4Model(cfg, w)
    cache, slots = _cache(cfg, "torch"), Slots()
    own = slots.take(40)
    cache.req_to_token[0, :40] = own
    a = cache.bind(0, 1, 0)
    model.forward(cache, [a], [torch.arange(40)])
    cache.publish(a, own.clone(), own.clone())
    cache.release_rows([0])
    cache.free_token_slots(own.long())
    assert not cache.snapshots
    cache.collect_pending(wait=True)
    assert cache.stats["snapshots_taken"] == 1 and cache.stats["snapshots_dropped"] == 1 and not cache.snapshots
    assert all(p.num_used == 0 for p in cache.pools.values())
    cache.check_integrity(live_slots=torch.empty(0, dtype=torch.long))


def test_a_matched_snapshot_is_not_evicted_before_its_request_binds(micro, copies_in_flight):
    """Within one scheduling round a request matches a snapshot, then a later match collects a
    publish whose new snapshot puts the cache over its budget: the eviction spares what was
    matched (its request restores from it in the next step) and takes the next one in LRU order."""
    cfg, w = micro
    model = V4Model(cfg, w)
    probe = _cache(cfg, "torch")
    cache = SglangV4Cache.with_own_table(cfg, ROWS, SLOTS, max_seq_len=MAX_LEN, backend="torch",
                                         snapshot_budget_bytes=probe.snapshot_bytes_each)  # room for one
    c_slots = Slots().take(30) + 3000
    cache.req_to_token[2, :30] = c_slots
    c = cache.bind(2, 1, 0)
    model.forward(cache, [c], [torch.arange(30)])  # request C, about to finish
    tail, (resume, key) = _shared_prefix(cfg, model, cache)  # request B (row 1) matched A's snapshot
    assert resume == 261 and cache._matched == {id(cache.snapshots[key])}
    cache.publish(c, c_slots.clone(), c_slots.clone())  # request C finished, in flight
    assert cache.deepest_snapshot(cache.req_to_token[1, :268]) == (261, key)  # another match collects it
    assert list(cache.snapshots) == [key] and cache.stats["snapshots_evicted"] == 1
    cache.expect_resume(1, 1, resume, cache.snapshots[key])
    b = cache.bind(1, 1, resume)
    model.forward(cache, [b], [tail])
    assert not cache._matched
    cache.check_integrity()
