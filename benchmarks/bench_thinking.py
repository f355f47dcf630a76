"""Think budgets: ours (grammar-bounded, the plugin) vs upstream's --enable-strict-thinking, side by side.

    python -m benchmarks.bench_thinking [--model-path micro] [--repeats 2] [--max-tokens 64]

Starts two servers of the same model in one run: ours (``--reasoning-parser deepseek-v4``) and
upstream's mode (the same plus ``--enable-strict-thinking``; our hooks stand aside there), sends
the very same chat requests to both (thinking on, ``custom_params.thinking_budget``, with and
without a JSON schema, interleaved A/B), and prints per request: decode time per output token
(streamed: last chunk - first chunk over tokens - 1, median of the repeats), the ratio to an
unbudgeted thinking request on the same server, and the usage's reasoning tokens (the bound
itself is checked exactly in tests/srt/test_thinking_server.py). A second table times the grammar work alone in-process
(mask fill + accept per token) for both mechanisms with the real V4 tokenizer.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import requests

from .prefix_sim.serve import wait_healthy

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                           "confidence": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["answer", "confidence"], "additionalProperties": False}
COMMON = ["--reasoning-parser", "deepseek-v4", "--constrained-json-disable-any-whitespace",
          "--max-total-tokens", "16384", "--enable-cache-report"]


def start(model: str, port: int, extra: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "sglang_dsv4.launch_server", "--model-path", model,
                             "--port", str(port), *COMMON, *extra], stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def body(budget: int | None, schema: bool, max_tokens: int) -> dict:
    b = {"model": "default", "temperature": 0, "max_tokens": max_tokens, "stream": True,
         "stream_options": {"include_usage": True},
         "messages": [{"role": "user", "content": "Is 7 a prime number? Reply in JSON."}],
         "chat_template_kwargs": {"thinking": True}}
    if budget is not None:
        b["custom_params"] = {"thinking_budget": budget}
    if schema:
        b["response_format"] = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}}
    return b


def run(url: str, b: dict) -> dict:
    """One streamed request: per-token decode seconds, reasoning/content, usage."""
    times, reasoning, content, usage = [], "", "", None
    with requests.post(url + "/v1/chat/completions", json=b, stream=True, timeout=1200) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            for c in event.get("choices") or []:
                d = c.get("delta") or {}
                if d.get("reasoning_content") or d.get("content"):
                    times.append(time.perf_counter())
                reasoning += d.get("reasoning_content") or ""
                content += d.get("content") or ""
    n = usage["completion_tokens"]
    per_token = (times[-1] - times[0]) / max(1, n - 1) if len(times) > 1 else float("nan")
    return {"per_token": per_token, "tokens": n, "reasoning": reasoning, "content": content,
            "reasoning_tokens": (usage.get("completion_tokens_details") or {}).get("reasoning_tokens")}


def grammar_microbench(model_dir: str, budget: int, steps: int) -> dict[str, float]:
    """Microseconds per token of the grammar work alone (fill mask + accept), both mechanisms."""
    import random

    import torch
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from sglang_dsv4.srt import thinking as th
    from sglang_dsv4.srt.thinking_hooks import special_token_ids
    from sglang.srt.constrained.reasoner_grammar_backend import ReasonerGrammarObject
    from sglang.srt.constrained.torch_ops.token_filter_torch_ops import set_token_filter_torch

    tok = AutoTokenizer.from_pretrained(model_dir)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=129280, stop_token_ids=[1])
    compiler = xgr.GrammarCompiler(info)
    specials = special_token_ids(tok)
    closing = tok.encode(th.DEFAULT_CLOSING_TEXT, add_special_tokens=False)
    tag = th.build_structural_tag(budget, th.answer_format(exclude_tokens=th.answer_exclusions(specials)),
                                  special_ids=specials, closing_ids=closing)
    ours = xgr.GrammarMatcher(compiler.compile_structural_tag(json.dumps(tag)))
    theirs = ReasonerGrammarObject(None, think_end_ids=[128822], think_excluded_token_ids=[1, 128825],
                                   max_think_tokens=budget, enable_token_filter=True,
                                   token_filter_fn=set_token_filter_torch)
    theirs.maybe_init_reasoning(True)
    mask = xgr.allocate_token_bitmask(1, 129280)
    rng = random.Random(0)
    out: dict[str, float] = {}
    for name, fill, accept in (
            ("ours", lambda: ours.fill_next_token_bitmask(mask), ours.accept_token),
            ("upstream", lambda: theirs.fill_vocab_mask(mask, 0), theirs.accept_token)):
        spent = 0.0
        for step in range(steps):
            t = time.perf_counter()
            fill()
            spent += time.perf_counter() - t
            bits = (mask[0].unsqueeze(-1) >> torch.arange(32)) & 1
            allowed = torch.nonzero(bits.flatten()[:129280]).flatten()
            token = int(allowed[rng.randrange(len(allowed))])
            t = time.perf_counter()
            accept(token)
            spent += time.perf_counter() - t
            if token == 128822:
                break
        out[name] = 1e6 * spent / (step + 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default="micro")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--port", type=int, default=31720)
    parser.add_argument("--log-dir", default="/tmp")
    args = parser.parse_args()
    urls = {"ours": f"http://127.0.0.1:{args.port}", "upstream": f"http://127.0.0.1:{args.port + 1}"}
    logs = {name: Path(args.log_dir) / f"bench_thinking_{name}.log" for name in urls}
    procs = {"ours": start(args.model_path, args.port, [], logs["ours"]),
             "upstream": start(args.model_path, args.port + 1, ["--enable-strict-thinking"], logs["upstream"])}
    rows = []
    try:
        for name in urls:
            wait_healthy(urls[name], procs[name], logs[name])
        cases = [("thinking, no budget (baseline)", None, False), ("budget 16", 16, False),
                 ("budget 64", 64, False), ("budget 16 + JSON schema", 16, True),
                 ("budget 64 + JSON schema", 64, True)]
        for url in urls.values():  # warm-up: grammar compiles are cached per (budget, schema)
            for _, budget, schema in cases:
                run(url, body(budget, schema, 8))
        results = {(label, name): [] for label, _, _ in cases for name in urls}
        for _ in range(args.repeats):
            for label, budget, schema in cases:
                for name, url in urls.items():  # interleaved, so load drift hits both alike
                    results[(label, name)].append(run(url, body(budget, schema, args.max_tokens)))
        base = {name: statistics.median(r["per_token"] for r in results[(cases[0][0], name)]) for name in urls}
        for label, budget, schema in cases:
            row = [label]
            for name, url in urls.items():
                rs = results[(label, name)]
                t = statistics.median(r["per_token"] for r in rs)
                row += [f"{1e3 * t:.1f}", f"{t / base[name]:.2f}", str(rs[-1]["reasoning_tokens"]),
                        str(rs[-1]["tokens"])]
            rows.append(row)
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)

    import torch

    print(f"# bench_thinking: {time.strftime('%Y-%m-%d')}, {platform.node()}, {os.cpu_count()} CPUs, "
          f"torch {torch.__version__}, model {args.model_path}, max_tokens {args.max_tokens}, "
          f"median of {args.repeats}\n")
    print("| request | ours ms/token | ours / baseline | ours reasoning tokens | ours tokens "
          "| upstream ms/token | upstream / baseline | upstream reasoning tokens | upstream tokens |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    from sglang_dsv4.launch_server import cache_dir
    from sglang_dsv4.tiny import ensure_tiny

    model_dir = str(ensure_tiny(args.model_path, 0, cache_dir())) if args.model_path in ("micro", "tiny") \
        else args.model_path
    micro = {b: grammar_microbench(model_dir, b, 300) for b in (16, 256)}
    print("\nGrammar work alone, in-process (mask fill + accept, us per token, thinking phase, random walk):\n")
    print("| budget | ours (structural tag) | upstream (strict-thinking filter) | ours / upstream |")
    print("|---|---|---|---|")
    for b, m in micro.items():
        print(f"| {b} | {m['ours']:.1f} | {m['upstream']:.1f} | {m['ours'] / m['upstream']:.2f} |")


if __name__ == "__main__":
    main()
