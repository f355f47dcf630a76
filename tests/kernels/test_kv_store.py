"""``kernels.kv_store``: the fp8 layouts' ``write`` through the one-launch row store leaves the
page bytes the torch store leaves (interpreted on the CPU: FlashMLA's V4 rows and the indexer's
keys, pool pages and a ring's strided slice of [slots, layers, page], rows given as storage
rows or as (page, offset) pairs), also with the quantisation inside the store's launch; anything
else keeps the torch store."""

from __future__ import annotations

import pytest
import torch

from sglang_dsv4.kernels import kv_store, triton_support

_CASES = """
import torch
from sglang_dsv4.kernels import kv_store
from sglang_dsv4.kernels.kv_layout import IndexFp8Rows, V4Fp8Rows
from sglang_dsv4.quant import fp8_qat
g = torch.Generator().manual_seed(0)
worst = 0

def torch_store(layout, buf, rows, x):
    page, off = layout.locate(rows)
    data, scales = layout.pack(x)
    layout._data(buf)[page, off] = data
    layout._scales(buf)[page, off] = scales

def rows_of(n, dim):
    # magnitudes from fp8's subnormals (tiles under the 1e-4 floor) to large, exact zeros and
    # negative zeros, values on e4m3 rounding ties, and the model's own QAT'ed rows
    x = torch.randn(n, dim, generator=g) * torch.exp2(torch.randint(-24, 12, (n, 1), generator=g).float())
    x[0, :dim // 2] = 0.0
    x[0, dim // 2:] = -0.0
    x[1] = torch.randint(-64, 64, (dim,), generator=g).float() * 0.0625 + 0.03125  # ties at 2^-5 steps
    x[2, :64] = fp8_qat(x[2:3, :64], 64)[0]
    x[3, :64] = 1e-7 * torch.randn(64, generator=g)  # under the amax floor
    return x

for fused in (False, True):  # the store of the quantiser's outputs; quantised in the store's launch
    kv_store.FUSED_WRITE = fused
    for layout, dim in ((V4Fp8Rows(64), 512), (V4Fp8Rows(4, nope=128, rope=64), 192),
                        (V4Fp8Rows(4, nope=64, rope=32, rope_dtype=torch.float32), 96), (IndexFp8Rows(64), 128),
                        (IndexFp8Rows(4, dim=64), 64)):
        for ring in (False, True):
            pages, n = 5, 9
            if ring:  # the ring of layer 1 of [slots, 3 layers, page]: a strided page buffer
                whole = torch.randint(0, 256, (pages, 3, layout.page_bytes), generator=g, dtype=torch.uint8)
                ref_whole = whole.clone()
                buf, ref = whole[:, 1], ref_whole[:, 1]
            else:
                buf = torch.randint(0, 256, (pages, layout.page_bytes), generator=g, dtype=torch.uint8)
                ref = buf.clone()
            rows = torch.randperm(pages * layout.page_size, generator=g)[:n]
            x = rows_of(n, dim)
            for where in (rows, (rows // layout.page_size, rows % layout.page_size)):
                layout.write(buf, where, x)
                torch_store(layout, ref, where, x)
                worst += int(not torch.equal(buf, ref))
                if ring:
                    worst += int(not torch.equal(whole, ref_whole))
            # what a read gives back: the torch quantiser's round trip
            worst += int(not torch.equal(layout.read(buf, rows), layout.round(x)))
print("WORST", worst)
"""


def test_the_row_store_leaves_the_torch_stores_bytes(triton_interpreted):
    """Interpreted, with the quantiser's region before the store and with the quantisation inside
    the store's launch (``SGLANG_DSV4_KV_FUSED_WRITE``): the bytes of the torch quantiser and
    store for every kind of value (zeros of both signs, e4m3 subnormals and rounding ties, tiles
    under the amax floor, QAT'ed rows), in pool pages and a ring's strided slice."""
    assert triton_interpreted(_CASES) == 0


