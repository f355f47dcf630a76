"""sglang-dsv4: DeepSeek-V4 on SGLang with prefix sharing over the compressed KV segment.

Glossary (used throughout):
  position / P   absolute 0-based token index; "at P" means tokens 0..P-1 have been processed.
  ratio / r      a layer's compress ratio: 0 (window only), 4 (C4 + indexer) or 128 (C128).
  window ring    a request's last W window-KV rows per layer, position p at row p % W.
  entry j        compressed KV of the group of positions r*j .. r*j+r-1; append-only, shared.
  slot           a running request's row in the per-request state tensors (rings, compressor state).
  page           the allocation unit of compressed entries; page tables map entry j to storage.
  snapshot       a copy of one slot's state at P plus references to the entries below P//r.
"""

__version__ = "0.1.0"
