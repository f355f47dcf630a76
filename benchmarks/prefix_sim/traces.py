"""Token-level workload traces, reproducible from a seed.

A trace is a list of ``RequestSpec`` in arrival order. A spec's prompt is a sequence of segments:
literal token ids (``Tokens``) or the whole history (prompt + output) of an earlier request
(``History``), so a chat turn can extend the previous turn whatever that turn generated.
``realize`` turns specs into concrete ``Request`` (prompt ids, output ids), drawing output ids from
an ``OutputFn``: the seeded default for simulation, or a real server's outputs (agreement check).

Requests are served one at a time in arrival order (see benchmarks/README.md).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Sequence, Union

VOCAB_LO, VOCAB_HI = 100, 120000  # ordinary token ids of the V4 tokenizer


@dataclass(frozen=True)
class Tokens:
    """Literal token ids."""
    ids: tuple[int, ...]


@dataclass(frozen=True)
class History:
    """The prompt followed by the output of the earlier request with index ``index``."""
    index: int


Segment = Union[Tokens, History]


@dataclass(frozen=True)
class RequestSpec:
    """One request of a trace before its outputs are known."""
    segments: tuple[Segment, ...]
    output_len: int
    tag: str = ""


@dataclass(frozen=True)
class Request:
    """A concrete request: prompt ids and the ids it generates."""
    prompt: tuple[int, ...]
    output: tuple[int, ...]
    tag: str = ""

    @property
    def history(self) -> tuple[int, ...]:
        return self.prompt + self.output


OutputFn = Callable[[int, tuple[int, ...], int], tuple[int, ...]]  # (index, prompt, output_len) -> ids


def seeded_outputs(seed: int) -> OutputFn:
    """Output ids drawn from a generator seeded by (seed, request index): deterministic."""
    def fn(index: int, prompt: tuple[int, ...], output_len: int) -> tuple[int, ...]:
        rng = random.Random(seed * 1_000_003 + index)
        return tuple(rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(output_len))
    return fn


def realize(specs: Sequence[RequestSpec], outputs: OutputFn) -> list[Request]:
    """Concrete requests of ``specs``, asking ``outputs`` for each request's generated ids in order."""
    done: list[Request] = []
    for i, spec in enumerate(specs):
        prompt: list[int] = []
        for seg in spec.segments:
            if isinstance(seg, History):
                if not 0 <= seg.index < i:
                    raise ValueError(f"request {i}: History({seg.index}) is not an earlier request")
                prompt.extend(done[seg.index].history)
            else:
                prompt.extend(seg.ids)
        ids = tuple(prompt)
        done.append(Request(ids, tuple(outputs(i, ids, spec.output_len)), spec.tag))
    return done


