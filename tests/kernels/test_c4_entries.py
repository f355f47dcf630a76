"""``kernels.c4_entries``: a ratio-4 compressor's entries in two launches give the torch region's
(``ops.c4_entries_torch``), interpreted on the CPU: main and indexer compressors at micro widths
(d 80: a width past a power of two) and V4-Flash's (512 / 128), quantisation simulated and not,
several requests mixing decode tokens, short chunks (whose state writes overwrite rows other
tokens' windows read) and long ones, windows reaching back before position 0 (padding rows),
tokens whose rows go to the scratch slot, a strided chunk; float32 rows, and the GEMMs' bf16 rows
with their position bias added by the kernels. The states after the call are the
region's bit for bit; the entries within float rounding (the interpreter's exp and sums are
numpy's), and after QAT the same codes but where a value lies within rounding of a boundary.
With the switch off ``ops.c4_entries`` runs the torch region."""

from __future__ import annotations

import torch

from sglang_dsv4.core import ops
from sglang_dsv4.kernels import c4_entries as c4_entries_kernel

# a kernel of the quantisers alone (triton.jit reads its source from a file: the script writes it)
_PROBE = '''
import triton
import triton.language as tl
from sglang_dsv4.kernels.c4_entries_triton import FP4_FLOOR, FP8_FLOOR, _qat_blocks


@triton.jit
def qat(X, Y, BLOCKS: tl.constexpr, SIZE: tl.constexpr, FP8: tl.constexpr):
    off = tl.arange(0, BLOCKS)[:, None] * SIZE + tl.arange(0, SIZE)[None, :]
    x = tl.load(X + off)
    if FP8:
        tl.store(Y + off, _qat_blocks(x, 448.0, FP8_FLOOR, 3, -6))
    else:
        tl.store(Y + off, _qat_blocks(x, 6.0, FP4_FLOOR, 1, 0))
'''

