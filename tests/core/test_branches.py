"""``core.branches``: a layer's independent chains as the parts of one ``Branches.run``. On the
CPU the parts run in order; the branch layout (the MoE's routed and shared experts apart, added
by ``hc_post``) gives the plain layout's logits bit for bit. The streams themselves are the GPU
tests' (``tests/core/test_step_gpu.py``)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sglang_dsv4.checkpoint import load_checkpoint
from sglang_dsv4.core import branches
from sglang_dsv4.core.cache import V4Cache
from sglang_dsv4.core.model import V4Model


def test_parts_run_in_order_off_the_gpu(monkeypatch):
    monkeypatch.setattr(branches, "ENABLED", True)
    seen = []
    b = branches.Branches(torch.device("cpu"))
    assert b.on
    assert b.run([lambda: seen.append(0) or "a", lambda: seen.append(1) or "b", lambda: seen.append(2) or "c"]) \
        == ["a", "b", "c"]
    assert seen == [0, 1, 2]


def test_the_branch_layout_gives_the_plain_logits(micro_dir, monkeypatch):
    ckpt = load_checkpoint(micro_dir)
    ids = torch.randint(0, ckpt.config.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    out = {}
    for on in (False, True):
        monkeypatch.setattr(branches, "ENABLED", on)
        model = V4Model(ckpt.config, dict(ckpt.tensors))
        cache = V4Cache(ckpt.config, max_requests=2, max_total_tokens=512)
        a, b = cache.new_request(), cache.new_request()
        got = model.forward(cache, [a, b], [ids[:30], ids[5:25]])
        for t in range(30, 40):  # decode steps of both
            got += model.forward(cache, [a, b], [ids[t:t + 1], ids[t - 5:t - 4]])
        out[on] = torch.cat(got)
    assert torch.equal(out[True], out[False])


class PartAccesses(TorchDispatchMode):
    """Which storages each part of a ``Branches.run`` reads and writes (an op's new outputs count
    as written by it; a view's, an input's), the tensors it touched held so that no storage is freed and reused inside a
    run (which would make two parts' allocations look alike)."""

    def __init__(self):
        super().__init__()
        self.part: int | None = None
        self.reads: dict[int, set[int]] = {}
        self.writes: dict[int, set[int]] = {}
        self.held: list[torch.Tensor] = []

    def _note(self, t: torch.Tensor, written: bool) -> None:
        if t.numel() == 0:
            return
        self.held.append(t)
        (self.writes if written else self.reads).setdefault(self.part, set()).add(t.untyped_storage().data_ptr())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.part is None:
            return out
        for i, arg in enumerate(func._schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            written = arg.alias_info is not None and arg.alias_info.is_write
            for t in (value if isinstance(value, (list, tuple)) else (value,)):
                if isinstance(t, torch.Tensor):
                    self._note(t, written)
        fresh = all(r.alias_info is None for r in func._schema.returns)  # not a view, not in place
        for t in (out if isinstance(out, (list, tuple)) else (out,)):
            if isinstance(t, torch.Tensor) and fresh:
                self._note(t, True)
        return out


def test_the_parts_of_a_branch_run_share_no_buffer_one_of_them_writes(micro_dir, monkeypatch):
    """What the streams rely on: within one ``Branches.run`` no part reads or writes a storage
    that another part writes (its outputs included): each part reads only what existed before the
    fork (the layer input, weights, index tensors derived before it) and writes only its own
    state, pools and outputs. A tensor derived lazily inside one part and reused by another, or
    two parts writing one buffer, would race on side streams; here it fails by name. The serving
    cache with FlashMLA's layout, a prefill then decode steps of two requests."""
    from sglang_dsv4.srt.state import SglangV4Cache

    monkeypatch.setattr(branches, "ENABLED", True)
    ckpt = load_checkpoint(micro_dir)
    cfg = ckpt.config
    model = V4Model(cfg, dict(ckpt.tensors))
    cache = SglangV4Cache.with_own_table(cfg, 3, 512, max_seq_len=160, backend="torch-fp8")
    conflicts, runs = [], []
    run = branches.Branches.run

    def checked(self, parts):
        mode = PartAccesses()

        def tagged(i, part):
            def go():
                mode.part = i
                try:
                    return part()
                finally:
                    mode.part = None
            return go
        with mode:
            out = run(self, [tagged(i, p) for i, p in enumerate(parts)])
        runs.append(len(parts))
        for i in mode.writes:
            for j in set(mode.reads) | set(mode.writes):
                shared = mode.writes[i] & (mode.reads.get(j, set()) | mode.writes.get(j, set())) if i != j else set()
                if shared:
                    conflicts.append((len(runs), i, j, len(shared)))
        return out

    monkeypatch.setattr(branches.Branches, "run", checked)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (60,), generator=g)
    cache.req_to_token[0, :40] = torch.arange(1, 41, dtype=torch.int32)
    cache.req_to_token[1, :30] = torch.arange(41, 71, dtype=torch.int32)
    a, b = cache.bind(0, 1, 0), cache.bind(1, 1, 0)
    model.forward(cache, [a, b], [ids[:40], ids[40:]])
    for t in range(3):
        cache.req_to_token[0, 40 + t] = 71 + 2 * t
        cache.req_to_token[1, 30 + t] = 72 + 2 * t
        model.forward(cache, [a, b], [ids[t:t + 1], ids[t + 1:t + 2]])
    cache.check_integrity()
    # every layer's attention forks (2 to 4 parts) and its MoE (routed, shared), each step
    assert len(runs) == 4 * 2 * cfg.num_hidden_layers and max(runs) == 4
    assert not conflicts, f"(run, writing part, other part, storages shared): {conflicts[:8]}"
