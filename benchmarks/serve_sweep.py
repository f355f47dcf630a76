"""Throughput and latency of a running server at several concurrencies (random token prompts).

    python -m benchmarks.serve_sweep --port 30000 [--concurrency 1,8,64] [--input-len 512]
        [--output-len 64] [--requests-per-client 4] [--label NAME] [--no-warmup]
        [--hit-lengths 1024,16384,65536] [--hit-new 32] [--hits-first]

Each client thread streams ``/generate`` requests back to back (greedy, ``ignore_eos``), prompts
of random token ids (distinct per request, so no prefix is shared). Prints one markdown row per
concurrency: output tok/s over the wall time; per request, as SGLang's ``bench_serving`` defines
them, TTFT (time to the first streamed token), TPOT ((e2e - TTFT) / (output tokens - 1): the
decode steps alone, the prefill left out) and the median inter-token latency (ITL) over all
requests' gaps between streamed chunks; mean e2e latency; per forward step, the reads of device
values our cache made (on a GPU each a host sync: under SGLang's overlap scheduler it waits for the
step in flight) and the ms the host spent in them (``/server_info``'s ``dsv4_cache`` counters). Each concurrency is timed after one short
untimed round at that concurrency (`--no-warmup`: cold), so graph captures and compiles of a new
batch size on a GPU server are not in its numbers.

``--hit-lengths``: then, for each prompt length, TTFT of that prompt cold (one output token) and
of the same prompt with ``--hit-new`` new tokens after it (a cache hit: the cold request's finish
snapshot is at its prompt's end), each measured twice after an untimed pair at that length, with
the cached tokens SGLang reports (after the concurrencies; ``--hits-first``: before them).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
import urllib.request


def _stream(port: int, body: dict) -> dict:
    """One streamed ``/generate``: the last chunk's ``meta_info`` with ``ttft`` (s), ``e2e`` (s)
    and ``gaps`` (s between chunks that each bring new tokens) measured here."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    start = time.perf_counter()
    arrivals, tokens, meta = [], 0, None
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "meta_info" not in chunk:  # e.g. a prompt over the model's context length
                raise RuntimeError(f"the server answered {chunk}")
            meta = chunk["meta_info"]
            if meta["completion_tokens"] > tokens:
                tokens = meta["completion_tokens"]
                arrivals.append(time.perf_counter())
    if meta is None or not arrivals:
        raise RuntimeError("the server streamed no tokens")
    return {**meta, "ttft": arrivals[0] - start, "e2e": arrivals[-1] - start,
            "gaps": [b - a for a, b in zip(arrivals, arrivals[1:])]}