_CASES = "PROBE = " + repr(_PROBE) + """
import torch
from sglang_dsv4.core import ops
from sglang_dsv4.core.model import _c4_window_rows_of
from sglang_dsv4.kernels import c4_entries as kernel
from sglang_dsv4.tiny import preset_config
kernel.ENABLED = True  # opt-in
g = torch.Generator().manual_seed(0)
worst_plain, worst_step, mismatched, total = 0.0, 0.0, 0, 0
for preset, chunks in (("micro", [(0, 3), (9, 1), (30, 12), (5, 20)]),
                       ("tiny", [(100, 1), (2, 1), (41, 5), (7, 1), (0, 9), (64, 16), (13, 2)])):
    cfg = preset_config(preset)
    freqs = ops.layer_inv_freqs(cfg, 4)
    B, n_slots = len(chunks), len(chunks) + 3
    slots = torch.randperm(n_slots - 1, generator=g)[:B]  # the scratch slot: the last
    positions = torch.cat([torch.arange(p0, p0 + n) for p0, n in chunks])
    tok_req = torch.cat([torch.full((n,), b) for b, (_, n) in enumerate(chunks)])
    starts = torch.tensor([p0 for p0, _ in chunks])
    ends = torch.tensor([p0 + n for p0, n in chunks])
    row0 = torch.cumsum(torch.tensor([0] + [n for _, n in chunks]), 0)[:-1]
    idx, dst = _c4_window_rows_of(positions, tok_req, starts, ends, row0, slots, n_slots - 1)
    rope = ops.rope_at(positions - 3, freqs)
    T = positions.shape[0]
    for kind, d in (("main", cfg.head_dim), ("index", cfg.index_head_dim)):
        prefix = "attn.compressor" if kind == "main" else "attn.indexer.compressor"
        w = {f"{prefix}.norm.weight": torch.rand(d, generator=g) + 0.5}
        wide = torch.randn(T, 3 * d, generator=g) * 2
        a = wide[:, :2 * d]  # a strided view, as a column slice of stacked projections
        s = torch.randn(T, 2 * d, generator=g) * 3
        state_a = torch.randn(n_slots, 2, 8, 2 * d, generator=g)[:, 1]  # a layer's view
        state_s = torch.randn(n_slots, 2, 8, 2 * d, generator=g)[:, 1] * 3
        for quant in (False, True):
            assert kernel.supported(a, s, state_a, state_s, idx, rope, cfg, kind == "index")
            sa, ss = state_a.clone(), state_s.clone()
            want = ops.c4_entries_torch(a, s, sa, ss, slots, idx, dst, w, prefix, rope, cfg, kind == "index", quant)
            ka, ks = state_a.clone(), state_s.clone()
            got = ops.c4_entries(a, s, ka, ks, slots, idx, dst, w, prefix, rope, cfg, kind == "index", quant)
            assert got.shape == want.shape and got.dtype == want.dtype == torch.float32
            # the states bit for bit, the scratch slot aside (its rows' writer order is no one's)
            if not (torch.equal(ka[:-1], sa[:-1]) and torch.equal(ks[:-1], ss[:-1])):
                worst_plain = float("inf")
            scale = want.abs().amax(-1, keepdim=True)
            err = (got - want).abs() / scale
            if not quant:
                worst_plain = max(worst_plain, float(err.max()))
                continue
            # QAT: the same values but where one lies within rounding of a boundary: then a step
            # of its format apart (an fp8 step <= 2^-3 of its value, an fp4 one <= 1/2 of the
            # block's scale 6 * 2^e >= amax: relative to the row's scale, 1/8 and 1/2 at most)
            coded = d if kind == "index" else cfg.nope_head_dim  # main: the rope dims stay floats
            worst_plain = max(worst_plain, float(err[:, coded:].max()) if coded < d else 0.0)
            diff = got[:, :coded] != want[:, :coded]
            mismatched += int(diff.sum())
            total += diff.numel()
            worst_step = max(worst_step, float(err[:, :coded].max()))
        # the GEMMs' bf16 rows with the position bias still to add (ops.compressor_gemms): the
        # kernels widen them and add the bias on load; the states take the region's bits
        ape = torch.randn(4, 2 * d, generator=g)
        a16, s16 = a.bfloat16(), s.bfloat16()
        assert kernel.supported(a16, s16, state_a, state_s, idx, rope, cfg, kind == "index", ape, positions)
        assert not kernel.supported(a16, s16, state_a, state_s, idx, rope, cfg, kind == "index")  # bf16 needs it
        w[f"{prefix}.ape"] = ape
        sa, ss = state_a.clone(), state_s.clone()
        want = ops.c4_entries_torch(a16, s16, sa, ss, slots, idx, dst, w, prefix, rope, cfg, kind == "index", False,
                                    positions)
        sa2, ss2 = state_a.clone(), state_s.clone()
        biased = ops.with_position_bias(s16, ape, positions, torch.float32)
        plain = ops.c4_entries_torch(a16.float(), biased, sa2, ss2, slots, idx, dst, w, prefix, rope, cfg,
                                     kind == "index", False)
        if not (torch.equal(want, plain) and torch.equal(sa[:-1], sa2[:-1]) and torch.equal(ss[:-1], ss2[:-1])):
            worst_plain = float("inf")
        ka, ks = state_a.clone(), state_s.clone()
        got = ops.c4_entries(a16, s16, ka, ks, slots, idx, dst, w, prefix, rope, cfg, kind == "index", False,
                             positions)
        if not (torch.equal(ka[:-1], sa[:-1]) and torch.equal(ks[:-1], ss[:-1])):
            worst_plain = float("inf")
        worst_plain = max(worst_plain, float(((got - want).abs() / want.abs().amax(-1, keepdim=True)).max()))
print("mismatched", mismatched, "of", total, "worst step", worst_step)

# the quantisers alone, bit for bit against quant.fp8_qat / fp4_qat: ties of both formats (to even),
# e4m3 subnormals, amax below the floors and at a power of two times the format's maximum
import importlib.util, pathlib, tempfile
from sglang_dsv4.quant import fp4_qat, fp8_qat
probe = pathlib.Path(tempfile.mkdtemp()) / "c4_qat_probe.py"
probe.write_text(PROBE)
spec = importlib.util.spec_from_file_location("c4_qat_probe", probe)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
for size, ref, grid_max, fp8 in ((64, fp8_qat, 448.0, True), (32, fp4_qat, 6.0, False)):
    x = torch.randn(64, size, generator=g) * torch.exp2(torch.randint(-30, 30, (64, 1), generator=g).float())
    x[0] = torch.tensor([1.0625, 1.1875, -1.0625, 2.0**-10, 3 * 2.0**-10, -(2.0**-10), 0.0, -0.0] * (size // 8))
    x[0, 0] = grid_max  # scale 1: the rest are ties (of e4m3, its subnormals too)
    x[1] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0] * (size // 8))  # e2m1 ties
    x[1, 0] = 6.0
    x[2] = 1e-6  # below the floors
    x[3, 0] = grid_max * 2.0**12
    y = torch.empty_like(x)
    mod.qat[(1,)](x, y, 64, size, fp8)
    want = ref(x, size)
    if not torch.equal(y, want):
        print("qat", size, int((y != want).sum()))
        worst_plain = float("inf")
if mismatched > 1e-3 * total or worst_step > 0.5:
    worst_plain = float("inf")
print("WORST", worst_plain)
"""


