"""Read a V4 checkpoint directory (HF layout) into logical tensors.

The directory holds ``config.json`` and either ``model.safetensors.index.json`` with its shards or
a single ``model.safetensors``. Every tensor that ``schema.checkpoint_tensors`` lists must be there
with its stored shape and dtype; fp8 and fp4 weights are dequantised with their ``.scale``
companions. Tensors that the schema does not list are ignored, since real checkpoints may carry more.

Weight modes (``kernels.weight_mode``): ``bf16`` (the default) dequantises every matrix as above;
``fp8`` keeps fp8-stored matrices as ``kernels.fp8_linear.Fp8Weight`` (e4m3 + block scales;
``attn.wo_a`` only where ``keeps_fp8`` says so) and converts fp4 experts to fp8 block-128, checked exact per tensor.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import torch
from safetensors import safe_open

from ..config import V4Config
from ..kernels import fp8_linear
from ..kernels.fp8_linear import Fp8Weight
from ..quant import FP8_WEIGHT_BLOCK, dequantize_fp4_packed, dequantize_fp8_blockwise, fp4_to_fp8_blockwise
from .schema import Storage, TensorSpec, checkpoint_tensors

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# safetensors dtype tags -> torch dtypes (the ones a checkpoint may plausibly hold).
_SAFETENSORS_DTYPES = {
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
    "BOOL": torch.bool,
}
_MAX_LISTED_PROBLEMS = 20


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be read, with the offending file or tensor named."""


@dataclass
class Checkpoint:
    """A loaded checkpoint: its config and its logical (dequantised) tensors by schema name."""

    config: V4Config
    tensors: dict[str, torch.Tensor | Fp8Weight]
    path: Path


def stored_dtypes(spec: TensorSpec) -> dict[str, torch.dtype]:
    """Checkpoint names -> stored dtypes of one logical tensor (the weight and its scale)."""
    if spec.storage is Storage.FP8:
        return {spec.name: torch.float8_e4m3fn, spec.scale_name: torch.float8_e8m0fnu}
    if spec.storage is Storage.FP4:
        return {spec.name: torch.int8, spec.scale_name: torch.float8_e8m0fnu}
    plain = {Storage.BF16: torch.bfloat16, Storage.FP32: torch.float32, Storage.INT64: torch.int64}
    return {spec.name: plain[spec.storage]}


def dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")


def format_shape(shape: Iterable[int]) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


def load_checkpoint(path: str | Path, dtype: torch.dtype | Callable[[str], torch.dtype] = torch.float32,
                    names: Iterable[str] | None = None, weight_mode: str = "bf16",
                    device: torch.device | str | None = None) -> Checkpoint:
    """Load ``config.json`` and every schema tensor of the checkpoint at ``path``.

    fp8/fp4/bf16/fp32 tensors come back as ``dtype`` (one dtype, or a function of the name such as
    ``core.model.weight_dtypes``); int64 tensors (``tid2eid``) stay int64. ``names`` restricts
    loading to those logical names (all of them by default). ``weight_mode`` "fp8" keeps the
    quantised matrices as ``Fp8Weight`` (see the module doc; they need a CUDA device to run, the
    CPU has a torch reference); ``device`` moves every tensor there as it is read. Every stored
    shape and dtype is checked before any data is read. Raises CheckpointError (files, tensors,
    a mode the checkpoint cannot give) or ConfigError (config.json content).
    """
    if not callable(dtype) and not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating dtype, got {dtype_name(dtype)}")
    _check_weight_mode(weight_mode)
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {root} does not exist or is not a directory")
    if not (root / CONFIG_FILE).is_file():
        raise CheckpointError(f"missing {CONFIG_FILE} in checkpoint directory {root}")
    cfg = V4Config.from_json(root / CONFIG_FILE)
    specs = _select(checkpoint_tensors(cfg), names)
    weight_map = _read_weight_map(root)

    with ExitStack() as stack:
        shards = {fname: _open_shard(stack, root, fname) for fname in sorted(set(weight_map.values()))}
        problems = [p for spec in specs for p in _check_spec(spec, weight_map, shards)]
        if problems:
            raise CheckpointError(_describe(root, problems))
        if weight_mode == "bf16" and device is None and not callable(dtype):
            tensors = {spec.name: _load_spec(spec, weight_map, shards, dtype) for spec in specs}
        else:
            stream = ((n, shards[weight_map[n]].get_tensor(n)) for spec in specs for n in spec.stored_shapes())
            tensors = logical_from_stored(cfg, stream, dtype, device=device, weight_mode=weight_mode,
                                          names=[spec.name for spec in specs])
    return Checkpoint(config=cfg, tensors=tensors, path=root)


