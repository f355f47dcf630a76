"""Paged, reference-counted, append-only storage of compressed KV entries.

An entry is written once and then only read, so requests that share a prefix share the pages
holding its entries. A request keeps a page table (entry j lives at offset j % page_size of page
``table[j // page_size]``). Each page records how far it has been appended (``filled``): the first
request to append at a page's frontier writes in place; a request whose own next entry falls
below that frontier (it forked from a shorter prefix) copies the valid head of the page first
(copy-on-write). Entries are therefore never overwritten, and pages are freed when the last
table or snapshot referencing them lets go.
"""

from __future__ import annotations

import torch

from ..kernels.kv_layout import FloatRows, RowLayout

Tensor = torch.Tensor


class OutOfPagesError(RuntimeError):
    """The compressed-entry pool has no free page left."""


def _grow_before_scratch(buf: Tensor, pages: int, new: Tensor) -> Tensor:
    """A page buffer of ``pages`` pages + the scratch page with ``new`` pages inserted before the
    scratch page (which stays last); the leading dim is page-major, flat rows or one per page."""
    cut = buf.shape[0] // (pages + 1) * pages
    return torch.cat((buf[:cut], new, buf[cut:]))


class EntryPagePool:
    """Pages of ``page_size`` entries. ``dims`` gives each stored tensor a width (float rows of
    ``dtype``: ``tensors[name]`` is [num_pages * page_size, dim]) or a ``RowLayout`` (its page
    buffer, e.g. FlashMLA's fp8 layout); entries are read and written through ``read``/``write``."""

    def __init__(self, num_pages: int, page_size: int, dims: dict[str, int | RowLayout],
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"num_pages and page_size must be positive, got {num_pages}, {page_size}")
        self.num_pages, self.page_size = num_pages, page_size
        self.layouts: dict[str, RowLayout] = {
            name: d if isinstance(d, RowLayout) else FloatRows(page_size, d, dtype) for name, d in dims.items()}
        for name, layout in self.layouts.items():
            if layout.page_size != page_size:
                raise ValueError(f"{name}: layout pages of {layout.page_size} rows in a pool of {page_size}-entry pages")
        # one page more than the pool hands out: the scratch page, always last (``scratch_row``)
        self.tensors = {name: layout.alloc_pool(num_pages + 1, device) for name, layout in self.layouts.items()}
        self.refcount = [0] * num_pages
        self.filled = [0] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))
        self.num_copies = 0  # copy-on-write events, for tests and metrics

    # ---- allocation ----------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        """Take a free page (refcount 1, empty)."""
        if not self._free:
            raise OutOfPagesError(f"compressed KV pool exhausted ({self.num_pages} pages of {self.page_size} entries)")
        page = self._free.pop()
        self.refcount[page], self.filled[page] = 1, 0
        return page

    def grow(self, extra_pages: int) -> None:
        """Add ``extra_pages`` free pages (tensors are reallocated; storage rows keep their index)."""
        old = self.num_pages
        self.num_pages += extra_pages
        for name, t in self.tensors.items():
            self.tensors[name] = _grow_before_scratch(t, old, self.layouts[name].alloc_pool(extra_pages, t.device))
        self.refcount += [0] * extra_pages
        self.filled += [0] * extra_pages
        self._free = list(range(self.num_pages - 1, old - 1, -1)) + self._free

    def incref(self, pages: list[int]) -> None:
        for p in pages:
            self.refcount[p] += 1

    def decref(self, pages: list[int]) -> None:
        for p in pages:
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                self._free.append(p)
            elif self.refcount[p] < 0:
                raise AssertionError(f"page {p} released more often than referenced")

    @property
    def scratch_row(self) -> int:
        """A storage row no entry owns: the batched step writes discarded entries there."""
        return self.num_pages * self.page_size

    def pages_for(self, num_entries: int) -> int:
        return -(-num_entries // self.page_size)

    # ---- entries -------------------------------------------------------------------------
    def pages_needed(self, table: list[int], start: int, end: int) -> int:
        """Free pages ``extend(table, start, end)`` would take (new pages plus a copy-on-write)."""
        if end <= start:
            return 0
        cow = 1 if start % self.page_size and self.filled[table[-1]] != start % self.page_size else 0
        return self.pages_for(end) - self.pages_for(start) + cow

    def extend(self, table: list[int], start: int, end: int) -> Tensor:
        """Make entries start..end-1 of the table's owner writable; -> their storage rows [end-start].

        ``start`` is the number of entries the owner already has. Mutates ``table`` (new pages, or
        a private copy of a shared partial page) and the page frontiers. Callers check
        ``pages_needed`` first so that a failure leaves nothing half-done.
        """
        ps = self.page_size
        if len(table) != self.pages_for(start):
            raise AssertionError(f"page table has {len(table)} pages for {start} entries")
        if end <= start:
            return torch.empty(0, dtype=torch.long)
        if self.pages_needed(table, start, end) > self.num_free:
            raise OutOfPagesError(
                f"compressed KV pool exhausted: need {self.pages_needed(table, start, end)} pages, "
                f"{self.num_free} of {self.num_pages} free")
        offset = start % ps
        if offset and self.filled[table[-1]] != offset:
            # Another request appended past our prefix in this page: copy our head, then append.
            page, new = table[-1], self.alloc()
            for name, t in self.tensors.items():
                self.layouts[name].copy_head(t, page, new, offset)
            self.decref([page])
            table[-1] = new
            self.num_copies += 1
        while len(table) < self.pages_for(end):
            table.append(self.alloc())
        for j in range(start // ps, len(table)):
            self.filled[table[j]] = max(self.filled[table[j]], min(ps, end - j * ps))
        return self.slots(table, torch.arange(start, end))

    def slots(self, table: list[int], entries: Tensor) -> Tensor:
        """Storage rows of entry indices ``entries`` under ``table``."""
        pages = torch.tensor(table, dtype=torch.long)[entries // self.page_size] if len(table) else entries
        return pages * self.page_size + entries % self.page_size

    def write(self, name: str, rows: Tensor, x: Tensor) -> None:
        """Store entries x [n, dim] of tensor ``name`` at storage rows ``rows``."""
        self.layouts[name].write(self.tensors[name], rows, x)

    def read(self, name: str, rows: Tensor) -> Tensor:
        """Entries of tensor ``name`` at storage rows ``rows`` -> [n, dim]."""
        return self.layouts[name].read(self.tensors[name], rows)

    def check_integrity(self, live_tables: list[list[int]]) -> None:
        """Every page is free xor referenced exactly as often as live tables/snapshots hold it."""
        counts = [0] * self.num_pages
        for table in live_tables:
            for p in table:
                counts[p] += 1
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a page is on the free list twice")
        for p in range(self.num_pages):
            if counts[p] != self.refcount[p]:
                raise AssertionError(f"page {p}: refcount {self.refcount[p]} but {counts[p]} holders")
            if (p in free) != (counts[p] == 0):
                raise AssertionError(f"page {p}: free={p in free} with {counts[p]} holders")


class EntryRowPool:
    """Storage rows of compressed entries handed out one at a time, each freed by its owner.

    The serving cache ties an entry's lifetime to the SGLang token slot that completed it, so rows
    are allocated and freed individually (no page tables, no sharing bookkeeping here). Pages of
    ``page_size`` rows exist only because the storage layout is paged (FlashMLA reads rows as
    ``page * P + offset``); a row is never split across pages. The free rows are a stack tensor,
    so allocating and freeing n rows are single tensor operations.
    """

    def __init__(self, num_rows: int, layouts: dict[str, RowLayout], device: str | torch.device = "cpu"):
        sizes = {layout.page_size for layout in layouts.values()}
        if len(sizes) != 1:
            raise ValueError(f"layouts of one pool must share a page size, got {sorted(sizes)}")
        self.page_size = sizes.pop()
        self.layouts, self.device = layouts, torch.device(device)
        # the scratch page (always last, see ``scratch_row``) is all the pool holds before ``grow``
        self.tensors: dict[str, Tensor] = {name: layout.alloc_pool(1, self.device) for name, layout in layouts.items()}
        self.capacity = 0
        self._free = torch.empty(0, dtype=torch.long)
        self._num_free = 0
        self._in_use = torch.zeros(0, dtype=torch.bool)
        self.grow(max(num_rows, 1))

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.capacity - self._num_free

    @property
    def scratch_row(self) -> int:
        """A storage row no entry owns: the batched step writes discarded entries there."""
        return self.capacity

    @property
    def row_bytes(self) -> float:
        """Bytes of one entry row over all tensors of the pool (page padding amortised)."""
        return sum(layout.row_bytes for layout in self.layouts.values())

    def grow(self, extra_rows: int) -> None:
        """Add at least ``extra_rows`` free rows (whole pages; tensors are reallocated, rows keep
        their index)."""
        pages = -(-extra_rows // self.page_size)
        old = self.capacity
        self.capacity += pages * self.page_size
        for name, t in self.tensors.items():
            self.tensors[name] = _grow_before_scratch(t, old // self.page_size,
                                                      self.layouts[name].alloc_pool(pages, self.device))
        new_rows = torch.arange(self.capacity - 1, old - 1, -1)
        live = self._free[:self._num_free]
        self._free = torch.cat((new_rows, live))  # the stack's top is the end: old free rows first
        self._num_free = self._free.numel()
        self._in_use = torch.cat((self._in_use, torch.zeros(self.capacity - old, dtype=torch.bool)))

    def rows_in_use(self) -> Tensor:
        """The rows handed out and not freed, ascending (int64, host)."""
        return torch.nonzero(self._in_use).flatten()

    def in_use(self, rows: Tensor) -> Tensor:
        """[n] bool: whether each of ``rows`` is handed out."""
        return self._in_use[rows.long().cpu()]

    def alloc(self, n: int) -> Tensor:
        """``n`` free rows (growing the pool when it runs out) -> int64 tensor [n]."""
        if n > self._num_free:
            self.grow(max(self.capacity, n - self._num_free))
        rows = self._free[self._num_free - n:self._num_free].clone()
        self._num_free -= n
        self._in_use[rows] = True
        return rows

    def free(self, rows: Tensor) -> None:
        """Return rows to the pool; a row freed twice is an error (it would be handed out twice)."""
        rows = rows.long().cpu()
        if rows.numel() == 0:
            return
        if not bool(self._in_use[rows].all()) or rows.unique().numel() != rows.numel():
            raise AssertionError("compressed entry row freed twice")
        self._in_use[rows] = False
        self._free[self._num_free:self._num_free + rows.numel()] = rows
        self._num_free += rows.numel()

    def write(self, name: str, rows: Tensor, x: Tensor) -> None:
        """Store entries x [n, dim] of tensor ``name`` at rows ``rows``."""
        self.layouts[name].write(self.tensors[name], rows, x)

    def read(self, name: str, rows: Tensor) -> Tensor:
        """Entries of tensor ``name`` at rows ``rows`` -> [n, dim]."""
        return self.layouts[name].read(self.tensors[name], rows)