_MODEL = """
import torch
from sglang_dsv4.checkpoint import load_checkpoint
from sglang_dsv4.core.model import V4Model
from sglang_dsv4.kernels import kv_store
from sglang_dsv4.srt.state import SglangV4Cache
ckpt = load_checkpoint(MICRO)
cfg = ckpt.config
ids = torch.randint(0, cfg.vocab_size, (160,), generator=torch.Generator().manual_seed(1))
res = {}
for fused in (False, True):
    kv_store.FUSED_WRITE = fused
    model = V4Model(cfg, dict(ckpt.tensors))
    cache = SglangV4Cache.with_own_table(cfg, 3, 512, max_seq_len=160, backend="torch-fp8")
    cache.req_to_token[0, :130] = torch.arange(1, 131, dtype=torch.int32)
    cache.req_to_token[1, :20] = torch.arange(131, 151, dtype=torch.int32)
    a, b = cache.bind(0, 1, 0), cache.bind(1, 1, 0)
    out = model.forward(cache, [a, b], [ids[:130], ids[130:150]])  # a completes a ratio-128 group
    for t in range(2):
        cache.req_to_token[0, 130 + t] = 151 + 2 * t
        cache.req_to_token[1, 20 + t] = 152 + 2 * t
        out += model.forward(cache, [a, b], [ids[t:t + 1], ids[t + 1:t + 2]])
    scratch = cache.layout.scratch_slot(cache.slot_state)
    # the scratch slot and rows take every discarded write (the last of several wins): left out
    res[fused] = [torch.cat(out)] + [t[:scratch].clone() for t in cache.slot_state.values()] + [
        p.read(name, torch.arange(p.capacity)) for p in cache.pools.values() for name in p.tensors]
print("WORST", sum(int(not torch.equal(x, y)) for x, y in zip(res[False], res[True])))
"""


def test_the_fused_write_serves_the_model_as_the_quantiser_and_store_do(triton_interpreted, micro_dir):
    """The micro model over the serving cache with FlashMLA's layout (prefill, a completed
    ratio-128 group, decode steps; every Triton kernel interpreted): with the KV rows quantised
    in their store's launch, the same logits, rings, compressor states and entry rows, bit for bit."""
    assert triton_interpreted(_MODEL.replace("MICRO", repr(str(micro_dir)))) == 0


def test_the_fused_write_takes_the_kernels_layouts_only(monkeypatch):
    from sglang_dsv4.kernels.kv_layout import V4Fp8Rows

    monkeypatch.setattr(kv_store, "FUSED_WRITE", True)
    assert V4Fp8Rows(64).fused_write()
    assert not V4Fp8Rows(4, nope=64, rope=32, rope_dtype=torch.float32).fused_write()  # fp32 rope: the torch pack
    monkeypatch.setattr(kv_store, "FUSED_WRITE", False)
    assert not V4Fp8Rows(64).fused_write()
    with pytest.raises(ValueError, match="width"):
        kv_store.quantise_store_v4(torch.zeros(2, 64, dtype=torch.uint8), torch.zeros(1, dtype=torch.long),
                                   torch.zeros(1, dtype=torch.long), torch.zeros(1, 500), 448, 64, 64, 576, 8)


def test_the_row_store_takes_byte_pages_on_a_device_only():
    pages = torch.zeros(4, 64, dtype=torch.uint8)
    assert kv_store.supported(pages) == triton_support.INTERPRET  # CPU pages: the torch store
    assert not kv_store.supported(pages.view(4, 2, 32)) and not kv_store.supported(pages.float())
    with pytest.raises(ValueError, match="segments"):
        kv_store.store_row_bytes(pages, torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), [])
    with pytest.raises(ValueError, match="not uint8"):
        kv_store.store_row_bytes(pages, torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                                 [(torch.zeros(1, 8), 0, 8)])
