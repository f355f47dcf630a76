"""Weight bytes one TP/EP rank holds on the GPU, per weight mode (issue 12, accounting).

Modes (how the GPU keeps the checkpoint's matrices; v4_architecture.md §6.4):

- ``bf16``: today's path; every matrix dequantised to bf16 (2 B/param), the rest in the
  activations' dtype, fp32 (``core.model.weight_dtypes``);
- ``fp8``: matrices the checkpoint stores in fp8 stay e4m3 (1 B/param) with one scale per
  128x128 block (counted as its e8m0 byte; the GPU keeps it as float32 for the kernel, 3 B more
  per 16384 values, < 0.02%), except ``attn.wo_a``, dequantised to bf16 (a grouped einsum, as
  DeepSeek's convert.py and upstream without DeepGEMM run it; ``kernels.weight_mode``) unless
  ``SGLANG_DSV4_WO_A_FP8=1`` keeps it fp8 (``checkpoint.loader.keeps_fp8``); routed fp4
  experts are converted losslessly to fp8 block-128 (2x their fp4 bytes);
- ``w4a16``: dense matrices as in ``fp8``; routed fp4 experts stay e2m1 (0.5 B/param) with one e8m0
  byte per 32 inputs (Marlin / FlashInfer W4A16).

In every mode, matrices the checkpoint stores in bf16 (embedding, head, compressor and indexer
projections) stay bf16, non-matrix tensors (norms, router, hyper-connection mixers, ape, sink,
bias) take fp32 as ``weight_dtypes`` gives them, and ``tid2eid`` stays int64.

Which tensors a rank holds, and their local shapes, come from ``core.parallel.TensorSharder``
itself, applied to meta tensors (no data). One thing the sharder does not cover: on more than one
rank ``srt.model`` loads SGLang's vocab-parallel ``lm_head`` (this rank's rows of the padded vocab)
and drops the core's full ``head.weight``, so a rank counts its ``lm_head`` shard instead.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from .checkpoint.loader import keeps_fp8
from .checkpoint.schema import Storage, TensorSpec, checkpoint_tensors
from .config import V4Config
from .core.model import weight_dtypes
from .core.parallel import TensorSharder
from .quant import FP4_WEIGHT_BLOCK, FP8_WEIGHT_BLOCK

MODES = ("bf16", "fp8", "w4a16")
CATEGORIES = ("dense", "experts", "embed_head", "other")
SGLANG_VOCAB_PADDING = 64  # sglang vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE

_EMBED_HEAD = ("embed.weight", "head.weight")


@dataclass(frozen=True)
class WeightBytes:
    """One rank's weight bytes in one mode, by category."""

    mode: str
    tp_size: int
    ep_size: int
    dense: int       # attention, shared-expert, compressor / indexer, MTP projection matrices
    experts: int     # this rank's routed experts
    embed_head: int  # embedding and the head (one rank: the core's; several: the lm_head shard)
    other: int       # norms, router, hyper-connections, ape, sink, bias, tid2eid

    @property
    def total(self) -> int:
        return self.dense + self.experts + self.embed_head + self.other

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "total": self.total, "total_gib": round(self.total / 2**30, 2)}


def _is_expert(name: str) -> bool:
    return ".ffn.experts." in name


def category(spec: TensorSpec) -> str:
    """The breakdown category of ``spec`` (one of ``CATEGORIES``)."""
    if spec.name in _EMBED_HEAD:
        return "embed_head"
    if _is_expert(spec.name):
        return "experts"
    if spec.storage is not Storage.INT64 and _is_matrix(spec.name):
        return "dense"
    return "other"


# weight_dtypes decides which tensors are GEMM matrices (they take the matmul dtype)
_MATRIX_DTYPE = torch.bfloat16
_dtype_of = weight_dtypes(_MATRIX_DTYPE, torch.float32)


def _is_matrix(name: str) -> bool:
    return _dtype_of(name) is _MATRIX_DTYPE


def _fp8_block_bytes(out_dim: int, in_dim: int) -> int:
    """e4m3 values + one e8m0 scale byte per 128x128 block."""
    return out_dim * in_dim + math.ceil(out_dim / FP8_WEIGHT_BLOCK) * math.ceil(in_dim / FP8_WEIGHT_BLOCK)


def _fp4_bytes(out_dim: int, in_dim: int) -> int:
    """Two e2m1 codes per byte + one e8m0 scale byte per 32 inputs."""
    return out_dim * in_dim // 2 + out_dim * math.ceil(in_dim / FP4_WEIGHT_BLOCK)


