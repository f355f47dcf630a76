"""Throughput and latency of a running server at several concurrencies (random token prompts).

    python -m benchmarks.serve_sweep --port 30000 [--concurrency 1,8,64] [--input-len 512]
        [--output-len 64] [--requests-per-client 4] [--label NAME]

Each client thread sends ``/generate`` requests back to back (greedy, ``ignore_eos``), prompts of
random token ids (distinct per request, so no prefix is shared). Prints one markdown row per
concurrency: output tok/s over the wall time, mean time per output token of a request (TPOT:
e2e latency / output tokens), and mean e2e latency.
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
import urllib.request


def _post(port: int, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=600))


def sweep(port: int, concurrency: int, input_len: int, output_len: int, per_client: int, seed: int) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000, 100000) for _ in range(input_len)] for _ in range(concurrency * per_client)]
    results: list[dict] = []
    lock = threading.Lock()

    def client(k: int) -> None:
        for i in range(per_client):
            r = _post(port, {"input_ids": prompts[k * per_client + i],
                             "sampling_params": {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True}})
            with lock:
                results.append(r["meta_info"])

    threads = [threading.Thread(target=client, args=(k,)) for k in range(concurrency)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t
    out = sum(m["completion_tokens"] for m in results)
    return {"tok_s": out / wall, "tpot_ms": 1e3 * sum(m["e2e_latency"] / m["completion_tokens"] for m in results) / len(results),
            "e2e_s": sum(m["e2e_latency"] for m in results) / len(results), "requests": len(results)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--concurrency", default="1,8,64")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--requests-per-client", type=int, default=3)
    ap.add_argument("--label", default="")
    args = ap.parse_args(argv)
    sweep(args.port, 2, 32, 8, 1, seed=99)  # warm-up: first captures, allocator growth
    print("| server | concurrency | output tok/s | TPOT ms | e2e s | requests |\n|---|---|---|---|---|---|")
    for c in (int(x) for x in args.concurrency.split(",")):
        r = sweep(args.port, c, args.input_len, args.output_len, args.requests_per_client, seed=c)
        print(f"| {args.label} | {c} | {r['tok_s']:.1f} | {r['tpot_ms']:.2f} | {r['e2e_s']:.2f} | {r['requests']} |",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
