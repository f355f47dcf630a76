"""Choosing the attention backend of a cache: "auto", "torch", "torch-fp8" or "flashmla".

"torch-fp8" stores FlashMLA's fp8 layout and runs its torch reference (``torch_ref``): the same
cache contents as "flashmla" on any device.

"auto" takes FlashMLA when the cache lives on a CUDA device of SM90/SM100, ``flash_mla`` imports
and the attention shape fits (head_dim 512, rope 64, 64 or 128 heads: ``V4Config.check_flashmla``),
and the torch path otherwise; the choice and its reason are logged once. Asking for "flashmla"
where it cannot run raises ``BackendUnavailable`` naming every reason.
"""

from __future__ import annotations

import logging
from functools import lru_cache

import torch

from ..config import ConfigError, V4Config
from .backend import TORCH_BACKEND, AttentionBackend

logger = logging.getLogger(__name__)
BACKEND_NAMES = ("auto", "torch", "torch-fp8", "flashmla")
FLASHMLA_ARCHS = (9, 10)  # SM90 (legacy kernels), SM100
_logged: set[str] = set()


class BackendUnavailable(RuntimeError):
    """A backend was asked for by name but cannot run here."""


def flashmla_unavailable(cfg: V4Config, device: torch.device | str) -> list[str]:
    """Why FlashMLA cannot serve ``cfg`` on ``device`` (empty list: it can)."""
    device = torch.device(device)
    reasons = []
    try:
        cfg.check_flashmla()
    except ConfigError as e:
        reasons.append(f"attention shape: {e}")
    if device.type != "cuda":
        reasons.append(f"the cache is on {device}, FlashMLA needs a CUDA device")
    elif not torch.cuda.is_available():
        reasons.append("CUDA is not available")
    else:
        major, minor = torch.cuda.get_device_capability(device)
        if major not in FLASHMLA_ARCHS:
            reasons.append(f"the GPU is SM{major}{minor}; FlashMLA's sparse kernels need SM90 or SM100")
        else:
            try:
                _flashmla_kernels(str(device))
            except Exception as e:  # ImportError, or OSError from the extension's dlopen
                reasons.append(f"flash_mla is not usable: {type(e).__name__}: {e}")
    return reasons


@lru_cache(maxsize=None)
def _flashmla_kernels(device: str):
    from .flashmla import FlashMLAKernels

    return FlashMLAKernels(device)


def select_backend(choice: str | AttentionBackend | None, cfg: V4Config,
                   device: torch.device | str) -> AttentionBackend:
    """The backend for a cache of ``cfg`` on ``device``; ``choice`` is a name, a backend, or None
    (= "auto")."""
    if isinstance(choice, AttentionBackend):
        return choice
    choice = choice or "auto"
    if choice not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {choice!r} (one of {', '.join(BACKEND_NAMES)})")
    if choice == "torch":
        return TORCH_BACKEND
    if choice == "torch-fp8":
        from .sparse_mla import SparseMLABackend
        from .torch_ref import TorchSparseKernels

        return SparseMLABackend(TorchSparseKernels(), name="torch-fp8")
    reasons = flashmla_unavailable(cfg, device)
    if choice == "flashmla" and reasons:
        raise BackendUnavailable("attention backend 'flashmla' cannot run: " + "; ".join(reasons))
    if reasons:
        _log_once(f"attention backend: torch (FlashMLA not used: {'; '.join(reasons)})")
        return TORCH_BACKEND
    from .sparse_mla import SparseMLABackend

    _log_once(f"attention backend: flashmla on {torch.device(device)}")
    return SparseMLABackend(_flashmla_kernels(str(torch.device(device))), name="flashmla")


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.info(message)
