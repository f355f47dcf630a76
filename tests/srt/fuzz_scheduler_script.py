"""Run by test_fuzz_scheduler.py in a fresh interpreter: a seeded random workload through SGLang's
scheduler on two offline engines, checked token for token.

Engine A, the system under test: our radix cache and snapshots; a small token pool and optimistic
admission (``schedule_conservativeness``), so bursts of long outputs make the scheduler retract
decoding requests and the tree evicts all the time; a small snapshot budget, so the LRU evicts
snapshots; chunked prefill of 128 tokens in mixed prefill + decode batches (every third step, so
that decode steps between them stay cheap: the model pads a batch to its longest extension);
and our deterministic mode (``dsv4_deterministic``, ``core.model``): on the CPU it must change
no output, so it goes through the scheduler here too (steps cut into 64-row pieces, also between
fork points).
A runs SGLang's overlap scheduler (its default; ``SGLANG_DSV4_FUZZ_OVERLAP=0`` turns it off):
step N+1 launched before step N's results are processed.
Engine B, the reference: ``disable_radix_cache=True``, no overlap scheduling and a large pool.
Both run with SGLang's own strict self-checks (``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY`` /
``_IDLE``), under which our plugin runs the cache's integrity check after every forward step and
at idle (``patches/integrity-check.md``); a failed check stops the scheduler, and this process with it,
with the check's message on stderr.

One operation is one client action on A: a generate call (whatever its ``n``; a fork's prefix fill
and each of its branches are one each; a request the client aborts is one, of kind
``abort_prefill`` or ``abort_decode``) or a cache flush. The plan (kinds, token ids, lengths,
which earlier operation each builds on) comes from ``SGLANG_DSV4_FUZZ_SEED`` alone; a prompt that
extends or cuts an earlier request uses that request's output on A, so the operations are a
function of the seed as long as outputs are deterministic (what is checked). How the scheduler
interleaves them is not reproducible.

Every greedy output of A (each copy of an ``n>1`` request, the part of an aborted stream that
arrived) must equal B's output for the same prompt, token for token. The last line printed is
``RESULT {json}`` with the counts; exit status 1 on a mismatch, which prints the seed, the
operation and the first differing position.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field

SEED = int(os.environ.get("SGLANG_DSV4_FUZZ_SEED", "0"))
NUM_OPS = int(os.environ.get("SGLANG_DSV4_FUZZ_OPS", "10000"))
OVERLAP = os.environ.get("SGLANG_DSV4_FUZZ_OVERLAP", "1") == "1"  # A under SGLang's overlap scheduler

ENGINE_A = dict(max_total_tokens=6144, max_running_requests=64, chunked_prefill_size=128,
                enable_mixed_chunk=True, prefill_decode_interval=2, schedule_policy="fcfs",
                schedule_conservativeness=0.3,  # admit optimistically: long decodes outgrow the pool
                json_model_override_args=json.dumps({"dsv4_snapshot_budget_mb": 48,  # ~200 snapshots
                                                     "dsv4_deterministic": True}),
                disable_overlap_schedule=not OVERLAP)
ENGINE_B = dict(disable_radix_cache=True, disable_overlap_schedule=True, max_total_tokens=32768,
                max_running_requests=64, chunked_prefill_size=256)
A_INFLIGHT = 72  # requests in flight on A: a few more than it runs at once (aborts while queued)
B_BATCH, B_LINGER_S = 48, 0.5  # reference requests go to B this many at once (or after this wait)
MAX_SEQ = 320  # planned prompt + output bound
LONG_NEW = 200  # a long output
BURST, BURST_FIRST, BURST_EVERY = 32, 500, 5000  # long requests at once (A's retractions), where
TOKENS = (100, 120000)  # plain token ids (no BOS/EOS or chat specials inside prompts)

# kind -> weight of a plan step (a fork step adds 1 fill + 2..4 branch operations)
KINDS = {"new": 19, "extend": 19, "diverge": 11, "prefix": 4, "repeat": 14, "fork": 5,
         "nsample": 5, "long": 0.3, "abort_prefill": 2.5, "abort_decode": 8}
FLUSH_EVERY = 1000  # operations between cache flushes (a flush waits for A to drain)
QUIET_BEFORE_FLUSH = 300  # no long outputs this close before a flush or the end (a short drain)
DEP_GAP = 48  # an op builds on one planned at least this much earlier: mostly finished by then
ABORT_DELAY_START, ABORT_DELAY_RANGE = 0.8, (0.05, 30.0)  # abort_prefill's adaptive delay (s)


@dataclass
class Op:
    """One planned operation; ``dep`` is the earlier op whose prompt + output this one builds on."""

    index: int
    kind: str
    dep: int | None = None
    suffix: list[int] = field(default_factory=list)  # tokens after the base (new: the whole prompt)
    cut: float | None = None  # diverge / prefix: keep this fraction of the base
    max_new: int = 0
    n: int = 1
    abort_after: float = 0.0  # abort_decode: tokens received; abort_prefill: a fraction of the abort delay
    planned_len: int = 0  # prompt + max_new as planned (the output may stop early at EOS)


def _tokens(rng: random.Random, n: int) -> list[int]:
    """``n`` random plain token ids."""
    return [rng.randrange(*TOKENS) for _ in range(n)]


def _short_new(rng: random.Random) -> int:
    """A short output length (4.3 tokens on average: decode steps are most of the cost)."""
    return rng.choice([1, 1, 2, 2, 3, 4, 4, 6, 8, 12])


def make_plan(seed: int, num_ops: int) -> list[Op]:
    """The operations, from the seed alone (lengths planned, outputs unknown)."""
    rng = random.Random(seed)
    ops: list[Op] = []
    completing: list[int] = []  # ops whose prompt + output later ops may build on

    def dep_choice(room: int) -> int | None:
        """A recent completing op whose planned sequence leaves ``room`` tokens under MAX_SEQ."""
        ready = bisect.bisect_right(completing, len(ops) - DEP_GAP)
        for _ in range(8):
            if not ready:
                return None
            j = completing[ready - 1 - min(int(rng.expovariate(1 / 40)), ready - 1)]
            if ops[j].planned_len + room <= MAX_SEQ:
                return j
        return None

    def add(op: Op, base_len: int, completes: bool = True) -> None:
        op.planned_len = base_len + len(op.suffix) + op.max_new
        ops.append(op)
        if completes and op.max_new > 0:
            completing.append(op.index)

    next_flush, next_burst = FLUSH_EVERY, BURST_FIRST
    while len(ops) < num_ops:
        i = len(ops)
        if i >= next_flush:
            ops.append(Op(i, "flush"))
            next_flush += FLUSH_EVERY
            continue
        if i >= next_burst:  # long outputs at once: their decode outgrows A's pool (retraction)
            for _ in range(BURST):  # (prompt + output: 32 x ~280 tokens, well over A's pool of 6144)
                add(Op(len(ops), "long", suffix=[0] + _tokens(rng, rng.randrange(60, 100)), max_new=LONG_NEW), 0)
            next_burst += BURST_EVERY
            continue
        kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
        if kind in ("long", "abort_decode") and min(next_flush, num_ops) - i < QUIET_BEFORE_FLUSH:
            kind = "new"
        if kind in ("extend", "diverge", "prefix", "repeat", "fork", "nsample"):
            j = dep_choice(40)
            if j is None:
                kind = "new"
        if kind == "new":
            length = rng.randrange(3, 24) if rng.random() < 0.95 else rng.randrange(129, 200)
            add(Op(i, "new", suffix=[0] + _tokens(rng, length), max_new=_short_new(rng)), 0)
        elif kind == "long":
            add(Op(i, "long", suffix=[0] + _tokens(rng, rng.randrange(3, 60)), max_new=LONG_NEW), 0)
        elif kind == "extend":  # the next turn: earlier prompt + output + a few new tokens (or none)
            extra = 0 if rng.random() < 0.15 else rng.randrange(1, 12)
            add(Op(i, "extend", dep=j, suffix=_tokens(rng, extra), max_new=_short_new(rng)), ops[j].planned_len)
        elif kind == "diverge":  # leaves the earlier sequence at a random position
            cut = rng.random()
            add(Op(i, "diverge", dep=j, cut=cut, suffix=_tokens(rng, rng.randrange(1, 8)), max_new=_short_new(rng)),
                int(ops[j].planned_len * cut))
        elif kind == "prefix":  # a strict prefix of the earlier sequence
            cut = rng.random()
            add(Op(i, "prefix", dep=j, cut=cut, max_new=_short_new(rng)), int(ops[j].planned_len * cut))
        elif kind == "repeat":  # the same request again
            add(Op(i, "repeat", dep=j, max_new=ops[j].max_new), ops[j].planned_len)
        elif kind == "nsample":  # n>1 greedy copies (SGLang fills the prompt once, then forks)
            add(Op(i, "nsample", dep=j, suffix=_tokens(rng, rng.randrange(1, 10)), max_new=_short_new(rng),
                   n=rng.randrange(2, 5)), ops[j].planned_len)
        elif kind == "fork":  # the frontend's fork: fill the shared prefix, then branches at once
            fill = Op(i, "fork_fill", dep=j, suffix=_tokens(rng, rng.randrange(1, 10)), max_new=0)
            add(fill, ops[j].planned_len, completes=False)
            for b in range(rng.randrange(2, 5)):
                add(Op(len(ops), "fork_branch", dep=i, suffix=_tokens(rng, rng.randrange(1, 6)),
                       max_new=_short_new(rng)), fill.planned_len)
        elif kind == "abort_prefill":  # a prompt of several chunks, aborted while it is prefilled
            add(Op(i, "abort_prefill", suffix=[0] + _tokens(rng, rng.randrange(200, 400)), max_new=4,
                   abort_after=rng.uniform(0.3, 1.0)), 0, completes=False)
        elif kind == "abort_decode":  # a stream the client drops after some tokens
            if rng.random() < 0.5 and (j := dep_choice(60)) is not None:
                base, suffix = ops[j].planned_len, _tokens(rng, rng.randrange(1, 8))
            else:
                j, base, suffix = None, 0, [0] + _tokens(rng, rng.randrange(3, 60))
            add(Op(i, "abort_decode", dep=j, suffix=suffix, max_new=40, abort_after=rng.randrange(1, 24)),
                base, completes=False)
    return ops[:num_ops]


class Fuzz:
    """Runs a plan on engine A, checks every output against engine B."""

    def __init__(self, plan: list[Op], a, b):
        self.plan, self.a, self.b = plan, a, b
        self.seqs: dict[int, asyncio.Future] = {}  # op -> prompt + output on A (None: aborted)
        self.a_slots = asyncio.Semaphore(A_INFLIGHT)
        self.reference: dict[tuple, asyncio.Future] = {}  # (prompt, max_new) -> B's output
        self.counts: dict[str, int] = {}
        self.events = {"requests": 0, "outputs_checked": 0, "tokens_checked": 0, "long_outputs": 0,
                       "retracted_requests": 0, "retractions": 0, "cache_hits": 0, "cached_tokens": 0,
                       "aborted_before_first_token": 0, "aborted_after_tokens": 0, "flushes": 0,
                       "prefill_aborts_late": 0,
                       "mean_inflight": 0.0}
        self.mismatches: list[str] = []
        self.prompts: dict[int, list[int]] = {}
        self.checks: list[asyncio.Task] = []  # comparisons with B, awaited at the end
        self.b_queue: list[tuple] = []  # reference requests not sent yet
        self.b_wake, self.a_done = asyncio.Event(), False
        self.inflight = 0
        # abort_prefill's delay after submit (s): how long a long prompt waits in A's queue depends
        # on the machine and the load (a fixed 0.02-0.8 s found every one still queued in CI), so
        # the delay adapts to when prefills end (run_abort)
        self.abort_delay = ABORT_DELAY_START

    def base(self, op: Op) -> list[int]:
        """The prompt of ``op`` (its dependency has finished)."""
        if op.dep is None:
            return list(op.suffix)
        if op.kind == "repeat":
            return list(self.prompts[op.dep])
        seq = self.seqs[op.dep].result()
        if op.kind == "diverge":  # keep 1..len tokens, then new ones
            seq = seq[:min(max(1, int(len(seq) * op.cut)), len(seq))]
        elif op.kind == "prefix":  # keep 1..len-1 tokens
            seq = seq[:min(max(1, int(len(seq) * op.cut)), len(seq) - 1)] if len(seq) > 1 else seq
        return seq + op.suffix

    async def run(self) -> None:
        """Launch the plan in order (at most ``A_INFLIGHT`` at once; a flush waits for A to
        drain), then wait for every check."""
        pending: list[asyncio.Task] = []
        self.t0 = time.time()
        feeder = asyncio.create_task(self.feed_reference())
        sampler = asyncio.create_task(self.sample_concurrency())
        for op in self.plan:
            self.counts[op.kind] = self.counts.get(op.kind, 0) + 1
            self.seqs[op.index] = asyncio.get_running_loop().create_future()
            if op.kind == "flush":
                await asyncio.gather(*pending)  # A drains: SGLang flushes only when idle
                pending = []
                # (the scheduler may not have retired the last finished batch yet: wait for idle)
                result = await self.a.tokenizer_manager.flush_cache(timeout_s=60)
                if not result.success:
                    raise RuntimeError(f"op {op.index}: flush refused after A drained: {result.message}")
                self.events["flushes"] += 1
                self.seqs[op.index].set_result(None)
                continue
            await self.a_slots.acquire()
            if op.index % 1000 == 0:
                print(f"op {op.index} at {time.time() - self.t0:.1f} s", file=sys.stderr, flush=True)
            pending.append(asyncio.create_task(self.run_op(op)))
            if self.mismatches:
                break
        await asyncio.gather(*pending)
        self.a_done = True
        self.b_wake.set()
        await asyncio.gather(feeder, sampler, *self.checks)

    async def run_op(self, op: Op) -> None:
        """Run ``op`` on A, then free its slot: the check against B runs on its own."""
        try:
            if op.dep is not None:
                if await self.seqs[op.dep] is None:  # only completing ops are dependencies
                    raise RuntimeError(f"op {op.index} depends on op {op.dep}, which did not complete")
            prompt = self.base(op)
            self.prompts[op.index] = prompt
            params = {"temperature": 0, "max_new_tokens": op.max_new}
            if op.max_new > 0 and op.kind not in ("abort_prefill", "abort_decode"):
                self.ask_reference(prompt, op.max_new)  # B works beside A (long outputs too)
            if op.kind in ("abort_prefill", "abort_decode"):
                got = await self.run_abort(op, prompt, params)
                self.seqs[op.index].set_result(None)
                if got:  # what arrived must be the start of the greedy output
                    self.checks.append(asyncio.create_task(self.check(op, prompt, got, len(got), "aborted stream")))
                return
            if op.n > 1:
                params["n"] = op.n
            self.inflight += 1
            out = await self.a.async_generate(input_ids=prompt, sampling_params=params)
            self.inflight -= 1
            outs = out if isinstance(out, list) else [out]
            for o in outs:
                self.account(o)
            self.seqs[op.index].set_result(prompt + outs[0]["output_ids"])
            if op.max_new > 0:
                for k, o in enumerate(outs):
                    self.checks.append(asyncio.create_task(
                        self.check(op, prompt, o["output_ids"], op.max_new, f"copy {k}" if op.n > 1 else "")))
        except BaseException as e:
            if not self.seqs[op.index].done():
                self.seqs[op.index].set_exception(e)
            raise
        finally:
            self.a_slots.release()

    async def run_abort(self, op: Op, prompt: list[int], params: dict) -> list[int]:
        """Stream ``op`` and abort it (abort_decode: after ``abort_after`` tokens; abort_prefill:
        after that fraction of the adaptive delay); the ids that arrived."""
        rid = f"fuzz-{SEED}-{op.index}"
        stream = await self.a.async_generate(input_ids=prompt, sampling_params=params, stream=True, rid=rid)
        last: dict | None = None

        async def consume() -> None:
            nonlocal last
            async for chunk in stream:
                last = chunk
                if op.kind == "abort_decode" and len(chunk["output_ids"]) >= op.abort_after:
                    self.a.tokenizer_manager.abort_request(rid=rid)

        task = asyncio.create_task(consume())  # the request reaches the scheduler once iterated
        if op.kind == "abort_prefill":
            await asyncio.sleep(op.abort_after * self.abort_delay)
            self.a.tokenizer_manager.abort_request(rid=rid)
        await task
        got = [] if last is None else last["output_ids"]
        if op.kind == "abort_prefill":
            # (the client cannot tell an abort in the queue from one mid-prefill: SGLang answers
            # both alike) shorter after an abort that came too late, longer after one before any
            # token: the delay settles where ~40% come too late, just after the prefills end
            self.abort_delay *= 0.8 if got else 1.15
            self.abort_delay = min(max(self.abort_delay, ABORT_DELAY_RANGE[0]), ABORT_DELAY_RANGE[1])
            self.events["prefill_aborts_late"] += bool(got)
        if last is not None:
            self.account(last)
        self.events["aborted_after_tokens" if got else "aborted_before_first_token"] += 1
        return got

    def account(self, out: dict) -> None:
        """Count what one of A's responses says happened to it."""
        meta = out["meta_info"]
        self.events["requests"] += 1
        self.events["retractions"] += meta.get("num_retractions", 0)
        self.events["retracted_requests"] += meta.get("num_retractions", 0) > 0
        cached = meta.get("cached_tokens", 0)  # (absent when aborted in the queue)
        self.events["cache_hits"] += cached > 0
        self.events["cached_tokens"] += cached
        self.events["long_outputs"] += len(out["output_ids"]) >= LONG_NEW

    def ask_reference(self, prompt: list[int], max_new: int) -> asyncio.Future:
        """B's greedy output for ``prompt`` (each distinct request computed once), queued for
        the next batch to B."""
        key = (tuple(prompt), max_new)
        if key not in self.reference:
            self.reference[key] = asyncio.get_running_loop().create_future()
            self.b_queue.append(key)
            if len(self.b_queue) >= B_BATCH:
                self.b_wake.set()
        return self.reference[key]

    async def sample_concurrency(self) -> None:
        """Mean number of generate calls in flight on A (sampled every 0.1 s)."""
        samples = []
        while not self.a_done:
            samples.append(self.inflight)
            await asyncio.sleep(0.1)
            self.events["mean_inflight"] = round(sum(samples) / len(samples), 1)

    async def feed_reference(self) -> None:
        """Send B its requests in batches: trickled in one by one, each would cost B a forward
        step of its own."""
        async def ask(batch: list[tuple]) -> None:
            try:
                outs = await self.b.async_generate(
                    input_ids=[list(p) for p, _ in batch],
                    sampling_params=[{"temperature": 0, "max_new_tokens": m} for _, m in batch])
            except BaseException as e:
                for key in batch:
                    self.reference[key].set_exception(e)
                raise
            for key, out in zip(batch, outs):
                self.reference[key].set_result(out["output_ids"])

        tasks = []
        while not (self.a_done and not self.b_queue):
            try:
                await asyncio.wait_for(self.b_wake.wait(), B_LINGER_S)
            except asyncio.TimeoutError:
                pass
            self.b_wake.clear()
            if self.b_queue:
                # by length: B's prefill batches then hold prompts of similar lengths (the model
                # pads a batch's indexer scores to its longest request)
                batch, self.b_queue = sorted(self.b_queue, key=lambda k: len(k[0])), []
                tasks.append(asyncio.create_task(ask(batch)))
        await asyncio.gather(*tasks)

    async def check(self, op: Op, prompt: list[int], got: list[int], max_new: int, what: str) -> None:
        """A's ``got`` for ``prompt`` must be B's greedy output of ``max_new`` tokens."""
        want = await self.ask_reference(prompt, max_new)
        self.events["outputs_checked"] += 1
        self.events["tokens_checked"] += len(got)
        if got != want:
            first = next((k for k, (x, y) in enumerate(zip(got, want)) if x != y), min(len(got), len(want)))
            msg = (f"MISMATCH seed={SEED} op={op.index} kind={op.kind} {what} dep={op.dep} "
                   f"prompt_len={len(prompt)} first differing output position {first}: "
                   f"cache on {got[first:first + 8]} vs cache off {want[first:first + 8]} "
                   f"(lengths {len(got)} / {len(want)}); prompt={prompt}")
            print(msg, flush=True)
            self.mismatches.append(msg)