LOADER_MODES = ("bf16", "fp8")


def _check_weight_mode(weight_mode: str) -> None:
    if weight_mode not in LOADER_MODES:
        raise ValueError(f"weight_mode: expected one of {', '.join(LOADER_MODES)} (resolve 'auto' with "
                         f"kernels.weight_mode.select_weight_mode first), got {weight_mode!r}")


def keeps_fp8(spec: TensorSpec, cfg: V4Config) -> bool:
    """Whether the fp8 weight mode holds ``spec`` quantised: fp8 matrices and the routed experts
    (fp4 converted to fp8, or fp8 as stored). ``attn.wo_a`` (a grouped einsum) is dequantised to
    bf16, as convert.py and upstream without DeepGEMM do, unless ``fp8_linear.GROUPED_WO_A`` runs
    it through the weight-only kernel (``kernels.fp8_weight_only``: the same bf16 products) and
    its groups keep their 128x128 scale blocks whole (``fp8_linear.groups_fit``)."""
    if spec.storage not in (Storage.FP8, Storage.FP4):
        return False
    if spec.name.endswith("attn.wo_a.weight"):
        return fp8_linear.GROUPED_WO_A and fp8_linear.groups_fit(*spec.shape, cfg.o_groups)
    return True


def _check_mode_storage(cfg: V4Config, weight_mode: str) -> None:
    if weight_mode == "fp8" and cfg.expert_dtype not in ("fp4", "fp8"):
        raise CheckpointError(f"--dsv4-weights fp8 (dsv4_weights): the checkpoint stores its routed experts in "
                              f"{cfg.expert_dtype} (config expert_dtype), not fp4/fp8, so there is nothing to "
                              "keep quantised; use --dsv4-weights bf16 (or auto)")


def _check_scale(spec: TensorSpec, scale: torch.Tensor) -> None:
    if scale.float().isnan().any():  # e8m0 0xFF is NaN: it would silently poison the matrix
        raise CheckpointError(f"tensor {spec.scale_name}: holds NaN scales (e8m0 byte 0xFF)")


def _shard_fp8(name: str, w: Fp8Weight, shard: Callable[[str, torch.Tensor], torch.Tensor | None]) -> Fp8Weight | None:
    """A rank's part of an fp8 matrix (``Fp8Weight.sliced`` with ``shard``'s rule for ``name``)."""
    try:
        return w.sliced(lambda t: shard(name, t))
    except ValueError as e:
        raise CheckpointError(f"tensor {name}: this rank's slice does not fall on {FP8_WEIGHT_BLOCK}x{FP8_WEIGHT_BLOCK} "
                              f"scale-block boundaries ({e}); use --dsv4-weights bf16 for this split") from None


def _quantised(spec: TensorSpec, found: Mapping[str, torch.Tensor], device) -> Fp8Weight:
    """The fp8 weight mode's form of a quantised spec: fp8 as stored, fp4 converted exactly."""
    q, scale = found[spec.name], found[spec.scale_name]
    _check_scale(spec, scale)
    if device is not None:  # convert where the tensor goes (the GPU is much faster at it)
        q, scale = q.to(device), scale.to(device)
    if spec.storage is Storage.FP8:
        return Fp8Weight.from_checkpoint(q, scale)
    try:
        q8, s8 = fp4_to_fp8_blockwise(q, scale, spec.name)
    except ValueError as e:
        raise CheckpointError(f"--dsv4-weights fp8: {e}; use --dsv4-weights bf16 for this checkpoint") from None
    return Fp8Weight.from_checkpoint(q8, s8)


