"""End-to-end: the micro V4 served with tensor + expert parallelism (``--tp-size 2 --ep-size 2``,
two CPU ranks over gloo) and FlashMLA's fp8 cache layout (``--dsv4-attention-backend torch-fp8``,
the GPU server's storage, read by the kernels' torch reference): greedy outputs equal the
single-process core's, and a chat's second turn resumes from the first turn's finish snapshot.
The same with data-parallel attention x expert parallelism (``--attn-dp-size 2``): each rank
serves its own requests with its own cache and radix tree, the MoE runs over both ranks' tokens."""

from __future__ import annotations

import random

import pytest
import torch

from sglang_dsv4.core.cache import V4Cache
from sglang_dsv4.core.model import V4Model

from test_server_e2e import running_servers

PARALLEL_ARGS = ["--tp-size", "2", "--ep-size", "2", "--dsv4-attention-backend", "torch-fp8"]


DP_ARGS = ["--tp-size", "2", "--attn-dp-size", "2", "--ep-size", "2", "--dsv4-attention-backend", "torch-fp8"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    with running_servers(tmp_path_factory.mktemp("parallel"), ("tp2_ep2_fp8", PARALLEL_ARGS, None),
                         ("dp2_ep2_fp8", DP_ARGS, None)) as both:
        yield both


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


@pytest.fixture(scope="module")
def dp_server(servers):
    return servers[1]


def _greedy(model: V4Model, cfg, prompt: list[int], steps: int) -> list[int]:
    """The single-process core, same storage format, prefill in one chunk then decode."""
    cache = V4Cache(cfg, max_requests=1, max_total_tokens=4096, backend="torch-fp8")
    req = cache.new_request()
    logits = model.forward(cache, [req], [torch.tensor(prompt)])[0][-1]
    out = []
    for _ in range(steps):
        out.append(int(logits.argmax()))
        logits = model.forward(cache, [req], [torch.tensor(out[-1:])])[0][-1]
    return out


def test_ranks_load_their_shards_and_the_cache_is_fp8(server):
    log = server.log()
    assert "rank tp 0/2 ep 0/2" in log and "rank tp 1/2 ep 1/2" in log
    assert "sglang_dsv4 memory: attention torch-fp8" in log


def test_parallel_server_matches_the_single_process_core_and_resumes_turns(server, micro):
    cfg, w = micro
    model = V4Model(cfg, w)
    rng = random.Random(7)
    for n in (40, 300):
        prompt = [0] + [rng.randrange(100, 120000) for _ in range(n)]
        first = server.generate(prompt, max_new_tokens=12)
        assert first["output_ids"] == _greedy(model, cfg, prompt, 12), f"prompt of {n + 1} tokens"
        # the next turn: the whole history is cached up to the first turn's last token
        second_prompt = prompt + first["output_ids"] + [rng.randrange(100, 120000) for _ in range(5)]
        second = server.generate(second_prompt, max_new_tokens=8)
        assert second["meta_info"]["cached_tokens"] == len(prompt) + len(first["output_ids"]) - 1
        assert second["output_ids"] == _greedy(model, cfg, second_prompt, 8)


def test_dp_attention_server_matches_the_single_process_core_and_resumes_turns(dp_server, micro):
    """Requests on both ranks at once (one idle while the other decodes, steps of different
    lengths), then each conversation's next turn on the rank that holds its history."""
    from concurrent.futures import ThreadPoolExecutor

    log = dp_server.log()
    assert "rank tp 0/1 ep 0/2 (data-parallel attention over 2 ranks)" in log
    assert "rank tp 0/1 ep 1/2 (data-parallel attention over 2 ranks)" in log
    cfg, w = micro
    model = V4Model(cfg, w)
    rng = random.Random(11)
    prompts = [[0] + [rng.randrange(100, 120000) for _ in range(n)] for n in (40, 300, 7)]
    steps = [12, 5, 9]
    with ThreadPoolExecutor(3) as pool:
        firsts = list(pool.map(lambda a: dp_server.generate(a[0], max_new_tokens=a[1], routed_dp_rank=a[2]),
                               zip(prompts, steps, [0, 1, 1])))
    for prompt, n, first in zip(prompts, steps, firsts):
        assert first["output_ids"] == _greedy(model, cfg, prompt, n), f"prompt of {len(prompt)} tokens"
    for prompt, first, rank in zip(prompts[:2], firsts[:2], [0, 1]):
        second_prompt = prompt + first["output_ids"] + [rng.randrange(100, 120000) for _ in range(5)]
        second = dp_server.generate(second_prompt, max_new_tokens=8, routed_dp_rank=rank)
        assert second["meta_info"]["cached_tokens"] == len(prompt) + len(first["output_ids"]) - 1
        assert second["output_ids"] == _greedy(model, cfg, second_prompt, 8)