class TokenSource:
    """Seeded token and length source shared by the workload builders."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def tokens(self, n: int) -> Tokens:
        return Tokens(tuple(self.rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(n)))

    def lognormal(self, median: float, sigma: float, lo: int, hi: int) -> int:
        return max(lo, min(hi, int(self.rng.lognormvariate(0.0, sigma) * median)))


BOS = Tokens((0,))


def multi_turn_chat(seed: int, sessions: int = 48, turns: int = 5, scale: float = 1.0) -> list[RequestSpec]:
    """ShareGPT-like chat: a short system prompt, short user turns (median ~60 tokens), answers of a
    few hundred tokens; sessions interleaved round-robin."""
    g = TokenSource(seed)
    s = lambda x: max(1, int(x * scale))  # noqa: E731
    specs: list[RequestSpec] = []
    last: list[int | None] = [None] * sessions
    for t in range(turns):
        for k in range(sessions):
            user = g.tokens(s(g.lognormal(60, 1.0, 4, 1500)))
            head = (BOS, g.tokens(s(g.lognormal(40, 0.5, 8, 400)))) if last[k] is None else (History(last[k]),)
            specs.append(RequestSpec(head + (user,), s(g.lognormal(250, 0.7, 8, 2000)), f"chat{k}.{t}"))
            last[k] = len(specs) - 1
    return specs


def agentic_sessions(seed: int, sessions: int = 12, turns: int = 16, scale: float = 1.0) -> list[RequestSpec]:
    """Long agentic sessions: a long system/tool preamble (~6k tokens), then tens of turns, each
    appending a tool output of thousands of tokens and generating a short tool call; sessions
    interleaved round-robin."""
    g = TokenSource(seed)
    s = lambda x: max(1, int(x * scale))  # noqa: E731
    specs: list[RequestSpec] = []
    last: list[int | None] = [None] * sessions
    for t in range(turns):
        for k in range(sessions):
            tool = g.tokens(s(g.lognormal(1500, 0.8, 50, 12000)))
            head = (BOS, g.tokens(s(6000)), g.tokens(s(300))) if last[k] is None else (History(last[k]),)
            specs.append(RequestSpec(head + (tool,), s(g.lognormal(150, 0.6, 16, 1500)), f"agent{k}.{t}"))
            last[k] = len(specs) - 1
    return specs


def shared_system_prompts(seed: int, groups: int = 8, per_group: int = 16, system_len: int = 4096,
                          question_len: int = 256, output_len: int = 128, scale: float = 1.0) -> list[RequestSpec]:
    """SGLang's generated-shared-prefix benchmark: ``groups`` system prompts, ``per_group`` questions
    each; requests arrive in a shuffled order."""
    g = TokenSource(seed)
    s = lambda x: max(1, int(x * scale))  # noqa: E731
    systems = [g.tokens(s(system_len)) for _ in range(groups)]
    specs = [RequestSpec((BOS, systems[i], g.tokens(s(question_len))), s(output_len), f"sys{i}.{j}")
             for i in range(groups) for j in range(per_group)]
    g.rng.shuffle(specs)
    return specs


def fork_trees(seed: int, programs: int = 6, depth: int = 3, fanout: int = 3, scale: float = 1.0) -> list[RequestSpec]:
    """Frontend-language programs that fork(n) at several depths: a context (~2k tokens), then at
    each depth every branch adds ~200 tokens and generates ~120, and the program forks again.
    A fork is sent as SGLang's frontend sends it: a max_new_tokens=0 prefill of the state at the
    fork point, then the branches."""
    g = TokenSource(seed)
    s = lambda x: max(1, int(x * scale))  # noqa: E731
    specs: list[RequestSpec] = []
    for p in range(programs):
        specs.append(RequestSpec((BOS, g.tokens(s(g.lognormal(2000, 0.5, 200, 8000)))), 0, f"fork{p}.root"))
        frontier = [len(specs) - 1]
        for d in range(depth):
            nxt = []
            for parent in frontier:
                children = []
                for b in range(fanout):
                    specs.append(RequestSpec((History(parent), g.tokens(s(g.lognormal(200, 0.5, 10, 1500)))),
                                             s(g.lognormal(120, 0.5, 4, 800)), f"fork{p}.d{d}.b{b}"))
                    children.append(len(specs) - 1)
                # the program continues from its first branch and forks there again
                if d + 1 < depth:
                    specs.append(RequestSpec((History(children[0]),), 0, f"fork{p}.d{d}.fork"))
                    nxt.append(len(specs) - 1)
            frontier = nxt
    return specs


def parallel_sampling(seed: int, prompts: int = 24, n: int = 4, scale: float = 1.0) -> list[RequestSpec]:
    """``n>1`` sampling as SGLang serves it: a max_new_tokens=0 warm-up prefill of the prompt, then
    ``n`` requests with the same prompt (prompts ~1.5k tokens, outputs ~400)."""
    g = TokenSource(seed)
    s = lambda x: max(1, int(x * scale))  # noqa: E731
    specs: list[RequestSpec] = []
    for p in range(prompts):
        prompt = (BOS, g.tokens(s(g.lognormal(1500, 0.6, 50, 8000))))
        specs.append(RequestSpec(prompt, 0, f"n{p}.warmup"))
        out = s(g.lognormal(400, 0.6, 8, 2000))
        specs += [RequestSpec(prompt, out, f"n{p}.{i}") for i in range(n)]
    return specs


WORKLOADS: dict[str, Callable[..., list[RequestSpec]]] = {
    "chat": multi_turn_chat,
    "agentic": agentic_sessions,
    "shared_prefix": shared_system_prompts,
    "fork_tree": fork_trees,
    "n_sampling": parallel_sampling,
}


def build(name: str, seed: int, scale: float = 1.0) -> list[Request]:
    """The realized workload ``name`` (one of ``WORKLOADS``) for ``seed``."""
    return realize(WORKLOADS[name](seed, scale=scale), seeded_outputs(seed))
