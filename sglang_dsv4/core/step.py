"""One forward step as fixed-shape device tensors, and the seam through which the model reaches
its cache.

The model's step is a function of device tensors only: (request slots, positions, storage rows to
write) -> logits. Everything data-dependent that decides *shapes* or *which rows* (how many tokens
each request brings, which tokens complete a compressed group, which entry rows they fill) is
host arithmetic on lengths the caller already has on the host, done here before the step and
copied to the device in one go. Inside the step there is no loop over requests and no host sync.

``V4CacheView`` is the one interface the model uses: the reference ``core.cache.V4Cache`` (page
tables, refcounts) and the serving ``srt.state.SglangV4Cache`` (SGLang's token-slot lifetimes)
both implement it, and the same ``V4Model`` code runs over either.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol, Sequence, TypeVar

import torch

if TYPE_CHECKING:
    from ..kernels.backend import AttentionBackend
    from .cache import RequestState
    from .slot_state import SlotStateLayout

Tensor = torch.Tensor
RATIOS = (4, 128)
C128 = 128
# On the CPU a step's tokens (and ratio-128 segments) are padded to a multiple of this: ATen's
# vectorised elementwise loops run their last < 2 vectors through the scalar (libm) versions of
# exp/log/sin..., which round differently from the vector (Sleef) ones, so an element's value
# would depend on where it falls in its tensor, i.e. on the batch. With every per-token tensor a
# multiple of 32 rows nothing falls in a tail; CPU GEMMs run over tiles of exactly 32 rows
# (``ops.CPU_ROW_TILE``), so these rows need no further padding.
CPU_TOKEN_TILE = 32
# The deterministic mode (``V4Model(deterministic=True)``, opt-in on the GPU) runs every forward
# over exactly this many token rows: a longer step is cut into pieces, a shorter one padded. GPU
# kernels are chosen by shape (cuBLAS by row count, FlashMLA's decode split by batch size, Triton
# configs by size), so only a step of one fixed shape gives each row a result that does not
# depend on the rows beside it, i.e. on the chunking and the batch.
DETERMINISTIC_TILE = 64
MIN_ENTRY_WIDTH = 64  # the GPU's entry-table width bucket floor (FlashMLA reads indices in blocks of 64)


@dataclass
class StepTables:
    """What the cache hands the step for each compression ratio (int64 device tensors).

    ``write_rows[r]`` [T]: the storage row where token t's completed entry goes (the pool's
    scratch row when t completes no group); ``entry_rows[r]`` [B, N_r]: storage rows of each
    request's entries 0..N_r-1 (-1 past the entries it has after this step); ``replaced[r]``
    [T]: the entry row a completing token's slot held before, which leaves the tables (-1 where
    none; only caches whose slots can be written again fill it), for ``V4CacheView.retire``.
    """

    write_rows: dict[int, Tensor]
    entry_rows: dict[int, Tensor]
    replaced: dict[int, Tensor] = field(default_factory=dict)


class EntryPool(Protocol):
    """Compressed-entry storage of one ratio: page buffers per tensor name, and a scratch row."""

    tensors: dict[str, Tensor]
    layouts: dict
    scratch_row: int

    def write(self, name: str, rows: Tensor, x: Tensor) -> None: ...

    def read(self, name: str, rows: Tensor) -> Tensor: ...


class V4CacheView(Protocol):
    """What ``V4Model`` needs of a cache (implemented by ``V4Cache`` and ``SglangV4Cache``)."""

    backend: AttentionBackend
    layout: SlotStateLayout
    slot_state: dict[str, Tensor]     # [num_slots + 1, ...] each; the last slot is scratch
    pools: dict[int, EntryPool]       # ratio -> compressed entries
    c4_index: dict[int, int]          # layer -> index among ratio-4 layers
    c128_index: dict[int, int]        # layer -> index among ratio-128 layers
    host_entries: bool                # plan_tables builds the entry tables on the host (the reference)

    def check_length(self, req: RequestState, num_new: int) -> None:
        """Raise ValueError if the request would exceed the cache's maximum length."""

    def table_widths(self, end: int) -> dict[int, int]:
        """The entry tables' width per ratio of a step whose longest request ends at ``end``
        tokens (``entry_width``; what ``plan_tables`` gives such a step)."""

    def plan_tables(self, reqs: Sequence[RequestState], starts: list[int], lens: list[int],
                    positions: Tensor) -> TablePlan:
        """Host part of the step's tables: reserve the rows of the entries this step completes
        (all-or-nothing) -> what the device part needs, as host tensors."""

    def apply_tables(self, step: StepBatch, write: dict[int, Tensor], entries: dict[int, Tensor] | None,
                     widths: dict[int, int]) -> StepTables:
        """Device part (``plan``'s tensors staged): device ops only, no host sync, so a CUDA graph
        can hold it. Padding requests (the scratch slot, position 0) complete nothing."""

    def retire(self, replaced: dict[int, Tensor]) -> None:
        """Take back the entry rows a step's tables replaced (``StepTables.replaced``, device
        tensors the cache may read later: a graph replay hands copies of its buffers). Host
        bookkeeping, so outside ``apply_tables``: a graph replays device work only."""