def tensor_bytes(spec: TensorSpec, shape: tuple[int, ...], mode: str, cfg: V4Config) -> int:
    """Bytes of ``spec`` held with local ``shape`` (a rank's shard of it) in ``mode``: quantised
    where the loader keeps it so (``checkpoint.loader.keeps_fp8``)."""
    n = math.prod(shape)
    if spec.storage is Storage.INT64:
        return n * 8
    if not _is_matrix(spec.name):
        return n * 4  # the activations' dtype (weight_dtypes' default), in every mode
    if mode == "bf16" or spec.storage is Storage.BF16 or (spec.storage is Storage.FP8 and not keeps_fp8(spec, cfg)):
        return n * 2
    if spec.storage is Storage.FP8:
        return _fp8_block_bytes(*shape)
    if spec.storage is Storage.FP4:
        # fp8 mode: the lossless fp4 -> fp8 block-128 conversion; w4a16 keeps the checkpoint's fp4
        return _fp8_block_bytes(*shape) if mode == "fp8" else _fp4_bytes(*shape)
    raise ValueError(f"storage: no weight-mode rule for {spec.name} stored as {spec.storage.value}")


def lm_head_rows(vocab_size: int, tp_size: int) -> int:
    """Rows of SGLang's ``ParallelLMHead`` on one TP rank: the vocab padded to 64 (to 64 * tp when
    that does not split evenly; sglang vocab_parallel_embedding.py, ``VocabParallelEmbedding``)."""
    padding = SGLANG_VOCAB_PADDING
    padded = math.ceil(vocab_size / padding) * padding
    if padded % tp_size:
        padding *= tp_size
        padded = math.ceil(vocab_size / padding) * padding
    return padded // tp_size


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode: unknown weight mode {mode!r} (known: {', '.join(MODES)})")


def rank_tensors(cfg: V4Config, mode: str, tp_size: int = 1, ep_size: int = 1, tp_rank: int = 0,
                 ep_rank: int = 0) -> Iterator[tuple[str, str, int]]:
    """(name, category, bytes) of every tensor rank (tp_rank, ep_rank) holds in ``mode``; the
    vocab-parallel head shard appears as ``lm_head.weight``. Raises ConfigError on a split the
    config does not allow (``V4Config.validate_parallel``)."""
    check_mode(mode)
    sharder = TensorSharder(cfg, tp_rank, tp_size, ep_rank, ep_size)  # validates the split
    parallel = tp_size > 1 or ep_size > 1
    for spec in checkpoint_tensors(cfg):
        if not sharder.holds(spec.name) or (parallel and spec.name == "head.weight"):
            continue
        # the sharder's own slicing rules, on a meta tensor: the local shape without any data
        local = sharder(spec.name, torch.empty(spec.shape, device="meta"))
        yield spec.name, category(spec), tensor_bytes(spec, tuple(local.shape), mode, cfg)
    if parallel:
        # srt.model: with model parallelism, SGLang's lm_head takes this rank's vocab rows, in the
        # GEMM dtype (bf16), and the core's full head is dropped
        yield "lm_head.weight", "embed_head", lm_head_rows(cfg.vocab_size, tp_size) * cfg.hidden_size * 2


def weight_bytes(cfg: V4Config, mode: str, tp_size: int = 1, ep_size: int = 1, tp_rank: int = 0,
                 ep_rank: int = 0) -> WeightBytes:
    """Weight bytes of one rank (by default rank 0; every rank holds the same amount, the splits
    being even) of a ``tp_size`` x ``ep_size`` split of ``cfg`` in ``mode`` (one of ``MODES``)."""
    sums = dict.fromkeys(CATEGORIES, 0)
    for _, cat, nbytes in rank_tensors(cfg, mode, tp_size, ep_size, tp_rank, ep_rank):
        sums[cat] += nbytes
    return WeightBytes(mode, tp_size, ep_size, **sums)


def checkpoint_bytes(cfg: V4Config) -> int:
    """Bytes of the checkpoint's stored tensors (weights and scales, as ``TensorSpec.stored_shapes``
    gives them): e4m3 / e8m0 / packed fp4 1 B, bf16 2 B, fp32 4 B, int64 8 B per element."""
    size = {Storage.FP8: 1, Storage.FP4: 1, Storage.BF16: 2, Storage.FP32: 4, Storage.INT64: 8}
    return sum(math.prod(shape) * size[spec.storage]
               for spec in checkpoint_tensors(cfg) for shape in spec.stored_shapes().values())


def all_modes(cfg: V4Config, tp_size: int = 1, ep_size: int = 1) -> dict[str, dict[str, Any]]:
    """``{mode: weight_bytes(cfg, mode, tp_size, ep_size).to_dict()}`` for every mode."""
    return {mode: weight_bytes(cfg, mode, tp_size, ep_size).to_dict() for mode in MODES}


__all__ = ["MODES", "CATEGORIES", "WeightBytes", "weight_bytes", "rank_tensors", "tensor_bytes",
           "lm_head_rows", "checkpoint_bytes", "all_modes"]