def test_the_kernel_gives_the_torch_regions_entries_and_states(triton_interpreted):
    assert triton_interpreted(_CASES) < 2e-6


def test_the_switch_off_keeps_the_torch_region(monkeypatch):
    from sglang_dsv4.core.model import _c4_window_rows_of
    from sglang_dsv4.tiny import preset_config

    cfg = preset_config("micro")
    d, T = cfg.index_head_dim, 2
    a, s = torch.randn(T, 2 * d), torch.randn(T, 2 * d)
    state_a, state_s = torch.zeros(3, 8, 2 * d), torch.zeros(3, 8, 2 * d)
    slots = torch.tensor([0])
    idx, dst = _c4_window_rows_of(torch.arange(T), torch.zeros(T, dtype=torch.long), torch.tensor([0]),
                                  torch.tensor([T]), torch.tensor([0]), slots, 2)
    rope = ops.rope_at(torch.tensor([-3, -2]), ops.layer_inv_freqs(cfg, 4))
    w = {"p.norm.weight": torch.ones(d)}

    def refuse(*args, **kwargs):
        raise AssertionError("the kernel ran")

    monkeypatch.setattr(c4_entries_kernel, "c4_entries", refuse)
    monkeypatch.setattr(c4_entries_kernel, "ENABLED", False)
    assert not c4_entries_kernel.supported(a, s, state_a, state_s, idx, rope, cfg, True)
    got = ops.c4_entries(a, s, state_a, state_s, slots, idx, dst, w, "p", rope, cfg, True, True)
    sa, ss = torch.zeros(3, 8, 2 * d), torch.zeros(3, 8, 2 * d)
    want = ops.c4_entries_torch(a, s, sa, ss, slots, idx, dst, w, "p", rope, cfg, True, True)
    assert torch.equal(got, want) and torch.equal(state_a, sa) and torch.equal(state_s, ss)
    assert torch.equal(state_a[0, :2], a)
    # switched on, CPU tensors outside the interpreter still take the region; shapes it cannot hold too
    monkeypatch.setattr(c4_entries_kernel, "ENABLED", True)
    from sglang_dsv4.kernels import triton_support

    assert c4_entries_kernel.supported(a, s, state_a, state_s, idx, rope, cfg, True) == triton_support.INTERPRET
    assert not c4_entries_kernel.supported(a.double(), s.double(), state_a.double(), state_s.double(), idx, rope,
                                           cfg, True)
    assert not c4_entries_kernel.supported(a, s, state_a, state_s, idx[:, :4], rope, cfg, True)
    assert not c4_entries_kernel._dims_ok(96, 16, 0, True)      # the indexer's Hadamard: a power of two
    assert not c4_entries_kernel._dims_ok(80, 16, 48, False)    # FP8 blocks of 64
    assert c4_entries_kernel._dims_ok(80, 16, 64, False) and c4_entries_kernel._dims_ok(512, 64, 448, False)