def cache_counters(port: int) -> dict | None:
    """Our cache's counters from ``/server_info`` (``internal_states[0]["dsv4_cache"]``, with
    SGLang's forward step count); None for a server without them (upstream's V4)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=60) as r:
        states = json.load(r).get("internal_states") or [{}]
    return states[0].get("dsv4_cache")


def host_waits(before: dict | None, after: dict | None) -> str:
    """'reads / ms' per forward step between two ``cache_counters``: the cache's reads of device
    values (each a host sync on a GPU, which under the overlap scheduler waits for the step in
    flight) and its waits for the copies of frees and publishes (``copy_waits``: a pool ran
    short), and the time the host spent in them."""
    if not before or not after or "host_reads" not in after:
        return "-"
    steps = max(after["forward_steps"] - before["forward_steps"], 1)
    reads = sum(after.get(k, 0) - before.get(k, 0) for k in ("host_reads", "copy_waits"))
    return (f"{reads / steps:.2f} / "
            f"{(after['host_read_ms'] - before['host_read_ms']) / steps:.3f}")


def sweep(port: int, concurrency: int, input_len: int, output_len: int, per_client: int, seed: int) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000, 100000) for _ in range(input_len)] for _ in range(concurrency * per_client)]
    results: list[dict] = []
    lock = threading.Lock()

    def client(k: int) -> None:
        for i in range(per_client):
            r = _stream(port, {"input_ids": prompts[k * per_client + i],
                               "sampling_params": {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True}})
            with lock:
                results.append(r)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(concurrency)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t
    if len(results) != len(threads) * per_client:
        raise RuntimeError(f"{len(threads) * per_client - len(results)} requests failed (see above)")
    out = sum(m["completion_tokens"] for m in results)
    decoded = [m for m in results if m["completion_tokens"] > 1]
    gaps = [g for m in results for g in m["gaps"]]
    return {"tok_s": out / wall,
            "ttft_ms": 1e3 * statistics.fmean(m["ttft"] for m in results),
            "tpot_ms": 1e3 * statistics.fmean((m["e2e"] - m["ttft"]) / (m["completion_tokens"] - 1) for m in decoded)
            if decoded else float("nan"),
            "itl_ms": 1e3 * statistics.median(gaps) if gaps else float("nan"),
            "e2e_s": statistics.fmean(m["e2e"] for m in results), "requests": len(results)}


def hit_ttft(port: int, length: int, new: int, seed: int) -> dict:
    """TTFT (ms) of a ``length``-token prompt cold and then of it plus ``new`` tokens (a hit)."""
    rng = random.Random(seed)
    prompt = [rng.randrange(1000, 100000) for _ in range(length)]
    more = [rng.randrange(1000, 100000) for _ in range(new)]
    one = {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}
    cold = _stream(port, {"input_ids": prompt, "sampling_params": one})
    hit = _stream(port, {"input_ids": prompt + more, "sampling_params": one})
    return {"cold_ms": 1e3 * cold["ttft"], "hit_ms": 1e3 * hit["ttft"], "cached": hit["cached_tokens"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--concurrency", default="1,8,64")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--requests-per-client", type=int, default=3)
    ap.add_argument("--label", default="")
    ap.add_argument("--no-warmup", action="store_true",
                    help="time each concurrency cold (default: one short untimed round first, so a GPU "
                         "server's graph captures and compiles for that batch size are not timed)")
    ap.add_argument("--hit-lengths", default="", help="prompt lengths for cold vs cache-hit TTFT, e.g. 1024,16384")
    ap.add_argument("--hit-new", type=int, default=32, help="new tokens after the cached prompt")
    ap.add_argument("--hits-first", action="store_true",
                    help="the cache-hit rows before the concurrency sweep (a call that may run out of "
                         "time keeps the hit rows, which are short)")
    args = ap.parse_args(argv)
    sweep(args.port, 2, 32, 8, 1, seed=99)  # warm-up: first captures, allocator growth
    if args.hits_first:
        hit_rows(args)
    print("| server | concurrency | output tok/s | TTFT ms | TPOT ms | ITL ms (median) | e2e s | requests "
          "| cache host reads / ms per step |\n|---|---|---|---|---|---|---|---|---|")
    for c in (int(x) for x in args.concurrency.split(",")):
        if not args.no_warmup:
            sweep(args.port, c, args.input_len, min(args.output_len, 16), 1, seed=10_000 + c)
        before = cache_counters(args.port)
        r = sweep(args.port, c, args.input_len, args.output_len, args.requests_per_client, seed=c)
        waits = host_waits(before, cache_counters(args.port))
        print(f"| {args.label} | {c} | {r['tok_s']:.1f} | {r['ttft_ms']:.1f} | {r['tpot_ms']:.2f} | {r['itl_ms']:.2f} "
              f"| {r['e2e_s']:.2f} | {r['requests']} | {waits} |", flush=True)
    if not args.hits_first:
        hit_rows(args)
    return 0


def hit_rows(args: argparse.Namespace) -> None:
    """The cold vs cache-hit TTFT table, one row per ``--hit-lengths`` prompt length."""
    if not args.hit_lengths:
        return
    print(f"\n| server | prompt tokens | TTFT cold ms | TTFT hit ms (+{args.hit_new} new) | cached tokens |\n"
          "|---|---|---|---|---|")
    for n in (int(x) for x in args.hit_lengths.split(",")):
        hit_ttft(args.port, n, args.hit_new, seed=20_000 + n)  # untimed: this length's compiles
        runs = [hit_ttft(args.port, n, args.hit_new, seed=30_000 + n + k) for k in range(2)]
        print(f"| {args.label} | {n} | {statistics.fmean(r['cold_ms'] for r in runs):.1f} "
              f"| {statistics.fmean(r['hit_ms'] for r in runs):.1f} | {runs[-1]['cached']} |", flush=True)
    print(flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