def cpu_seconds(engine) -> float:
    """User + system CPU seconds of an engine's scheduler and detokenizer processes so far."""
    total = 0.0
    for pid in engine.get_all_child_pids():
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def cache_state(engine) -> dict:
    """Our cache's counters from the scheduler (``internal_states[0]["dsv4_cache"]``)."""
    return engine.get_server_info()["internal_states"][0]["dsv4_cache"]


def main() -> int:
    # SGLang's own strict self-checks, which also run our cache's check after every step
    os.environ["SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY"] = "1"
    os.environ["SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE"] = "1"
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # two schedulers share the machine's cores
    from sglang_dsv4.engine import make_engine

    t0 = time.time()
    plan = make_plan(SEED, NUM_OPS)
    # A logs SGLang's warnings (stderr): its "KV cache pool is full. Retract requests." lines
    # tell retractions for memory from any other kind
    a = make_engine("micro", **ENGINE_A, log_level="warning", skip_tokenizer_init=True)
    b = make_engine("micro", **ENGINE_B, log_level="error", skip_tokenizer_init=True)
    overlap = not a.server_args.disable_overlap_schedule  # what A's scheduler really runs
    cpu0 = cpu_seconds(a), cpu_seconds(b), time.process_time()
    started = time.time()
    fuzz = Fuzz(plan, a, b)
    try:
        a.loop.run_until_complete(fuzz.run())
        on, off = cache_state(a), cache_state(b)
        cpu = cpu_seconds(a) - cpu0[0], cpu_seconds(b) - cpu0[1]
    finally:
        a.shutdown()
        b.shutdown()
    ops = ", ".join(f"{k}={v}" for k, v in sorted(fuzz.counts.items()))
    print(f"seed={SEED} ops={sum(fuzz.counts.values())} ({ops})")
    print("events: " + ", ".join(f"{k}={v}" for k, v in fuzz.events.items()))
    print("cache on: " + ", ".join(f"{k}={v}" for k, v in on.items()))
    print(f"cache off: integrity_checks={off['integrity_checks']} forward_steps={off['forward_steps']}")
    print(f"start-up {started - t0:.1f} s, workload {time.time() - started:.1f} s; "
          f"reference requests {len(fuzz.reference)}; mismatches {len(fuzz.mismatches)}; "
          f"CPU during the workload: engine A {cpu[0]:.1f} s, engine B {cpu[1]:.1f} s, "
          f"this process {time.process_time() - cpu0[2]:.1f} s")
    print("RESULT " + json.dumps({"seed": SEED, "overlap_schedule": overlap, "ops": fuzz.counts, "events": fuzz.events, "cache_on": on,
                                  "cache_off": off, "mismatches": fuzz.mismatches[:5]}), flush=True)
    return 1 if fuzz.mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
