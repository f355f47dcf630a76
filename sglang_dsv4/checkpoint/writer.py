"""Write a V4 checkpoint directory (HF layout) from logical float tensors.

Each tensor is stored in the format the schema gives it (fp8 + e8m0 block scales, packed fp4 +
e8m0 scales, bf16, fp32, int64), in safetensors shards ``model-0000i-of-0000N.safetensors`` with
``model.safetensors.index.json`` and ``config.json``: the layout of a real V4-Flash/Pro checkpoint.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import save_file

from ..config import V4Config
from ..quant import quantize_fp4_packed, quantize_fp8_blockwise
from .loader import CONFIG_FILE, INDEX_FILE, CheckpointError, dtype_name, format_shape, stored_dtypes
from .schema import Storage, TensorSpec, checkpoint_tensors

# The quantization_config of the real V4 config.json.
V4_QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "weight_block_size": [128, 128],
    "scale_fmt": "ue8m0",
    "activation_scheme": "dynamic",
}
# Upper bound of a shard; by default a checkpoint is split into about TARGET_SHARDS shards so that
# even a tiny model exercises multi-shard reading.
MAX_SHARD_BYTES = 4 * 1024**3
TARGET_SHARDS = 4


# FP4 tensors of one shard are quantised together in batches of at most this many elements.
FP4_BATCH_ELEMENTS = 1 << 24


def _checked(spec: TensorSpec, tensor: torch.Tensor) -> torch.Tensor:
    if tuple(tensor.shape) != spec.shape:
        raise CheckpointError(f"tensor {spec.name}: expected logical shape {format_shape(spec.shape)}, "
                              f"got {format_shape(tensor.shape)}")
    t = tensor.detach().cpu()
    if spec.storage is Storage.INT64:
        if t.is_floating_point() or t.is_complex():
            raise CheckpointError(f"tensor {spec.name}: expected an integer tensor, got {dtype_name(t.dtype)}")
    elif not t.is_floating_point():
        raise CheckpointError(f"tensor {spec.name}: expected a float tensor, got {dtype_name(t.dtype)}")
    return t


def quantize_tensor(spec: TensorSpec, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """One logical tensor -> its stored tensors (checkpoint name -> tensor), per spec.storage."""
    t = _checked(spec, tensor)
    if spec.storage is Storage.INT64:
        return {spec.name: t.to(torch.int64).contiguous()}
    if spec.storage is Storage.FP8:
        q, scale = quantize_fp8_blockwise(t)
        return {spec.name: q, spec.scale_name: scale.contiguous()}
    if spec.storage is Storage.FP4:
        q, scale = quantize_fp4_packed(t)
        return {spec.name: q.contiguous(), spec.scale_name: scale.contiguous()}
    target = torch.bfloat16 if spec.storage is Storage.BF16 else torch.float32
    return {spec.name: t.to(target).contiguous()}


def random_stored(cfg: V4Config, device: torch.device | str = "cpu", seed: int = 0
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """Random weights in their stored checkpoint formats, (name, tensor) one logical tensor at a time
    as a model loader streams them, made (and quantised) on ``device``: a V4-Flash-sized checkpoint
    for ``checkpoint.loader.logical_from_stored`` without writing it. Init rules as ``tiny``'s
    (unit-gain matrices, norms near 1), from a generator on ``device`` seeded with ``seed``."""
    g = torch.Generator(device=device).manual_seed(seed)
    for spec in checkpoint_tensors(cfg):
        shape, leaf = spec.shape, spec.name.rsplit(".", 1)[-1]
        if spec.storage is Storage.INT64:
            vocab, k = shape
            t = torch.rand(vocab, cfg.n_routed_experts, generator=g, device=device).argsort(1)[:, :k]
            yield spec.name, t.contiguous()
            continue
        t = torch.randn(shape, generator=g, device=device)
        if spec.name.endswith("norm.weight"):
            t = 1 + 0.1 * t
        elif leaf.startswith("hc_") and leaf.endswith("_scale"):
            t = 0.5 + torch.rand(shape, generator=g, device=device)
        elif (leaf.startswith("hc_") and leaf.endswith("_base")) or leaf == "ape":
            t = 0.5 * t
        elif spec.name.endswith("gate.bias"):
            t = 0.1 * t
        elif len(shape) == 2 and spec.name != "embed.weight":
            t = t * shape[1] ** -0.5
        if spec.storage is Storage.FP8:
            q, scale = quantize_fp8_blockwise(t)
            yield from ((spec.name, q), (spec.scale_name, scale))
        elif spec.storage is Storage.FP4:
            q, scale = quantize_fp4_packed(t)
            yield from ((spec.name, q), (spec.scale_name, scale))
        else:
            yield spec.name, t.to(torch.bfloat16 if spec.storage is Storage.BF16 else torch.float32)


def _quantize_fp4_batch(specs: list[TensorSpec], tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # FP4 quantisation is row-wise, so stacking rows is exact; one call over many small experts
    # instead of one per expert avoids a per-call overhead that dominates tiny models.
    q, scale = quantize_fp4_packed(torch.cat([_checked(s, tensors[s.name]).float() for s in specs]))
    rows = [s.shape[0] for s in specs]
    stored: dict[str, torch.Tensor] = {}
    for spec, qi, si in zip(specs, q.split(rows), scale.split(rows)):
        stored[spec.name] = qi.contiguous()
        stored[spec.scale_name] = si.contiguous()
    return stored


def _quantize_shard(specs: list[TensorSpec], tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    stored: dict[str, torch.Tensor] = {}
    batches: dict[int, list[list[TensorSpec]]] = {}  # FP4 in-dim -> batches
    for spec in specs:
        if spec.storage is not Storage.FP4:
            stored.update(quantize_tensor(spec, tensors[spec.name]))
            continue
        group = batches.setdefault(spec.shape[1], [[]])
        if group[-1] and (sum(math.prod(s.shape) for s in group[-1]) + math.prod(spec.shape) > FP4_BATCH_ELEMENTS):
            group.append([])
        group[-1].append(spec)
    for group in batches.values():
        for batch in group:
            stored.update(_quantize_fp4_batch(batch, tensors))
    return stored


def _stored_bytes(spec: TensorSpec) -> int:
    dtypes = stored_dtypes(spec)
    return sum(math.prod(shape) * dtypes[name].itemsize for name, shape in spec.stored_shapes().items())


def _plan_shards(specs: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Greedy split in schema order; a weight and its scale always share a shard."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = _stored_bytes(spec)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def config_json(cfg: V4Config) -> dict:
    """The config.json content for ``cfg`` (real HF field names, real quantization_config)."""
    d = cfg.to_dict()
    if d.get("quantization_config") is None:
        d["quantization_config"] = dict(V4_QUANTIZATION_CONFIG)
    return d


def _empty_dir(out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    existing = sorted(p.name for p in out.iterdir() if p.name.endswith(".safetensors") or p.name == INDEX_FILE)
    if existing:
        raise CheckpointError(f"{out} already holds checkpoint files ({', '.join(existing[:3])}); "
                              "write into an empty directory")
    return out


def _shard_plan(specs: list[TensorSpec], max_shard_bytes: int | None) -> list[list[TensorSpec]]:
    if max_shard_bytes is None:
        total = sum(_stored_bytes(s) for s in specs)
        max_shard_bytes = min(MAX_SHARD_BYTES, max(1, math.ceil(total / TARGET_SHARDS)))
    return _plan_shards(specs, max_shard_bytes)


def _write_shards(cfg: V4Config, out: Path, shards: Iterator[tuple[list[TensorSpec], dict[str, torch.Tensor]]],
                  num_shards: int) -> Path:
    """Write each shard's stored tensors as it comes, then the index and config.json."""
    weight_map: dict[str, str] = {}
    total_size = 0
    for i, (shard_specs, stored) in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{num_shards:05d}.safetensors"
        save_file(stored, str(out / fname), metadata={"format": "pt"})
        (out / fname).chmod(0o644)  # safetensors creates files owner-only; checkpoints are shared
        total_size += sum(t.numel() * t.element_size() for t in stored.values())
        weight_map.update({name: fname for spec in shard_specs for name in spec.stored_shapes()})
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (out / CONFIG_FILE).write_text(json.dumps(config_json(cfg), indent=2) + "\n")
    return out


