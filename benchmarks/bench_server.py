"""Server latency on CPU: startup, time to first token with and without a cache hit, and the
cached-token ratio of a short multi-turn chat. Prints a table.

    python benchmarks/bench_server.py [--model-path micro] [--prompt-len 3000] [--turns 5]

Starts `python -m sglang_dsv4.launch_server` itself (radix cache on) and stops it at the end.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import time

import requests

from sglang_dsv4.ports import free_port


def ttft(url: str, ids: list[int], max_new_tokens: int = 8) -> tuple[float, list[int], int]:
    """(seconds to the first streamed token, output ids, cached tokens)."""
    body = {"input_ids": ids, "stream": True, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens}}
    start, first, last = time.perf_counter(), None, None
    with requests.post(url + "/generate", json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                first = first or time.perf_counter()
                last = line
    import json

    meta = json.loads(last[6:])
    return first - start, meta["output_ids"], meta["meta_info"]["cached_tokens"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default="micro")
    parser.add_argument("--prompt-len", type=int, default=3000)
    parser.add_argument("--turns", type=int, default=5)
    args = parser.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "sglang_dsv4.launch_server", "--model-path", args.model_path,
                             "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        while True:
            try:
                if requests.get(url + "/health", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if proc.poll() is not None or time.perf_counter() - t0 > 900:
                raise SystemExit("server did not start")
            time.sleep(1)
        startup = time.perf_counter() - t0
        rng = random.Random(0)
        prompt = [0] + [rng.randrange(100, 120000) for _ in range(args.prompt_len - 1)]
        cold, out, cached_cold = ttft(url, prompt)
        follow = prompt + out + [rng.randrange(100, 120000) for _ in range(20)]
        warm, _, cached_warm = ttft(url, follow)
        # a short multi-turn chat: each turn appends a 12-token user message to the history
        history, total_prompt, total_cached = [0] + [rng.randrange(100, 120000) for _ in range(60)], 0, 0
        for _ in range(args.turns):
            history += [rng.randrange(100, 120000) for _ in range(12)]
            _, out, cached = ttft(url, history, max_new_tokens=16)
            total_prompt, total_cached = total_prompt + len(history), total_cached + cached
            history += out
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    print(f"| measurement | value |\n|---|---|")
    print(f"| startup (launch to /health ok) | {startup:.1f} s |")
    print(f"| TTFT, cold {len(prompt)}-token prompt (cached {cached_cold}) | {cold * 1e3:.0f} ms |")
    print(f"| TTFT, next turn of {len(follow)} tokens (cached {cached_warm}) | {warm * 1e3:.0f} ms |")
    print(f"| TTFT ratio cold / hit | {cold / warm:.1f}x |")
    print(f"| multi-turn ({args.turns} turns) cached-token ratio | {total_cached}/{total_prompt} = "
          f"{total_cached / total_prompt:.3f} |")


if __name__ == "__main__":
    main()