@dataclass
class TablePlan:
    """``V4CacheView.plan_tables``' result: per ratio the storage row of each token's completed
    entry (``write`` [T]: the scratch row where it completes none), the entry tables when the
    host builds them (``entries`` [B, width], -1 padded; None: the device builds them) and
    the tables' widths (``entry_width``)."""

    write: dict[int, Tensor]
    entries: dict[int, Tensor] | None
    widths: dict[int, int]


def step_tables(cache: V4CacheView, reqs: Sequence[RequestState], step: StepBatch) -> StepTables:
    """The step's tables: ``cache.plan_tables``, one staged copy, ``cache.apply_tables``, and the
    rows they replaced back to the cache (``cache.retire``)."""
    plan = cache.plan_tables(reqs, step.starts_host, step.lens_host, step.positions_host)
    host = {f"w{r}": t for r, t in plan.write.items()}
    host.update({f"t{r}": t for r, t in (plan.entries or {}).items()})
    dev = stage(host, step.ids.device)
    entries = None if plan.entries is None else {r: dev[f"t{r}"] for r in plan.entries}
    tables = cache.apply_tables(step, {r: dev[f"w{r}"] for r in plan.write}, entries, plan.widths)
    cache.retire(tables.replaced)
    return tables


def entry_width(needed: int, max_entries: int, device: torch.device) -> int:
    """Width of the step's entry tables for ``needed`` entries (max over the batch).

    On the CPU always ``max_entries``: reductions over a row then have one length whatever the
    batch, which keeps each position's result independent of how the sequence was chunked. On a
    GPU the next power of two (>= 64), so the work follows the context while shapes stay few.
    """
    if device.type == "cpu":
        return max(max_entries, 1)
    width = MIN_ENTRY_WIDTH
    while width < needed:
        width *= 2
    return min(width, max(max_entries, MIN_ENTRY_WIDTH))


@dataclass
class C128Segments:
    """The ratio-128 groups a step touches, one segment per (request, group) pair.

    ``tok[g, i]`` is the token row of the segment's i-th position (-1 past its end); ``carry``:
    the segment continues the group the request's slot state holds; ``store_slot``: where the
    running state goes afterwards (the request's slot for its last segment, else the scratch
    slot); ``completes``: the segment ends its group (its entry is real and the state resets);
    ``last_tok``: the token row of its last position; ``first_pos``: the group's first position.
    """

    tok: Tensor
    carry: Tensor
    store_slot: Tensor
    completes: Tensor
    last_tok: Tensor
    first_pos: Tensor
    width: int  # max positions of a segment (<= 128): the length of the sequential pooling loop


_T = TypeVar("_T")

# A step's new tokens: one 1-D tensor per request, or one [B, L] tensor when every request brings
# L tokens (a decode step's [B, 1]): a server's decode batch arrives as one tensor, and cutting it
# into B views costs the host a few microseconds per request, every step.
TokenIds = Sequence[Tensor] | Tensor


def token_lens(ids: TokenIds) -> list[int]:
    """New tokens per request of ``ids``."""
    if isinstance(ids, Tensor):
        return [ids.shape[1]] * ids.shape[0]
    return [t.numel() for t in ids]


def flat_tokens(ids: TokenIds) -> Tensor:
    """All requests' new tokens in request order, as one 1-D tensor."""
    if isinstance(ids, Tensor):
        return ids.reshape(-1)
    return ids[0] if len(ids) == 1 else torch.cat(list(ids))