def write_random_checkpoint(cfg: V4Config, out_dir: str | Path, device: torch.device | str = "cpu",
                            seed: int = 0, max_shard_bytes: int | None = None) -> Path:
    """Write a random-weight checkpoint of ``cfg`` to ``out_dir``: ``random_stored``'s tensors (made
    and quantised on ``device``), one shard in memory at a time, so a V4-Flash-sized checkpoint
    never holds its logical float weights at once. Returns ``out_dir``."""
    cfg.validate()
    out = _empty_dir(out_dir)
    plan = _shard_plan(checkpoint_tensors(cfg), max_shard_bytes)
    stream = random_stored(cfg, device, seed)

    def shards():
        for shard_specs in plan:
            stored = {}
            for expected in (n for spec in shard_specs for n in spec.stored_shapes()):
                name, t = next(stream)
                if name != expected:  # random_stored walks the schema in the same order
                    raise CheckpointError(f"write_random_checkpoint: got {name}, expected {expected}")
                stored[name] = t.to("cpu").contiguous()
            yield shard_specs, stored

    return _write_shards(cfg, out, shards(), len(plan))


def write_checkpoint(cfg: V4Config, tensors: dict[str, torch.Tensor], out_dir: str | Path,
                     max_shard_bytes: int | None = None) -> Path:
    """Quantise the logical ``tensors`` of ``cfg`` and write a sharded checkpoint to ``out_dir``.

    ``tensors`` must hold exactly the names of ``checkpoint_tensors(cfg)`` with their logical
    shapes. ``max_shard_bytes`` defaults to a quarter of the checkpoint (at most 4 GiB), so there
    are several shards. ``out_dir`` must not already hold a checkpoint. Returns ``out_dir``.
    """
    cfg.validate()
    specs = checkpoint_tensors(cfg)
    expected = {s.name for s in specs}
    missing = [s.name for s in specs if s.name not in tensors]
    extra = sorted(set(tensors) - expected)
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensor(s), e.g. {', '.join(missing[:5])}")
        if extra:
            parts.append(f"{len(extra)} tensor(s) not in the schema, e.g. {', '.join(extra[:5])}")
        raise CheckpointError("write_checkpoint: " + "; ".join(parts))

    out = _empty_dir(out_dir)
    plan = _shard_plan(specs, max_shard_bytes)
    return _write_shards(cfg, out, ((shard_specs, _quantize_shard(shard_specs, tensors)) for shard_specs in plan),
                         len(plan))
