"""Think budgets: ours (grammar-bounded, the plugin) vs upstream's --enable-strict-thinking, side by side.

    python -m benchmarks.bench_thinking [--model-path micro] [--repeats 2] [--max-tokens 64] [--in-process-only]

Starts two servers of the same model in one run: ours (``--reasoning-parser deepseek-v4``) and
upstream's mode (the same plus ``--enable-strict-thinking``; our hooks stand aside there), sends
the very same chat requests to both (thinking on, ``custom_params.thinking_budget``, with and
without a JSON schema, interleaved A/B), and prints per request: decode time per output token
(streamed: last chunk - first chunk over tokens - 1, median of the repeats), the ratio to an
unbudgeted thinking request on the same server, and the usage's reasoning tokens (the bound
itself is checked exactly in tests/srt/test_thinking_server.py).

The in-process part (``--in-process-only`` runs it alone) times the grammar work itself with the
real V4 tokenizer and the real SGLang grammar objects of both servers: per think token at budgets
16 / 256 / 2048 / 8192 / 32768 / unbounded, with and without a JSON-schema answer; per answer
token; grammar set-up per request; and one decode step's mask work for 64 requests.
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
from typing import Optional

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


BUDGETS = (16, 256, 2048, 8192, 32768, None)
WINDOW = 100  # timed tokens per window; windows at the start, middle and end of the think section
BATCH = 64


def _grammars(model_dir: str):
    """The real scheduler-side objects, built as each server builds them: SGLang's xgrammar backend
    (with our __init__ hook), wrapped by SGLang's ReasonerGrammarBackend for --reasoning-parser
    deepseek-v4, without (ours) and with (upstream) --enable-strict-thinking."""
    from sglang.srt.constrained.reasoner_grammar_backend import ReasonerGrammarBackend
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend
    from sglang.srt.parser.reasoning_parser import ReasoningParser
    from transformers import AutoTokenizer

    from sglang_dsv4.srt import thinking as th
    from sglang_dsv4.srt import thinking_grammar as tg

    tok = AutoTokenizer.from_pretrained(model_dir)
    backend = XGrammarGrammarBackend(tok, vocab_size=129280, model_eos_token_ids=[1])
    tg.prepare_backend(None, backend, tok)
    parser = ReasoningParser(model_type="deepseek-v4", stream_reasoning=False, tokenizer=tok)
    ours_wrap = ReasonerGrammarBackend(backend, parser, tok, enable_strict_thinking=False)
    strict = ReasonerGrammarBackend(backend, parser, tok, enable_strict_thinking=True)
    specials = th.special_token_ids(tok)
    closing = tok.encode(th.DEFAULT_CLOSING_TEXT, add_special_tokens=False)

    def ours_key(budget, schema: Optional[str]) -> Optional[str]:
        """The HTTP side's work: the grammar key (None where our server builds no grammar:
        unbounded thinking with a free answer)."""
        if budget is None and schema is None:
            return None
        answer = th.answer_format(json_schema=schema, max_whitespace=1)
        return th.ThinkBound.make(budget, answer, special_ids=specials, closing_ids=closing).to_key()

    def ours_dispatch(key: Optional[str]):
        """The scheduler's work: dispatch the key, wrap as SGLang does, serve a copy."""
        if key is None:
            return None
        g = tg.dispatch_structural_tag(XGrammarGrammarBackend.dispatch_structural_tag, backend, key)
        obj = ours_wrap._make_grammar_object(g.copy(), True)
        obj.set_reasoning_in_grammar()  # what our HTTP side asks for (custom_params)
        return obj

    def ours(budget, schema: Optional[str]):
        return ours_dispatch(ours_key(budget, schema))

    def upstream(budget, schema: Optional[str]):
        if schema is None:
            obj = strict.init_strict_reasoning_grammar(True)
        else:
            obj = strict._init_value_dispatch(("json", schema), True)
        obj.max_think_tokens = -1 if budget is None else budget  # GrammarManager's per-request budget
        return obj

    ours.key, ours.dispatch = ours_key, ours_dispatch
    return tok, ours, upstream


def _allowed(mask, row: int, token: int) -> bool:
    return bool((int(mask[row, token >> 5]) >> (token & 31)) & 1)


def _pick(mask, row: int, rng) -> int:
    """A random allowed token: an ordinary token when allowed (cheap), else the first allowed one."""
    import torch

    token = rng.randrange(1000, 120000)
    if _allowed(mask, row, token):
        return token
    bits = (mask[row].unsqueeze(-1) >> torch.arange(32)) & 1
    return int(torch.nonzero(bits.flatten()[:129280])[0])