def _select(specs: list[TensorSpec], names: Iterable[str] | None) -> list[TensorSpec]:
    if names is None:
        return specs
    wanted = set(names)
    unknown = wanted - {s.name for s in specs}
    if unknown:
        raise CheckpointError(f"not tensors of this config's schema: {', '.join(sorted(unknown))}")
    return [s for s in specs if s.name in wanted]


def _read_weight_map(root: Path) -> dict[str, str]:
    """Stored tensor name -> shard file name, from the index or the single-file layout."""
    index_path = root / INDEX_FILE
    if not index_path.is_file():
        if (root / SINGLE_FILE).is_file():
            with ExitStack() as stack:
                keys = _open_shard(stack, root, SINGLE_FILE).keys()
            return {k: SINGLE_FILE for k in keys}
        raise CheckpointError(f"missing {INDEX_FILE} (and no single {SINGLE_FILE}) in checkpoint directory {root}")
    try:
        index: Any = json.loads(index_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{index_path}: not valid JSON ({e})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise CheckpointError(f"{index_path}: expected an object with a 'weight_map' of tensor name -> shard file")
    for fname in sorted(set(weight_map.values())):
        if Path(fname).name != fname:
            raise CheckpointError(f"{index_path}: shard file name {fname!r} is not a plain file name")
        if not (root / fname).is_file():
            example = next(k for k, v in weight_map.items() if v == fname)
            raise CheckpointError(
                f"{INDEX_FILE} names shard file {fname} (holding e.g. {example}), "
                f"which does not exist in {root}")
    return weight_map


def _open_shard(stack: ExitStack, root: Path, fname: str) -> Any:
    try:
        return stack.enter_context(safe_open(str(root / fname), framework="pt"))
    except Exception as e:  # safetensors raises its own SafetensorError (or OSError) here
        raise CheckpointError(f"shard {root / fname} is not a valid safetensors file "
                              f"(truncated or corrupt?): {e}") from None


def _check_spec(spec: TensorSpec, weight_map: dict[str, str], shards: dict[str, Any]) -> list[str]:
    def stored(name: str):
        fname = weight_map.get(name)
        if fname is None:
            return "not in the weight map"
        if name not in shards[fname].keys():
            return f"the index puts it in {fname}, which does not hold it"
        view = shards[fname].get_slice(name)
        tag = view.get_dtype()
        return tuple(view.get_shape()), _SAFETENSORS_DTYPES.get(tag, tag), f" in {fname}"

    return _spec_problems(spec, stored)


def _spec_problems(spec: TensorSpec, stored) -> list[str]:
    """Problems of one logical tensor's stored parts. ``stored(name)`` gives (shape, dtype, where)
    or, for a missing tensor, why it is missing."""
    problems = []
    dtypes = stored_dtypes(spec)
    for name, shape in spec.stored_shapes().items():
        want = f"{format_shape(shape)} {dtype_name(dtypes[name])}"
        found = stored(name)
        if isinstance(found, str):
            problems.append(f"missing tensor {name} (expected shape {want}; {found})")
            continue
        got_shape, got_dtype, where = found
        if tuple(got_shape) != tuple(shape) or got_dtype != dtypes[name]:
            problems.append(f"tensor {name}{where}: expected shape {want}, "
                            f"got {format_shape(got_shape)} {dtype_name(got_dtype)}")
    return problems


def _describe(root: Path, problems: list[str]) -> str:
    if len(problems) == 1:
        return f"{problems[0]} (checkpoint {root})"
    listed = problems[:_MAX_LISTED_PROBLEMS]
    more = len(problems) - len(listed)
    lines = [f"{len(problems)} problems in checkpoint {root}:"] + [f"  - {p}" for p in listed]
    if more:
        lines.append(f"  ... and {more} more")
    return "\n".join(lines)


def logical_from_stored(cfg: V4Config, stored: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                        dtype: torch.dtype | Callable[[str], torch.dtype] = torch.float32,
                        device: torch.device | str | None = None,
                        shard: Callable[[str, torch.Tensor], torch.Tensor | None] | None = None,
                        weight_mode: str = "bf16", names: Iterable[str] | None = None,
                        ) -> dict[str, torch.Tensor | Fp8Weight]:
    """Stored checkpoint tensors, as a model loader streams them ((name, tensor) pairs or a dict)
    -> logical tensors by schema name.

    Streaming: a logical tensor is built as soon as its stored parts (weight, and scale for
    fp8/fp4) have arrived, and the parts are dropped, so the host holds only the parts still
    waiting for their partner plus one dequantised tensor. ``dtype`` is one dtype or a function of
    the logical name (e.g. ``core.model.weight_dtypes``); ``shard(name, tensor)`` (e.g.
    ``core.parallel.TensorSharder``) keeps a rank's part of each tensor (None: none of it); with
    ``device`` each kept tensor moves there at once. ``weight_mode`` "fp8": quantised matrices stay
    ``Fp8Weight`` (module doc); ``names`` limits the result to those logical names. Raises
    CheckpointError listing every missing or misshapen stored tensor (after the stream ends), or
    naming a tensor whose scales are NaN or whose fp4 -> fp8 conversion is not exact, or the mode
    the checkpoint cannot give.
    """
    _check_weight_mode(weight_mode)
    _check_mode_storage(cfg, weight_mode)
    dtype_of = dtype if callable(dtype) else (lambda _name: dtype)
    holds = getattr(shard, "holds", lambda _name: True)
    specs = checkpoint_tensors(cfg) if names is None else _select(checkpoint_tensors(cfg), names)
    spec_of = {part: spec for spec in specs for part in spec.stored_shapes()}
    pending: dict[str, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    problems: list[str] = []
    done: set[str] = set()
    for name, t in (stored.items() if isinstance(stored, Mapping) else stored):
        spec = spec_of.get(name)
        if spec is None:
            continue  # not part of the model (e.g. tensors a newer checkpoint adds)
        if not holds(spec.name):  # another rank's expert: never dequantised here
            done.add(spec.name)
            continue
        pending[name] = t
        parts = spec.stored_shapes()
        if not all(part in pending for part in parts):
            continue
        found = {part: pending.pop(part) for part in parts}
        done.add(spec.name)
        bad = _spec_problems(spec, lambda n: (tuple(found[n].shape), found[n].dtype, ""))
        if bad:
            problems += bad
            continue
        if weight_mode == "fp8" and keeps_fp8(spec, cfg):
            w8 = _quantised(spec, found, device)
            found.clear()
            if shard is not None and (w8 := _shard_fp8(spec.name, w8, shard)) is None:
                continue
            out[spec.name] = w8 if device is None else w8.to(device)
            continue
        logical = _dequantize(spec, found.__getitem__, dtype_of(spec.name))
        found.clear()  # the stored parts are not needed past this point
        if shard is not None and (logical := shard(spec.name, logical)) is None:
            continue
        out[spec.name] = logical if device is None else logical.to(device)
    for spec in specs:  # what never completed: name its missing parts (and check the others)
        if spec.name not in done:
            problems += _spec_problems(spec, lambda n: (tuple(pending[n].shape), pending[n].dtype, "")
                                       if n in pending else "not among the streamed weights")
    if problems:
        raise CheckpointError(_describe(Path("<streamed weights>"), problems))
    return out


def _load_spec(spec: TensorSpec, weight_map: dict[str, str], shards: dict[str, Any],
               dtype: torch.dtype) -> torch.Tensor:
    return _dequantize(spec, lambda name: shards[weight_map[name]].get_tensor(name), dtype)


def _dequantize(spec: TensorSpec, get, dtype: torch.dtype) -> torch.Tensor:
    if spec.scale_name is not None:
        _check_scale(spec, get(spec.scale_name))
    if spec.storage is Storage.FP8:
        return dequantize_fp8_blockwise(get(spec.name), get(spec.scale_name)).to(dtype)
    if spec.storage is Storage.FP4:
        return dequantize_fp4_packed(get(spec.name), get(spec.scale_name)).to(dtype)
    if spec.storage is Storage.INT64:
        return get(spec.name)
    return get(spec.name).to(dtype)
