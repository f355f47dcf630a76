"""What every simulated policy reports, the V4-Flash byte costs, and the shared replay loop."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

from sglang_dsv4.config import V4Config
from sglang_dsv4.memory import cache_bytes

from .traces import Request

GIB = 1 << 30
H200_CHUNK = 8192  # SGLang 0.5.23's chunked_prefill_size for a 140 GB GPU (arg_groups/memory_hook.py)


@dataclass(frozen=True)
class V4Costs:
    """Byte costs of V4-Flash's caches (fp8 layout) for both policies."""
    ours_token: float        # compressed entries + indexer keys, per cached token
    ours_snapshot: int       # window ring (fp8) + compressor state: one snapshot, or one running ring
    up_full_token: float     # upstream FULL: C4 KV 146.25 + indexer 33 per c4 layer, C128 6.75 per c128 layer
    up_swa_token: float      # upstream SWA: 585 per layer + C4 state share 320 per c4 layer

    @classmethod
    def flash(cls) -> "V4Costs":
        cfg = V4Config()
        b = cache_bytes(cfg, "fp8")
        n4, n128, n = b.num_c4_layers, b.num_c128_layers, cfg.num_hidden_layers
        return cls(b.compressed_bytes_per_token, b.snapshot_bytes,
                   179.25 * n4 + 6.75 * n128, 585.0 * n + 320.0 * n4)


@dataclass
class Outcome:
    """Per-trace results of one policy at one budget."""
    policy: str
    cached: list[int] = field(default_factory=list)        # cached prompt tokens, per request
    prompt_tokens: int = 0
    resume_points: int | None = None                        # distinct resume points held at the end
    followup_hit: int = 0      # at the end: tokens a follow-up to each request's history would reuse
    followup_total: int = 0    # ... out of the histories' lengths

    @property
    def hit_tokens(self) -> int:
        return sum(self.cached)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def recomputed(self) -> int:
        return self.prompt_tokens - self.hit_tokens

    @property
    def retained(self) -> float:
        return self.followup_hit / self.followup_total if self.followup_total else 0.0


class Policy(Protocol):
    """A cache policy served one request at a time."""
    name: str

    def serve(self, req: Request) -> int:
        """Serve ``req`` (prefill, decode, finish); return its cached prompt tokens."""

    def resumable(self, history: tuple[int, ...]) -> int:
        """Tokens a follow-up request extending ``history`` by one token would reuse now."""

    def resume_points(self) -> int | None:
        """Distinct resume points held now (None where the policy has no such notion)."""


def replay(policy: Policy, trace: Sequence[Request]) -> Outcome:
    """Serve ``trace`` in order through ``policy`` and collect its ``Outcome``."""
    out = Outcome(policy.name)
    for req in trace:
        out.cached.append(policy.serve(req))
        out.prompt_tokens += len(req.prompt)
    seen: set[tuple[int, ...]] = set()
    for req in trace:
        if req.history in seen:
            continue
        seen.add(req.history)
        out.followup_hit += policy.resumable(req.history)
        out.followup_total += len(req.history)
    out.resume_points = policy.resume_points()
    return out


class NoCache:
    """No prefix cache: every prompt token is computed."""
    name = "none"

    def serve(self, req: Request) -> int:
        return 0

    def resumable(self, history: tuple[int, ...]) -> int:
        return 0

    def resume_points(self) -> int | None:
        return 0