def think_cost_us(make, budget, schema, rng) -> Optional[float]:
    """Median microseconds per think token of fill mask + accept, over windows at the start,
    middle and end of the think section (positions in between are accepted untimed). The median,
    not the mean: on a shared 2-core machine preemptions land on single tokens."""
    import xgrammar as xgr

    g = make(budget, schema)
    if g is None:
        return None
    mask = xgr.allocate_token_bitmask(1, 129280)
    span = 32768 + 2 * WINDOW if budget is None else budget
    starts = sorted({0, max(0, span // 2 - WINDOW // 2), max(0, span - WINDOW)})
    pos, samples = 0, []
    for start in starts:
        while pos < start:  # untimed: ordinary tokens are allowed until the closing text
            g.accept_token(4910)
            pos += 1
        for _ in range(min(WINDOW, span - pos)):
            t = time.perf_counter()
            g.fill_vocab_mask(mask, 0)
            spent = time.perf_counter() - t
            token = _pick(mask, 0, rng)
            t = time.perf_counter()
            g.accept_token(token)
            samples.append(spent + time.perf_counter() - t)
            pos += 1
            if token == 128822:
                return 1e6 * statistics.median(samples)
    return 1e6 * statistics.median(samples)


def answer_cost_us(make, schema, rng) -> float:
    """Median microseconds per answer token (budget 16, then a random walk of the answer)."""
    import xgrammar as xgr

    g = make(16, schema)
    mask = xgr.allocate_token_bitmask(1, 129280)
    while True:  # think until </think>, untimed
        g.fill_vocab_mask(mask, 0)
        token = _pick(mask, 0, rng)
        g.accept_token(token)
        if token == 128822:
            break
    samples = []
    for _ in range(64):
        t = time.perf_counter()
        g.fill_vocab_mask(mask, 0)
        spent = time.perf_counter() - t
        token = _pick(mask, 0, rng) if schema is not None else rng.randrange(1000, 120000)
        t = time.perf_counter()
        g.accept_token(token)
        samples.append(spent + time.perf_counter() - t)
        if g.is_terminated():
            break
    return 1e6 * statistics.median(samples)


def init_ms(ours, upstream, schema_of) -> dict[str, tuple[float, float, float]]:
    """Per-request grammar set-up on the scheduler (ms, median of 5, budget 2048): a schema never
    seen (compile), a seen schema with a new budget (ours compiles nothing then; upstream's key
    does not carry the budget), a cache hit (SGLang serves a copy). Ours also pays, on the HTTP
    side and off the scheduler, the key and the answer's validation: the last column."""
    out = {}
    for name in ("ours", "upstream"):
        cold, new_budget, hit, http = [], [], [], []
        for i in range(5):
            fresh, warm = schema_of(f"cold{i}_{time.time_ns()}"), schema_of("warm")
            if name == "ours":
                t = time.perf_counter()
                key = ours.key(2048 + i, fresh)
                http.append(time.perf_counter() - t)
                t = time.perf_counter()
                g = ours.dispatch(key)
                cold.append(time.perf_counter() - t)
                key = ours.key(2148 + i, warm)
                t = time.perf_counter()
                ours.dispatch(key)
                new_budget.append(time.perf_counter() - t)
            else:
                t = time.perf_counter()
                g = upstream(2048 + i, fresh)
                cold.append(time.perf_counter() - t)
                t = time.perf_counter()
                upstream(2148 + i, warm)
                new_budget.append(time.perf_counter() - t)
                http.append(0.0)
            t = time.perf_counter()
            g.copy()
            hit.append(time.perf_counter() - t)
        out[name] = tuple(1e3 * statistics.median(v) for v in (cold, new_budget, hit, http))
    return out


def batch_step_us(make, schema, rng) -> float:
    """One decode step's mask work for BATCH requests in their think sections (mixed budgets and
    positions): SGLang's fill_vocab_mask_batched over the batch's rows, then each row's accept."""
    import xgrammar as xgr
    from sglang.srt.constrained.base_grammar_backend import BaseGrammarObject, GrammarRow

    grammars = {}
    for row in range(BATCH):
        g = make(BUDGETS[row % len(BUDGETS)], schema)
        if g is None:  # ours builds no grammar for unbounded thinking with a free answer: no row work
            continue
        for _ in range(rng.randrange(0, 12)):
            g.accept_token(4910)
        grammars[row] = g
    mask = xgr.allocate_token_bitmask(BATCH, 129280)
    spent = []
    for _ in range(10):
        entries = [GrammarRow(row=r, grammar=g) for r, g in grammars.items()]
        t = time.perf_counter()
        BaseGrammarObject.fill_vocab_mask_batched(entries, mask)
        spent_fill = time.perf_counter() - t
        tokens = {r: _pick(mask, r, rng) for r in grammars}
        t = time.perf_counter()
        for r, g in grammars.items():
            g.accept_token(tokens[r])
        spent.append(spent_fill + time.perf_counter() - t)
    return 1e6 * statistics.median(spent)


def in_process_tables(model_dir: str) -> None:
    """Print the grammar-work tables (mask fill + accept, real tokenizer, no server)."""
    import random

    tok, ours, upstream = _grammars(model_dir)
    schema = json.dumps(SCHEMA)
    load = os.getloadavg()[0]
    print(f"\n## Grammar work in-process ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs, "
          f"load average {load:.1f} at start)\n")
    print(f"Think section, us per token (mask fill + accept, median), windows of {WINDOW} tokens at "
          "its start, middle and end; the answer's grammar waits for </think>:\n")
    print("| budget | ours | upstream | ours / upstream | ours + JSON answer | upstream + JSON answer "
          "| ours / upstream (JSON) |")
    print("|---|---|---|---|---|---|---|")
    rng = random.Random(0)
    for budget in BUDGETS:
        row = ["unbounded" if budget is None else str(budget)]
        for answer in (None, schema):
            mine, theirs = think_cost_us(ours, budget, answer, rng), think_cost_us(upstream, budget, answer, rng)
            row += ["0 (no grammar)" if mine is None else f"{mine:.1f}", f"{theirs:.1f}",
                    "0" if mine is None else f"{mine / theirs:.2f}"]
        print("| " + " | ".join(row) + " |")
    print("\nAnswer phase, us per token (median, after </think>):\n")
    print("| answer | ours | upstream |")
    print("|---|---|---|")
    for label, answer in (("free text", None), ("JSON schema", schema)):
        print(f"| {label} | {answer_cost_us(ours, answer, rng):.1f} "
              f"| {answer_cost_us(upstream, answer, rng):.1f} |")
    print("\nGrammar set-up per request, ms (median of 5; JSON-schema answer, budget 2048):\n")
    print("| | scheduler: new schema (compile) | scheduler: seen schema, new budget "
          "| scheduler: cache hit (copy) | HTTP side: key + answer validation |")
    print("|---|---|---|---|---|")

    def schema_of(tag: str) -> str:
        return json.dumps({**SCHEMA, "properties": {**SCHEMA["properties"], tag: {"type": "integer"}}})

    for name, values in init_ms(ours, upstream, schema_of).items():
        print(f"| {name} | " + " | ".join(f"{v:.2f}" for v in values) + " |")
    print(f"\nOne decode step's mask work on the CPU, {BATCH} requests thinking (budgets "
          f"{', '.join('unbounded' if b is None else str(b) for b in BUDGETS)} in turn), us per step "
          "(median of 10):\n")
    print("| answer | ours | upstream | ours / upstream |")
    print("|---|---|---|---|")
    for label, answer in (("free text", None), ("JSON schema", schema)):
        mine, theirs = batch_step_us(ours, answer, rng), batch_step_us(upstream, answer, rng)
        print(f"| {label} | {mine:.0f} | {theirs:.0f} | {mine / theirs:.2f} |")


def server_table(args) -> None:
    """Both servers, the same streamed chat requests interleaved; print decode time per token."""
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
    print(f"## Servers: model {args.model_path}, max_tokens {args.max_tokens}, median of {args.repeats}\n")
    print("| request | ours ms/token | ours / baseline | ours reasoning tokens | ours tokens "
          "| upstream ms/token | upstream / baseline | upstream reasoning tokens | upstream tokens |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default="micro")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--port", type=int, default=31720)
    parser.add_argument("--log-dir", default="/tmp")
    parser.add_argument("--in-process-only", action="store_true",
                        help="only the grammar-work tables (no servers)")
    args = parser.parse_args()
    import torch

    print(f"# bench_thinking: {time.strftime('%Y-%m-%d')}, {platform.node()}, {os.cpu_count()} CPUs, "
          f"torch {torch.__version__}\n")
    if not args.in_process_only:
        server_table(args)
    from sglang_dsv4.launch_server import cache_dir
    from sglang_dsv4.tiny import ensure_tiny

    model_dir = str(ensure_tiny(args.model_path, 0, cache_dir())) if args.model_path in ("micro", "tiny") \
        else args.model_path
    in_process_tables(model_dir)


if __name__ == "__main__":
    main()