@dataclass
class StepBatch:
    """A step's requests as device tensors (T tokens, B requests) plus the host lengths."""

    ids: Tensor          # [T]
    positions: Tensor    # [T]
    tok_req: Tensor      # [T] request index b of each token
    row0: Tensor         # [B] first token row of each request
    slots: Tensor        # [B] slot-state row of each request
    starts: Tensor       # [B] first position of each request's new tokens
    ends: Tensor         # [B] positions after them
    scratch_slot: int
    starts_host: list[int]
    lens_host: list[int]
    positions_host: Tensor  # [T] on the host
    c128: C128Segments | None = None
    tables: StepTables | None = None
    num_real: int | None = None  # the caller's requests, before any padding ones (None: no padding)
    grid_len: int | None = None  # ``token_grid``'s width when fixed (a captured extend), else the longest request
    # index tensors derived from the ones above, shared by every layer of the step (``derived``)
    _derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def derived(self, key: tuple, make: Callable[[], _T]) -> _T:
        """``make()``, computed on the first call with ``key`` in this step and reused by the later
        layers: the window, ring and compressor indices depend on the step's positions and slots
        only, and each costs a few small kernels per layer otherwise. (A fresh step per forward
        and per graph capture: nothing outlives the step.)"""
        if key not in self._derived:
            self._derived[key] = make()
        return self._derived[key]

    @property
    def num_tokens(self) -> int:
        return self.ids.numel()

    @property
    def real_lens(self) -> list[int]:
        """New tokens per request of the caller (without the padding request)."""
        return self.lens_host if self.num_real is None else self.lens_host[:self.num_real]

    @property
    def num_reqs(self) -> int:
        return len(self.lens_host)

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.lens_host)

    @property
    def max_len(self) -> int:
        return max(self.lens_host)

    def token_grid(self) -> Tensor:
        """[B, L] token rows of each request's new tokens (L = ``grid_len`` or the longest), -1 padded."""
        L = self.grid_len or self.max_len
        i = torch.arange(L, device=self.row0.device)
        lens = self.ends - self.starts
        return torch.where(i[None, :] < lens[:, None], self.row0[:, None] + i[None, :], -1)


def build_step(reqs: Sequence[RequestState], ids: TokenIds, starts: Sequence[int],
               scratch_slot: int, device: torch.device, with_c128: bool) -> StepBatch:
    """The step's index tensors from host lengths: vectorised on the host, one staged copy."""
    lens = torch.tensor(token_lens(ids), dtype=torch.long)
    st = torch.tensor(list(starts), dtype=torch.long)
    slots = torch.tensor([r.slot for r in reqs], dtype=torch.long)
    B, T = lens.numel(), int(lens.sum())
    row0 = torch.cumsum(lens, 0) - lens
    tok_req = torch.repeat_interleave(torch.arange(B), lens)
    positions = st[tok_req] + torch.arange(T) - row0[tok_req]
    c128 = _c128_segments(st, lens, row0, slots, scratch_slot) if with_c128 else None
    if c128 is not None and device.type == "cpu":
        c128 = _pad_segments(c128, CPU_TOKEN_TILE, scratch_slot)

    host = {"positions": positions, "tok_req": tok_req, "row0": row0, "slots": slots, "starts": st,
            "ends": st + lens}
    on_host = ids.device.type == "cpu" if isinstance(ids, Tensor) else all(t.device.type == "cpu" for t in ids)
    if on_host and device.type != "cpu":  # token ids from the host ride along
        host["ids"] = flat_tokens(ids).long()
    if c128 is not None:
        host.update({f"c128_{f}": getattr(c128, f).long() for f in C128_FIELDS})
    dev = stage(host, device)
    if c128 is not None:
        c128 = C128Segments(*(dev[f"c128_{f}"] if f not in ("carry", "completes") else dev[f"c128_{f}"] != 0
                              for f in C128_FIELDS), width=c128.width)
    flat_ids = dev["ids"] if "ids" in dev else flat_tokens(ids).to(device)
    return StepBatch(ids=flat_ids, positions=dev["positions"], tok_req=dev["tok_req"],
                     row0=dev["row0"], slots=dev["slots"], starts=dev["starts"], ends=dev["ends"],
                     scratch_slot=scratch_slot, starts_host=st.tolist(), lens_host=lens.tolist(),
                     positions_host=positions, c128=c128)


C128_FIELDS = ("tok", "carry", "store_slot", "completes", "last_tok", "first_pos")  # C128Segments' tensors


def stage(host: dict[str, Tensor], device: torch.device) -> dict[str, Tensor]:
    """Copy int64 host tensors to ``device`` as one pinned, non-blocking copy -> views of it."""
    if device.type == "cpu":
        return host
    flat = torch.cat([t.flatten() for t in host.values()])
    flat = flat.pin_memory() if torch.cuda.is_available() else flat
    on_dev = flat.to(device, non_blocking=True)
    out, off = {}, 0
    for name, t in host.items():
        out[name] = on_dev[off:off + t.numel()].view(t.shape)
        off += t.numel()
    return out


