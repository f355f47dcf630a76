"""Main job until the server lands: build a tiny V4 on first use, chat-prefill, decode, report.

    python -m sglang_dsv4.demo [--preset micro] [--max-new-tokens 48] [--prompt TEXT]

Renders a chat prompt with the real DeepSeek-V4 tokenizer and chat template, prefills it in
chunks through the incremental model, snapshots the prompt, decodes greedily, then resumes a
second request from the snapshot and checks it decodes the same tokens. Random weights write
gibberish: the point is the machinery and its timings.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from .checkpoint import load_checkpoint
from .core.cache import V4Cache
from .core.model import V4Model
from .tiny import ensure_tiny
from .tokenizer_files import load_tokenizer, render_chat

DEFAULT_CACHE_DIR = Path(os.environ.get("SGLANG_DSV4_CACHE", Path.home() / ".cache" / "sglang_dsv4"))


def greedy_decode(model: V4Model, cache: V4Cache, req, first_logits: torch.Tensor, n: int,
                  eos: int) -> list[int]:
    """Greedy tokens from the last prefill logits, one decode step per token."""
    out, logits = [], first_logits
    for _ in range(n):
        tok = int(logits.argmax())
        out.append(tok)
        if tok == eos:
            break
        logits = model.forward(cache, [req], [torch.tensor([tok])])[0][-1]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sglang_dsv4.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="micro", choices=["micro", "tiny"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt", default="Explain in one sentence why a sliding-window cache needs a ring buffer.")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--chunk-size", type=int, default=64, help="prefill chunk size")
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    model_dir = ensure_tiny(args.preset, args.seed, DEFAULT_CACHE_DIR)
    ckpt = load_checkpoint(model_dir)
    cfg = ckpt.config
    tokenizer = load_tokenizer(model_dir)
    t_load = time.perf_counter() - t0
    text = render_chat([{"role": "user", "content": args.prompt}])
    ids = torch.tensor(tokenizer.encode(text, add_special_tokens=False).ids)

    model = V4Model(cfg, ckpt.tensors)
    cache = V4Cache(cfg, max_requests=2, max_total_tokens=4096, page_size=64)
    req = cache.new_request()
    t0 = time.perf_counter()
    for start in range(0, ids.numel(), args.chunk_size):
        logits = model.forward(cache, [req], [ids[start:start + args.chunk_size]])[0]
    t_prefill = time.perf_counter() - t0
    snap = cache.snapshot(req)
    t0 = time.perf_counter()
    tokens = greedy_decode(model, cache, req, logits[-1], args.max_new_tokens, cfg.eos_token_id)
    t_decode = time.perf_counter() - t0

    resumed = cache.restore(snap)  # a second request resumes at the end of the prompt: no recompute
    again = greedy_decode(model, cache, resumed, logits[-1], args.max_new_tokens, cfg.eos_token_id)
    for r in (req, resumed):
        cache.free_request(r)
    cache.release(snap)
    cache.check_integrity()

    print(f"model     {model_dir} ({args.preset}, seed {args.seed}); built/loaded in {t_load:.1f} s")
    print(f"prompt    {ids.numel()} tokens: {text!r}")
    print(f"output    {len(tokens)} tokens: {tokenizer.decode(tokens, skip_special_tokens=False)!r}")
    print(f"prefill   {ids.numel() / t_prefill:8.1f} tok/s ({t_prefill * 1e3:.0f} ms, chunks of {args.chunk_size})")
    print(f"decode    {len(tokens) / max(t_decode, 1e-9):8.1f} tok/s ({t_decode * 1e3 / max(len(tokens), 1):.1f} ms/token)")
    print(f"snapshot  {snap.nbytes} bytes; resumed request decoded the same tokens: {again == tokens}")
    return 0 if again == tokens else 1


if __name__ == "__main__":
    raise SystemExit(main())
