"""Write the float32 logits of every prompt position, for golden tests that catch numerical drift.

    python -m sglang_dsv4.logits --model-path DIR (--prompt TEXT | --prompt-ids 1,2,3) [--oracle]
        [--chunk-sizes 5,17,...] [--no-quant-sim] --out FILE.safetensors

The incremental model prefills the prompt in the given chunk sizes (the remainder as one last
chunk); ``--oracle`` runs the cache-free reference instead. ``--prompt`` is encoded with the
checkpoint's tokenizer after a BOS token. The file holds ``logits`` [T, vocab] float32 and
``input_ids`` [T] int64. Computation is float32 on CPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from .checkpoint import load_checkpoint
from .config import V4Config
from .core.cache import V4Cache
from .core.model import V4Model
from .core.oracle import OracleModel


def parse_int_list(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what}: expected comma-separated integers, got {text!r}") from None
    if not values:
        raise ValueError(f"{what}: empty list")
    return values


def prompt_logits(model_path: str | Path, ids: list[int], oracle: bool = False,
                  chunk_sizes: list[int] | None = None, quant_sim: bool = True) -> torch.Tensor:
    """Logits [T, V] (float32, CPU) of every position of ``ids``."""
    ckpt = load_checkpoint(model_path)
    cfg = ckpt.config
    bad = [i for i in ids if not 0 <= i < cfg.vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} outside the vocabulary [0, {cfg.vocab_size})")
    if len(ids) > cfg.max_position_embeddings:
        raise ValueError(f"prompt of {len(ids)} tokens exceeds max_position_embeddings {cfg.max_position_embeddings}")
    tokens = torch.tensor(ids, dtype=torch.long)
    if oracle:
        return OracleModel(cfg, ckpt.tensors, quant_sim).forward(tokens)
    if chunk_sizes and any(c <= 0 for c in chunk_sizes):
        raise ValueError(f"--chunk-sizes: sizes must be positive, got {chunk_sizes}")
    model = V4Model(cfg, ckpt.tensors, quant_sim)
    cache = V4Cache(cfg, max_requests=1, max_total_tokens=max(len(ids), 1), page_size=64,
                    max_seq_len=cfg.max_position_embeddings)
    req = cache.new_request()
    out, pos = [], 0
    for size in list(chunk_sizes or []) + [len(ids)]:
        if pos >= len(ids):
            break
        out.append(model.forward(cache, [req], [tokens[pos:pos + size]])[0])
        pos += size
    return torch.cat(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sglang_dsv4.logits", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", required=True)
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="text, encoded after a BOS token")
    src.add_argument("--prompt-ids", help="comma-separated token ids")
    parser.add_argument("--oracle", action="store_true", help="use the cache-free reference oracle")
    parser.add_argument("--chunk-sizes", help="prefill chunk sizes, e.g. 5,17 (rest in one chunk)")
    parser.add_argument("--no-quant-sim", action="store_true", help="switch off the fp8/fp4 QAT simulation")
    parser.add_argument("--out", required=True, help="output .safetensors file")
    args = parser.parse_args(argv)
    try:
        if args.prompt is not None:
            from .tokenizer_files import load_tokenizer

            bos = V4Config.from_json(args.model_path).bos_token_id
            ids = [bos] + load_tokenizer(args.model_path).encode(args.prompt, add_special_tokens=False).ids
        else:
            ids = parse_int_list(args.prompt_ids, "--prompt-ids")
        chunks = parse_int_list(args.chunk_sizes, "--chunk-sizes") if args.chunk_sizes else None
        logits = prompt_logits(args.model_path, ids, args.oracle, chunks, not args.no_quant_sim)
    except (ValueError, FileNotFoundError) as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    save_file({"logits": logits.float().contiguous(), "input_ids": torch.tensor(ids, dtype=torch.long)},
              args.out, metadata={"model_path": str(args.model_path), "oracle": str(args.oracle),
                                  "chunk_sizes": args.chunk_sizes or "", "quant_sim": str(not args.no_quant_sim)})
    print(f"wrote logits [{logits.shape[0]}, {logits.shape[1]}] to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