def _c128_segments(starts: Tensor, lens: Tensor, row0: Tensor, slots: Tensor, scratch_slot: int) -> C128Segments:
    ends = starts + lens
    g0, g1 = starts // C128, (ends - 1) // C128
    n = g1 - g0 + 1
    G = int(n.sum())
    seg_req = torch.repeat_interleave(torch.arange(lens.numel()), n)
    first_seg = torch.cumsum(n, 0) - n
    g = g0[seg_req] + torch.arange(G) - first_seg[seg_req]
    s, e = starts[seg_req], ends[seg_req]
    lo, hi = torch.maximum(g * C128, s), torch.minimum(g * C128 + C128, e)
    width = int((hi - lo).max())
    i = torch.arange(width)
    tok = torch.where(i[None, :] < (hi - lo)[:, None], (row0[seg_req] + lo - s)[:, None] + i[None, :], -1)
    return C128Segments(
        tok=tok, carry=(lo == s) & (s % C128 != 0),
        store_slot=torch.where(g == g1[seg_req], slots[seg_req], scratch_slot),
        completes=hi == g * C128 + C128, last_tok=row0[seg_req] + hi - 1 - s, first_pos=g * C128, width=width)


def _pad_segments(seg: C128Segments, tile: int, scratch_slot: int) -> C128Segments:
    """Empty segments (no rows, state to the scratch slot) up to a multiple of ``tile``."""
    pad = -seg.tok.shape[0] % tile
    if not pad:
        return seg
    z = torch.zeros(pad, dtype=torch.long)
    return C128Segments(
        tok=torch.cat((seg.tok, torch.full((pad, seg.width), -1, dtype=torch.long))),
        carry=torch.cat((seg.carry, z.bool())), store_slot=torch.cat((seg.store_slot, z + scratch_slot)),
        completes=torch.cat((seg.completes, z.bool())), last_tok=torch.cat((seg.last_tok, z)),
        first_pos=torch.cat((seg.first_pos, z)), width=seg.width)


def pad_step(step: StepBatch, tile: int, scratch_rows: dict[int, int]) -> StepBatch:
    """``step`` with a padding request of its own (the scratch slot, every token at position 0,
    completing nothing) bringing the tokens to a multiple of ``tile``; its tables padded with
    the pools' scratch rows. Its results are dropped (``num_real``)."""
    pad = -step.num_tokens % tile
    if not pad:
        return step
    dev, T, B = step.ids.device, step.num_tokens, step.num_reqs

    def cat(x: Tensor, v: int, n: int = 1) -> Tensor:
        return torch.cat((x, torch.full((n,) + tuple(x.shape[1:]), v, dtype=x.dtype, device=x.device)))

    tables = None
    if step.tables is not None:
        tables = StepTables({r: cat(w, scratch_rows[r], pad) for r, w in step.tables.write_rows.items()},
                            {r: cat(t, -1) for r, t in step.tables.entry_rows.items()})
    return StepBatch(
        ids=cat(step.ids, 0, pad), positions=cat(step.positions, 0, pad), tok_req=cat(step.tok_req, B, pad),
        row0=cat(step.row0, T), slots=cat(step.slots, step.scratch_slot), starts=cat(step.starts, 0),
        ends=cat(step.ends, pad), scratch_slot=step.scratch_slot, starts_host=step.starts_host + [0],
        lens_host=step.lens_host + [pad], positions_host=cat(step.positions_host, 0, pad), c128=step.c128,
        tables=tables, num_real=B)


def completing_tokens(positions: Tensor, ratio: int) -> Tensor:
    """[T] bool: token t completes group (p + 1) // ratio - 1 (a tensor, or a numpy array for
    numpy positions: the host plans steps in numpy)."""
    return (positions + 1) % ratio == 0


def tile_pieces(lens: Sequence[int], tile: int) -> list[list[tuple[int, int, int]]]:
    """The tokens of a step (request i brings ``lens[i]``), in request order, cut into pieces of
    at most ``tile`` tokens -> per piece its (request index, first, end) token ranges."""
    pieces, cur, room = [], [], tile
    for i, n in enumerate(lens):
        lo = 0
        while lo < n:
            take = min(room, n - lo)
            cur.append((i, lo, lo + take))
            lo += take
            room -= take
            if room == 0:
                pieces.append(cur)
                cur, room = [], tile
    if cur:
        pieces.append(cur)
    return pieces
