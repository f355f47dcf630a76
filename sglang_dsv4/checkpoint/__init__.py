"""V4 checkpoints: the tensor schema, a writer and a loader (HF safetensors layout)."""

from __future__ import annotations

from .loader import Checkpoint, CheckpointError, load_checkpoint
from .writer import write_checkpoint

__all__ = ["Checkpoint", "CheckpointError", "load_checkpoint", "write_checkpoint"]
