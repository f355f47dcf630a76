"""Tensor and expert parallelism of the V4 core over ``torch.distributed`` process groups.

A rank of a TP group of size ``tp`` and an EP group of size ``ep`` holds:
  - attention: query heads ``[r*H/tp, (r+1)*H/tp)``, i.e. their rows of ``wq_b``, their
    ``attn_sink`` entries and their output-projection groups (``wo_a`` rows and ``wo_b`` columns of
    groups ``[r*G/tp, (r+1)*G/tp)``: group g is heads g*H/G..(g+1)*H/G-1, so a rank's heads are
    whole groups). Its ``wo_b`` gives a partial [T, D] output; the all-reduce (sum) over the TP
    group completes it, as SGLang's ``RowParallelLinear`` does. The one KV head, ``wq_a``, the
    compressors, the indexer and therefore the whole cache (rings, compressor state, compressed
    entries) are replicated: every rank keeps its own identical ``V4Cache``.
  - MoE: routed experts ``[r*E/ep, (r+1)*E/ep)``. Routing (top-k or the hash layers' ``tid2eid``)
    is computed over all experts on every rank, each rank sums the contributions of its own experts
    for all tokens, and an all-reduce over the EP group adds them. The shared expert is replicated
    and added after the all-reduce, so it counts once.
  - everything else (embedding, hyper-connections, norms, head, MTP's projections) replicated.

The residual streams stay identical on all ranks (an all-reduce returns the same sum everywhere),
so every rank takes the same discrete decisions (indexer top-k, routing, FP8/FP4 bins).

The TP and EP groups may be the same group (SGLang runs EP over the TP ranks). No SGLang import:
``ModelParallel(None, None)`` is the single-process model.

Data-parallel attention (``ModelParallel.dp``, SGLang's ``--attn-dp-size``): each rank runs
attention (all heads, TP size 1) and keeps the cache for its own requests only; the MoE of each
layer runs over all ranks' tokens, gathered (``all_gather_into_tensor``, padded to the largest
rank's rows), each rank's experts applied to all of them, and the sums scattered back
(``reduce_scatter_tensor``). Ranks bring different steps, so every step starts with a small host
exchange of row counts (``DataParallelTokens.exchange``), and a rank with no step of its own (an
idle rank, or one whose step took fewer passes) joins the others' MoE collectives with zero rows
(``V4Model.serve_other_ranks``) until no rank has a step left.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ..config import V4Config
from ..kernels.fp8_linear import Fp8Weight
from . import ops
from .model import V4Model

Tensor = torch.Tensor
ProcessGroup = dist.ProcessGroup

_LAYER = re.compile(r"^(?:layers|mtp)\.\d+\.(.+)$")
_EXPERT = re.compile(r"^ffn\.experts\.(\d+)\.")


class DataParallelTokens:
    """The data-parallel attention ranks' token exchange (see the module docstring): ``group``
    carries the token rows (the device group, the EP group in SGLang), ``cpu_group`` the row
    counts (a gloo group)."""

    def __init__(self, group: ProcessGroup, cpu_group: ProcessGroup):
        self.group, self.cpu_group = group, cpu_group
        self.rows: list[int] = []  # this pass's token rows per rank (set by ``exchange``)

    @property
    def size(self) -> int:
        return dist.get_world_size(self.cpu_group)

    def exchange(self, rows: int | None) -> bool:
        """Collective over the ranks: this rank's rows for the next pass (None: it has none).
        -> whether any rank has a pass; ``self.rows`` holds every rank's rows (0 without one)."""
        mine = torch.tensor([-1 if rows is None else rows], dtype=torch.long)
        out = torch.empty(self.size, dtype=torch.long)
        dist.all_gather_into_tensor(out, mine, group=self.cpu_group)
        counts = out.tolist()
        self.rows = [max(c, 0) for c in counts]
        return any(c >= 0 for c in counts)

    def gather(self, x: Tensor) -> Tensor:
        """This rank's rows [n, ...] -> every rank's, each padded to the largest count [R * m, ...]."""
        m = max(self.rows)
        if x.shape[0] < m:
            x = torch.cat((x, x.new_zeros((m - x.shape[0],) + tuple(x.shape[1:]))))
        out = x.new_empty((self.size * m,) + tuple(x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=self.group)
        return out

    def scatter_sum(self, y: Tensor, n: int) -> Tensor:
        """Every rank's partial [R * m, D] -> the sum over ranks of this rank's block, first n rows."""
        m = max(self.rows)
        out = y.new_empty((m,) + tuple(y.shape[1:]))
        dist.reduce_scatter_tensor(out, y.contiguous(), group=self.group)
        return out[:n]


@dataclass(frozen=True)
class ModelParallel:
    """A rank's place in the TP and EP groups (a None group = size 1, rank 0), and with ``dp``
    data-parallel attention over the EP ranks (attention then not split: ``tp_group`` None)."""

    tp_group: ProcessGroup | None = None
    ep_group: ProcessGroup | None = None
    dp: DataParallelTokens | None = None

    @property
    def tp_size(self) -> int:
        return _size(self.tp_group)

    @property
    def tp_rank(self) -> int:
        return _rank(self.tp_group)

    @property
    def ep_size(self) -> int:
        return _size(self.ep_group)

    @property
    def ep_rank(self) -> int:
        return _rank(self.ep_group)

    def local_experts(self, cfg: V4Config) -> range:
        return _share(cfg.n_routed_experts, self.ep_rank, self.ep_size)

    # ---- the model's two reductions ----------------------------------------------------------
    def reduce_attention(self, partial: Tensor) -> Tensor:
        """Sum of the ranks' partial output projections ([T, D], summed in place)."""
        if self.tp_size > 1:
            dist.all_reduce(partial, group=self.tp_group)
        return partial

    def moe(self, x: Tensor, token_ids: Tensor, w: dict[str, Tensor], cfg: V4Config,
            hash_routed: bool) -> Tensor:
        """``ops.moe`` with the routed experts split over the EP group (with ``dp``: over all the
        data-parallel ranks' tokens of this pass, ``DataParallelTokens.rows``)."""
        if self.dp is not None:
            n = x.shape[0]
            routed = ops.routed_experts(self.dp.gather(x), self.dp.gather(token_ids), w, cfg, hash_routed,
                                        self.local_experts(cfg))
            out = self.dp.scatter_sum(routed, n)
        elif self.ep_size == 1:
            return ops.moe(x, token_ids, w, cfg, hash_routed)
        else:
            out = ops.routed_experts(x, token_ids, w, cfg, hash_routed, self.local_experts(cfg))
            dist.all_reduce(out, group=self.ep_group)
        return ops.shared_expert(x, w, cfg, plus=out) if cfg.n_shared_experts else out


def _size(group: ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _rank(group: ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def _share(n: int, rank: int, size: int) -> range:
    """Rank ``rank``'s contiguous share of ``n`` items split ``size`` ways."""
    k = n // size
    return range(rank * k, (rank + 1) * k)


def shard_weights(cfg: V4Config, weights: dict[str, Tensor], tp_rank: int = 0, tp_size: int = 1,
                  ep_rank: int = 0, ep_size: int = 1) -> dict[str, Tensor]:
    """One rank's tensors of the full (logical) ``weights``: attention tensors sliced to its heads
    and output groups, other EP ranks' routed experts dropped, the rest shared with ``weights``."""
    shard = TensorSharder(cfg, tp_rank, tp_size, ep_rank, ep_size)
    out = {}
    for name, t in weights.items():
        local = shard(name, t)
        if local is not None:
            out[name] = local
    return out


class TensorSharder:
    """``sharder(name, full_tensor)`` -> this rank's part of one logical tensor, or None where the
    rank holds none of it (another EP rank's expert; ``holds(name)`` says so before any data is
    read). One tensor at a time, so a loader can shard while it streams a checkpoint."""

    def __init__(self, cfg: V4Config, tp_rank: int = 0, tp_size: int = 1, ep_rank: int = 0, ep_size: int = 1):
        cfg.validate_parallel(tp_size, ep_size)
        if not (0 <= tp_rank < tp_size and 0 <= ep_rank < ep_size):
            raise ValueError(f"rank out of range: tp {tp_rank} of {tp_size}, ep {ep_rank} of {ep_size}")
        heads = _share(cfg.num_attention_heads, tp_rank, tp_size)
        groups = _share(cfg.o_groups, tp_rank, tp_size)
        self.experts = _share(cfg.n_routed_experts, ep_rank, ep_size)
        Dh, R = cfg.head_dim, cfg.o_lora_rank
        # slices are copied so that a rank does not keep the full tensors alive
        self.rules: dict[str, Callable[[Tensor], Tensor]] = {} if tp_size == 1 else {
            "attn.wq_b.weight": lambda t: t[heads.start * Dh:heads.stop * Dh].clone(),
            "attn.attn_sink": lambda t: t[heads.start:heads.stop].clone(),
            "attn.wo_a.weight": lambda t: t[groups.start * R:groups.stop * R].clone(),
            "attn.wo_b.weight": lambda t: t[:, groups.start * R:groups.stop * R].contiguous(),
        }

    @staticmethod
    def _local(name: str) -> str:
        m = _LAYER.match(name)
        return m.group(1) if m else ""

    def holds(self, name: str) -> bool:
        e = _EXPERT.match(self._local(name))
        return e is None or int(e.group(1)) in self.experts

    def __call__(self, name: str, t: Tensor) -> Tensor | None:
        if not self.holds(name):
            return None
        rule = self.rules.get(self._local(name))
        if rule is None:
            return t
        if isinstance(t, Fp8Weight):  # the fp8 weight mode: values and block scales cut alike
            return t.sliced(rule)
        return rule(t)


def shard_model(model: V4Model, par: ModelParallel) -> V4Model:
    """A V4Model for this rank of ``par``, sharing the replicated tensors with ``model``.

    Every rank of the groups must call the sharded model's ``forward`` with the same batch (the
    reductions are collectives); each keeps its own cache.
    """
    w = shard_weights(model.cfg, model.w, par.tp_rank, par.tp_size, par.ep_rank, par.ep_size)
    return V4Model(model.cfg, w, model.quant_sim, parallel=par)
