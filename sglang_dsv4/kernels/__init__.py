"""Attention backends of the core: KV storage layouts and the sparse attention over them.

``kv_layout`` (page layouts, pure torch), ``backend`` (the seam + the torch reference backend),
``sparse_mla`` (the FlashMLA-shaped backend), ``torch_ref`` / ``flashmla`` (its kernels),
``dispatch`` (picking one). Nothing here imports ``flash_mla`` until FlashMLA is chosen.
"""
