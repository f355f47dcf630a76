"""Agreement of ``OursSim`` with the real server: replay a short trace (lengths scaled to the micro
model's 4096-token context) through a running ``sglang_dsv4`` server, then through the simulator
with the server's own outputs, and compare ``meta_info.cached_tokens`` request by request.

Run: ``python -m benchmarks.prefix_sim.agree --url http://127.0.0.1:PORT`` against
``python -m sglang_dsv4.launch_server --model-path micro --port PORT --dsv4-snapshot-budget-mb 64``.
"""

from __future__ import annotations

import argparse
import sys

import requests

from .common import GIB
from .ours import OursSim
from .traces import (BOS, History, Request, RequestSpec, Tokens, TokenSource, realize)

SERVER_CHUNK = 2048  # sglang_dsv4.launch_server's --chunked-prefill-size on CPU


def short_trace(seed: int = 7) -> list[RequestSpec]:
    """Every snapshot kind in a few requests: chat turns (finish snapshots), a shared system prompt
    left at two divergence points, a fork (max_new_tokens=0 prefill, then branches), n>1 as SGLang
    sends it (warm-up + copies), and a prompt longer than one server chunk (chunk-end snapshot)."""
    g = TokenSource(seed)
    system = g.tokens(300)
    specs: list[RequestSpec] = [
        RequestSpec((BOS, g.tokens(120), g.tokens(20)), 12, "chat0.0"),          # 0
        RequestSpec((History(0), g.tokens(15)), 12, "chat0.1"),                  # 1
        RequestSpec((History(1), g.tokens(9)), 8, "chat0.2"),                    # 2
        RequestSpec((BOS, system, g.tokens(30)), 8, "sys.a"),                    # 3
        RequestSpec((BOS, system, g.tokens(25)), 8, "sys.b: diverges at 301"),   # 4
        RequestSpec((BOS, system, g.tokens(40)), 8, "sys.c: hits 301"),          # 5
        RequestSpec((BOS, Tokens(system.ids[:150]), g.tokens(10)), 8, "sys.d: diverges at 151"),
        RequestSpec((BOS, Tokens(system.ids[:150]), g.tokens(12)), 8, "sys.e: hits 151"),
        RequestSpec((History(2), g.tokens(30)), 0, "fork point"),                # 8
        RequestSpec((History(8), g.tokens(7)), 6, "branch 0"),
        RequestSpec((History(8), g.tokens(5)), 6, "branch 1"),
        RequestSpec((BOS, g.tokens(90)), 0, "n>1 warm-up"),                      # 11
        RequestSpec((History(11),), 6, "n>1 copy 0"),
        RequestSpec((History(11),), 6, "n>1 copy 1"),
        RequestSpec((BOS, g.tokens(2500)), 4, "long: two chunks"),               # 14
        RequestSpec((History(14), g.tokens(10)), 4, "long: next turn"),
    ]
    return specs


class ServerOutputs:
    """An ``OutputFn`` that sends each request to the server and records ``cached_tokens``."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.cached: list[int] = []

    def __call__(self, index: int, prompt: tuple[int, ...], output_len: int) -> tuple[int, ...]:
        body = {"input_ids": list(prompt),
                "sampling_params": {"temperature": 0, "max_new_tokens": output_len, "ignore_eos": True}}
        r = requests.post(self.url + "/generate", json=body, timeout=600)
        r.raise_for_status()
        out = r.json()
        self.cached.append(int(out["meta_info"]["cached_tokens"]))
        return tuple(out["output_ids"])


def compare(url: str, seed: int = 7) -> list[tuple[str, int, int]]:
    """(tag, predicted, server) cached tokens for every request of ``short_trace`` (flushes the cache)."""
    requests.post(url.rstrip("/") + "/flush_cache", params={"timeout": 30}, timeout=60).raise_for_status()
    server = ServerOutputs(url)
    trace: list[Request] = realize(short_trace(seed), server)
    sim = OursSim(1024 * GIB, chunk=SERVER_CHUNK)
    predicted = [sim.serve(req) for req in trace]
    return [(req.tag, p, s) for req, p, s in zip(trace, predicted, server.cached)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    args = ap.parse_args(argv)
    rows = compare(args.url)
    bad = 0
    for tag, p, s in rows:
        bad += p != s
        print(f"{tag:28s} predicted {p:5d}  server {s:5d}  {'OK' if p == s else 'DIFF'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
