"""FP8 block-128 matrices on the GPU: the weight type, V4's activation quantisation, the GEMM.

- ``Fp8Weight``: a matrix (or a stack of expert matrices) as the checkpoint stores it, e4m3
  values with one power-of-two scale per 128x128 block (kept as float32 for the kernel).
- ``quantize_act``: V4's runtime activation quantisation (v4_architecture.md §6.4, [REF]
  ``act_quant`` with ``scale_fmt = "ue8m0"``): e4m3 in groups of 128 along K, scale
  ``2^ceil(log2(max(amax, 1e-4) / 448))``. Pure torch: fixed shapes, no host sync.
- ``fp8_gemm``: C = dequant(A) @ dequant(B).T with per-row-group A scales and 128x128 B scales,
  one Triton kernel. Its inner loop is that of SGLang 0.5.23's ``_w8a8_block_fp8_matmul``
  (``sglang/kernels/ops/gemm/fp8_kernel.py``, Apache-2.0), with two additions used by the
  routed experts (``fp8_moe``): rows of A gathered through a row table, and one expert's B per
  block of rows (the ``expert_ids`` of SGLang's fused MoE). SGLang's own wrapper is not called:
  its module imports ``sglang.srt`` (deep_gemm wrapper, platform context), which the core does
  not need and the GPU image running the core does not have.
- ``fp8_linear``: ``x @ dequant(w).T`` with x quantised as above; on a CPU the torch reference
  (``fp8_linear_reference``), which is what the kernel computes up to fp32 summation order.
(``attn.wo_a``, held fp8 with ``GROUPED_WO_A``, has a weight-only kernel of its own:
``fp8_weight_only``.)

Everything is CUDA-graph capturable: launch grids and configs depend only on shapes.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from ..core.compiled import on_gpu
from ..quant import FP8_MAX, FP8_WEIGHT_BLOCK, dequantize_fp8_blockwise, pow2_scale
from . import fp8_cublas
from .triton_support import INTERPRET, pdl_options  # INTERPRET: a module attribute here, tests switch it off

Tensor = torch.Tensor
# attn.wo_a held fp8 in the fp8 weight mode and run by ``fp8_weight_only.grouped_weight_only_linear``
# (read by the loader: ``checkpoint.loader.keeps_fp8``). Its bf16 einsum reads twice the
# checkpoint's bytes: 30.5 us a layer at batch 64 on an H100 (session 41's flash43 census), against
# 11.2 us for its fp8 bytes. Opt-in: the weight-only kernel is level with the einsum at 1 token
# and 0.69x at 64 (H100, session 42).
GROUPED_WO_A = os.environ.get("SGLANG_DSV4_WO_A_FP8", "0") == "1"
# An activation read by several fp8 GEMMs quantised once, by the kernel or region that makes it
# (``Fp8Act``): the sublayer inputs by the boundary kernel (``hc_boundary.post_pre``), qr by
# ``ops.project_q`` for wq_b and the indexer's wq_b. Read per call. On by default since session 40
# (H100: the bytes equal the quantiser's compiled; tiny and flash4 fp8 models' prefill and decode
# logits the bits without it; graph replay equals eager, no host sync; flash43's batch-64 step
# 17.63 -> 17.17 ms, flash8's 6.10 -> 6.08). ``SGLANG_DSV4_FP8_OPERANDS=0``: each GEMM quantises.
SHARED_OPERANDS = os.environ.get("SGLANG_DSV4_FP8_OPERANDS", "1") == "1"
ACT_GROUP = 128          # activation quantisation group along K (= the weight block)
ACT_AMAX_FLOOR = 1e-4    # [REF] act_quant's amax clamp


@dataclass(frozen=True)
class Fp8Weight:
    """e4m3 values ``q`` [..., N, K] and float32 power-of-two block scales ``scale``
    [..., ceil(N/128), ceil(K/128)]: the matrix is ``q * scale[n // 128, k // 128]``."""

    q: Tensor
    scale: Tensor

    def __post_init__(self) -> None:
        if self.q.dtype != torch.float8_e4m3fn:
            raise TypeError(f"Fp8Weight values must be float8_e4m3fn, got {self.q.dtype}")
        want = tuple(self.q.shape[:-2]) + tuple(math.ceil(d / FP8_WEIGHT_BLOCK) for d in self.q.shape[-2:])
        if tuple(self.scale.shape) != want:
            raise ValueError(f"Fp8Weight scale shape {list(self.scale.shape)} does not match values "
                             f"{list(self.q.shape)} (expected {list(want)})")

    @classmethod
    def from_checkpoint(cls, q: Tensor, scale: Tensor) -> "Fp8Weight":
        """From the stored e4m3 values and e8m0 scales (scales widened to float32: exact)."""
        return cls(q.contiguous(), scale.float().contiguous())

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scale.numel() * self.scale.element_size()

    def to(self, device) -> "Fp8Weight":
        return Fp8Weight(self.q.to(device), self.scale.to(device))

    def sliced(self, rule: Callable[[Tensor], Tensor | None]) -> "Fp8Weight | None":
        """This matrix cut by ``rule`` (a slice of a [N, K] tensor, e.g. a tensor-parallel rank's
        rows or columns; None: the rank holds none of it). The scales are cut by the same rule,
        applied to a map of block ids, so the cut must fall on 128x128 block boundaries
        (ValueError otherwise)."""
        q = rule(self.q)
        if q is None or q is self.q:
            return None if q is None else self
        B = FP8_WEIGHT_BLOCK
        nb_o, nb_i = self.scale.shape
        ids = torch.arange(nb_o * nb_i, dtype=torch.int32, device=self.q.device).view(nb_o, nb_i)
        full = ids.repeat_interleave(B, 0).repeat_interleave(B, 1)[:self.q.shape[0], :self.q.shape[1]]
        cut = rule(full)
        blocks = cut[::B, ::B]
        back = blocks.repeat_interleave(B, 0).repeat_interleave(B, 1)[:cut.shape[0], :cut.shape[1]]
        if tuple(cut.shape) != tuple(q.shape) or not torch.equal(back, cut):
            raise ValueError(f"the slice {list(q.shape)} of a {list(self.q.shape)} fp8 matrix does not fall on "
                             f"{B}x{B} scale-block boundaries")
        return Fp8Weight(q.contiguous(), self.scale.flatten()[blocks.long()].contiguous())

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        if self.q.dim() == 2:
            return dequantize_fp8_blockwise(self.q, self.scale).to(dtype)
        flat_q, flat_s = self.q.reshape(-1, *self.q.shape[-2:]), self.scale.reshape(-1, *self.scale.shape[-2:])
        return torch.stack([dequantize_fp8_blockwise(q, s) for q, s in zip(flat_q, flat_s)]).view(
            self.q.shape).to(dtype)


def weight_nbytes(t) -> int:
    """Bytes held by a weight entry (a tensor or an ``Fp8Weight``)."""
    if isinstance(t, Fp8Weight):
        return t.nbytes
    return t.numel() * t.element_size()


# ---- activation quantisation -----------------------------------------------------------------
class Fp8Act(NamedTuple):
    """An activation's fp8 GEMM operands, ``quantize_act``'s (q, scales), computed by the kernel
    that produced the activation (``hc_boundary``'s launch 2 quantises the sublayer input it
    writes): the GEMMs that read it then launch no quantiser of their own."""

    q: Tensor
    s: Tensor


@on_gpu(rows={"x": (0,)})
def quantize_act(x: Tensor, group: int = ACT_GROUP) -> tuple[Tensor, Tensor]:
    """x [M, K] -> (e4m3 [M, Kp], float32 scales [M, Kp / group]), Kp = K rounded up to ``group``
    (zero padding). Scale per group: 2^ceil(log2(max(amax, 1e-4) / 448)). One fused region on
    the GPU where the caller is not one already (``core.compiled``)."""
    M, K = x.shape
    Kp = math.ceil(K / group) * group
    xf = x.float()
    if Kp != K:
        xf = F.pad(xf, (0, Kp - K))
    xb = xf.view(M, Kp // group, group)
    amax = xb.abs().amax(-1).clamp_min(ACT_AMAX_FLOOR)
    scale = pow2_scale(amax, FP8_MAX)
    q = (xb / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(M, Kp), scale


def dequantize_act(q: Tensor, scale: Tensor, k: int, group: int = ACT_GROUP) -> Tensor:
    """Inverse of ``quantize_act``, float32 [M, k]."""
    M = q.shape[0]
    return (q.float().view(M, -1, group) * scale.unsqueeze(-1)).view(M, -1)[:, :k]


def qdq_act(x: Tensor) -> Tensor:
    """x after V4's activation quantise-dequantise (float32)."""
    q, s = quantize_act(x)
    return dequantize_act(q, s, x.shape[1])


# ---- the GEMM --------------------------------------------------------------------------------

def triton_missing() -> str | None:
    """Why the Triton kernel cannot run here (None: it can)."""
    try:
        from . import fp8_triton  # noqa: F401
    except Exception as e:  # ImportError, or triton failing to initialise
        return f"triton is not importable ({type(e).__name__}: {e})"
    return None


def _config(M: int, N: int, block_m: int | None, experts: int = 0) -> dict[str, int]:
    """The tile launch of an [M, N] GEMM: dense (``experts`` 0) or grouped over ``experts`` weight
    matrices in blocks of ``block_m`` rows. Shapes only (CUDA graphs)."""
    if experts and block_m == 16:
        # the routed experts at decode sizes: 64-column tiles, 4 stages. Graph-timed on an H200
        # against the dense rule below (benchmarks/bench_fp8_gemm.py, session 12): w13 / w2 1.27x /
        # 1.43x at 1 token (32 experts), 1.19x / 1.39x (8 experts), 1.05x / 1.04x at 64 tokens
        # (32 experts), the best of 36 tile configurations in those cases
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=FP8_WEIGHT_BLOCK, GROUP_M=8, num_warps=4, num_stages=4)
    if experts and block_m == 64:
        # 64-row expert blocks, 4 warps, 4 stages; 64 columns where an expert's rows fill about one
        # block (its weights read by one row block: more, narrower programs stream them), 128 where
        # they fill several (row blocks of one expert share its weight tiles through the L2).
        # H100, bench_fp8_gemm --all (session 38), against the dense rule below: w13 / w2 1.25x /
        # 1.26x at 8 experts and 64 tokens (48 pairs an expert), 1.09x / 1.21x at 32 experts and
        # 256 tokens (48), 1.04x / 1.00x at 8 experts and 256 tokens (192, 128 columns; 64
        # columns there 0.82x / 0.83x), the best of 18 tiles in each case
        block_n = 64 if M < 2 * block_m * experts else 128
        return dict(BLOCK_M=64, BLOCK_N=block_n, BLOCK_K=FP8_WEIGHT_BLOCK, GROUP_M=8, num_warps=4, num_stages=4)
    if block_m is None:
        block_m = 16 if M <= 16 else 32 if M <= 32 else 64
    # few output tiles (a narrow matrix at a small batch): narrower tiles, more programs
    block_n = 64 if math.ceil(M / block_m) * math.ceil(N / 128) < 128 else 128
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=FP8_WEIGHT_BLOCK, GROUP_M=8, num_warps=4, num_stages=3)


SPLIT_K_WAVES = 2   # split K until the programs fill the SMs about twice
SPLIT_K_MIN_BLOCKS = 4  # K blocks a split program sums at least (its partial tile costs a write and a read)
INTERPRET_SMS = 132  # the SM count assumed by the interpreter (an H200's)
SPLIT_K_SUM_BLOCK = 1024


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """The SMs a launch on ``device`` fills (the interpreter's: ``INTERPRET_SMS``)."""
    if device.type != "cuda":
        return INTERPRET_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_k(tiles: int, k_blocks: int, sms: int) -> tuple[int, int]:
    """(splits, K blocks per split) for a GEMM of ``tiles`` output tiles over ``k_blocks`` K
    blocks: a decode-sized GEMM has too few tiles to keep an H200's 132 SMs streaming the weight
    (V4-Flash's wq_a at batch 1: 16 tiles of 64 columns), so K is cut until about
    ``SPLIT_K_WAVES`` waves of programs run, each summing at least ``SPLIT_K_MIN_BLOCKS`` blocks.
    Depends on shapes only (CUDA graphs; the deterministic mode's fixed tiles)."""
    want = min(math.ceil(SPLIT_K_WAVES * sms / tiles), k_blocks // SPLIT_K_MIN_BLOCKS)
    if want <= 1:
        return 1, k_blocks
    per = math.ceil(k_blocks / want)
    return math.ceil(k_blocks / per), per


def _plan(M: int, N: int, K: int, block_m: int | None, experts: int,
          device: torch.device) -> tuple[dict[str, int], int, int, int]:
    """A GEMM's launch, from shapes only: (tile config, output tiles, K splits, K blocks a split);
    ``experts``: the grouped GEMM's weight matrices (0: dense)."""
    cfg = _config(M, N, block_m, experts)
    tiles = -(-M // cfg["BLOCK_M"]) * -(-N // cfg["BLOCK_N"])
    splits, per = split_k(tiles, -(-K // cfg["BLOCK_K"]), sm_count(device))
    return cfg, tiles, splits, per


def runs_kernel(device: torch.device) -> bool:
    """Whether this module's Triton kernels run for tensors on ``device`` (CUDA, or the interpreter)."""
    return device.type == "cuda" or INTERPRET


@torch.compiler.disable  # eager callers; a compiled one reaches the launch through fp8_gemm_op (below)
def fp8_gemm(a_q: Tensor, a_s: Tensor, w: Fp8Weight, out_dtype: torch.dtype, rows: Tensor | None = None,
             block_expert: Tensor | None = None, block_m: int | None = None, m: int | None = None,
             sum_splits: bool = True, cublas: bool | None = None) -> Tensor:
    """[M, N] = (dequantised rows of A) @ dequant(w)^T in fp32, stored as ``out_dtype``.

    a_q [Ma, Kp] e4m3 and a_s [Ma, Kp/128] from ``quantize_act``; w [N, K] (or [E, N, K] with
    ``block_expert`` [M / block_m] int32: the expert of each block of ``block_m`` output rows,
    -1 = zeros). ``rows`` [M] int32 (-1 = a zero row) gathers A's rows; default row m = m.
    The Triton kernel on CUDA, ``fp8_gemm_reference`` elsewhere (the same result).
    ``sum_splits=False``: where K is split (``split_k``), the fp32 partial products [S, M, N]
    instead, for a compiled caller to add (``add_splits``) inside its own next kernel.
    ``cublas``: whether a dense GEMM goes to cuBLAS (``fp8_cublas``); None decides now
    (``fp8_cublas.planned``), a compiled caller passes what it decided when it was traced.
    """
    if not runs_kernel(a_q.device):
        return fp8_gemm_reference(a_q, a_s, w, out_dtype, rows, block_expert, block_m, m)
    from .fp8_triton import fp8_block_gemm_kernel

    grouped = block_expert is not None
    N, K = w.q.shape[-2:]
    M = m if m is not None else (rows.shape[0] if rows is not None else a_q.shape[0])
    if grouped and block_m is None:
        raise ValueError("fp8_gemm: a grouped GEMM needs the block_m its block_expert table was built for")
    if cublas is None:
        cublas = not grouped and rows is None and fp8_cublas.planned(M, N, K, a_q.device)
    if cublas:
        return fp8_cublas.block_scaled_mm(a_q[:M], a_s[:M], w.q, w.scale, out_dtype)
    c = torch.empty(M, N, dtype=out_dtype, device=a_q.device)
    if M == 0:
        return c
    wq = w.q if grouped else w.q.unsqueeze(0)
    ws = w.scale if grouped else w.scale.unsqueeze(0)
    cfg, tiles, splits, per = _plan(M, N, K, block_m, wq.shape[0] if grouped else 0, a_q.device)
    part = c if splits == 1 else torch.empty(splits, M, N, dtype=torch.float32, device=a_q.device)
    dummy = rows if rows is not None else (block_expert if grouped else c)
    fp8_block_gemm_kernel[(tiles, splits)](
        a_q, a_s, wq, ws, part, rows if rows is not None else dummy, block_expert if grouped else dummy,
        M, N, K, per,
        a_q.stride(0), a_s.stride(0), wq.stride(0), wq.stride(1), ws.stride(0), ws.stride(1), N, M * N,
        HAS_ROWS=rows is not None, GROUPED=grouped, **cfg, **pdl_options(a_q))
    if splits > 1:
        if not sum_splits:
            return part
        sum_splits_into(part, c)
    return c


# A compiled caller reaches the launch through this custom op rather than through the disabled
# function above: no graph break, so the region goes on around the GEMM (Inductor fuses the
# activation quantiser into its producer's kernel and ``add_splits`` into the consumer's). A
# graph break inside ``fp8_linear`` resumed there, in a frame of its own, so the split-K sum
# was a kernel of its own (59 a flash8 step, session 16's census).
@torch.library.custom_op("sglang_dsv4::fp8_gemm", mutates_args=())
def fp8_gemm_op(a_q: Tensor, a_s: Tensor, wq: Tensor, ws: Tensor, out_dtype: torch.dtype,
                rows: Tensor | None = None, block_expert: Tensor | None = None, block_m: int | None = None,
                m: int | None = None, sum_splits: bool = True, cublas: bool = False) -> Tensor:
    """``fp8_gemm`` with the weight as its two tensors (``Fp8Weight(wq, ws)``), as a torch op."""
    return fp8_gemm(a_q, a_s, Fp8Weight(wq, ws), out_dtype, rows, block_expert, block_m, m, sum_splits, cublas)


@fp8_gemm_op.register_fake
def _fp8_gemm_shape(a_q: Tensor, a_s: Tensor, wq: Tensor, ws: Tensor, out_dtype: torch.dtype,
                    rows: Tensor | None = None, block_expert: Tensor | None = None, block_m: int | None = None,
                    m: int | None = None, sum_splits: bool = True, cublas: bool = False) -> Tensor:
    """What ``fp8_gemm`` returns, from shapes: [M, N] in ``out_dtype``, or the fp32 partials
    [S, M, N] where the kernel splits K and ``sum_splits`` is False (not with ``cublas``)."""
    N, K = wq.shape[-2:]
    M = m if m is not None else (rows.shape[0] if rows is not None else a_q.shape[0])
    if M and runs_kernel(a_q.device) and not sum_splits and not cublas:
        splits = _plan(M, N, K, block_m, wq.shape[0] if block_expert is not None else 0, a_q.device)[2]
        if splits > 1:
            return a_q.new_empty(splits, M, N, dtype=torch.float32)
    return a_q.new_empty(M, N, dtype=out_dtype)


def sum_splits_into(part: Tensor, out: Tensor) -> None:
    """``split_k_sum_kernel``: the split-K partials [S, ...] added into ``out`` (their shape less
    the first dim) in split order, one launch."""
    from .fp8_triton import split_k_sum_kernel

    n = out.numel()
    split_k_sum_kernel[(-(-n // SPLIT_K_SUM_BLOCK),)](part, out, n, SPLIT_K=part.shape[0], BLOCK=SPLIT_K_SUM_BLOCK,
                                                       **pdl_options(out))


def add_splits(part: Tensor, out_dtype: torch.dtype) -> Tensor:
    """The split-K partials [S, M, N] -> [M, N] in ``out_dtype``, added in ``split_k_sum_kernel``'s
    order (P[0] + P[1] + ... in fp32: the same bits)."""
    return functools.reduce(torch.add, part.unbind(0)).to(out_dtype)


def fp8_gemm_reference(a_q: Tensor, a_s: Tensor, w: Fp8Weight, out_dtype: torch.dtype, rows: Tensor | None = None,
                       block_expert: Tensor | None = None, block_m: int | None = None, m: int | None = None,
                       sum_splits: bool = True) -> Tensor:
    """What ``fp8_gemm`` computes, in torch float32 (dequantise, then matmul; K is never split,
    so ``sum_splits`` changes nothing)."""
    N, K = w.q.shape[-2:]
    a = dequantize_act(a_q, a_s, K)
    M = m if m is not None else (rows.shape[0] if rows is not None else a_q.shape[0])
    if rows is not None:
        a = torch.cat((a, a.new_zeros(1, K)))[torch.where(rows >= 0, rows.long(), a.shape[0])]
    else:
        a = a[:M]
    if block_expert is None:
        return (a @ w.dequantize().t()).to(out_dtype)
    out = a.new_zeros(M, N)
    row_expert = block_expert.long().repeat_interleave(block_m)[:M]
    for e in range(w.q.shape[0]):
        sel = (row_expert == e).nonzero().flatten()
        if sel.numel():
            out[sel] = a[sel] @ Fp8Weight(w.q[e], w.scale[e]).dequantize().t()
    return out.to(out_dtype)


def prepare(device: torch.device) -> None:
    """Before a model's first fp8 GEMM on ``device``: unless ``SGLANG_DSV4_FP8_GEMM=triton``, decide
    once whether its dense GEMMs take cuBLAS (``fp8_cublas.check_device`` against this module's
    kernel). A no-op otherwise."""
    if fp8_cublas.REQUESTED and device.type == "cuda":
        fp8_cublas.check_device(device, lambda a_q, a_s, w_q, w_s: fp8_gemm(a_q, a_s, Fp8Weight(w_q, w_s),
                                                                            torch.float32))


def fp8_linear(x: Tensor, w: Fp8Weight, act: Fp8Act | None = None) -> Tensor:
    """x [M, K] @ dequant(w).T with x quantised as V4's QAT does (fp8 e4m3, groups of 128, ue8m0
    scales) -> [M, N] in x's dtype; ``act``: that quantisation computed already (``Fp8Act``).
    Traced inside a fused region (``core.compiled``), a split-K GEMM's partials are added by the
    region's next kernel: one launch fewer than the sum kernel."""
    q, s = quantize_act(x) if act is None else act
    if not torch.compiler.is_compiling():
        return fp8_gemm(q, s, w, x.dtype)
    if isinstance(x.shape[0], int):  # the op's output shape follows the launch's split
        # decided here, while tracing: Dynamo guards on the switch, and the op does what its fake said
        cublas = fp8_cublas.planned(x.shape[0], w.q.shape[0], w.q.shape[1], x.device)
        out = fp8_gemm_op(q, s, w.q, w.scale, x.dtype, sum_splits=False, cublas=cublas)
    else:  # symbolic rows (the generic mode): the launch decides, behind a graph break
        out = fp8_gemm(q, s, w, x.dtype, sum_splits=False)
    return out if out.dim() == 2 else add_splits(out, x.dtype)


def groups_fit(rows: int, cols: int, groups: int) -> bool:
    """Whether a [rows, cols] matrix cut into ``groups`` equal row groups keeps its 128x128 scale
    blocks whole: each group's rows and the columns a multiple of 128 (V4-Flash's wo_a: 8 groups
    of 1024 rows, 4096 columns)."""
    B = FP8_WEIGHT_BLOCK
    return rows % groups == 0 and (rows // groups) % B == 0 and cols % B == 0


def fp8_linear_reference(x: Tensor, w: Fp8Weight) -> Tensor:
    """The reference of ``fp8_linear``: qdq(x) @ dequant(w).T in float32."""
    return (qdq_act(x) @ w.dequantize().t()).to(x.dtype)


__all__ = ["SHARED_OPERANDS", "Fp8Act", "Fp8Weight", "weight_nbytes", "quantize_act",
           "dequantize_act", "qdq_act", "fp8_gemm", "fp8_gemm_op",
           "prepare",
           "fp8_gemm_reference", "fp8_linear", "fp8_linear_reference", "groups_fit",
           "GROUPED_WO_A", "ACT_GROUP", "triton_missing"]
