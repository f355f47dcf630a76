"""The fuzz at scale (issue 15): >= 10,000 seeded random operations through SGLang's own scheduler
(two offline engines, no HTTP), every greedy output equal to the cache-off engine's, the cache's
integrity check after every forward step.

The workload and its engines are in ``fuzz_scheduler_script.py`` (run in a fresh interpreter, as
``make_engine`` needs). ``SGLANG_DSV4_FUZZ_SEED`` picks the seed (default 0), and
``SGLANG_DSV4_FUZZ_OPS`` the number of operations (default 10,000; below that only the equality
and the checks are asserted, not that every state was reached); a failure prints the seed.
The smaller test here checks the integrity check's own bookkeeping that the fuzz relies on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from sglang_dsv4.core.model import V4Model
from sglang_dsv4.srt.state import SglangV4Cache

SCRIPT = Path(__file__).with_name("fuzz_scheduler_script.py")


def _summary(stdout: str) -> str:
    """The driver's count lines and its first mismatches."""
    lines = stdout.splitlines()
    counts = [l for l in lines if l.startswith(("seed=", "events:", "cache on:", "cache off:", "start-up"))]
    return "\n".join(counts + [l for l in lines if l.startswith("MISMATCH")][:5])


def _failure(proc: subprocess.CompletedProcess) -> str:
    """What to show when the driver failed: the seed, its mismatches, a failed integrity check."""
    checks = [l for l in proc.stderr.splitlines() if "integrity check failed" in l or "AssertionError" in l]
    return "\n".join([f"SGLANG_DSV4_FUZZ_SEED={os.environ.get('SGLANG_DSV4_FUZZ_SEED', '0')} exit status "
                      f"{proc.returncode}", _summary(proc.stdout), *checks[:5], proc.stderr[-4000:]])


def test_fuzz_through_the_scheduler_matches_cache_off_with_checks_after_every_step():
    num_ops = int(os.environ.get("SGLANG_DSV4_FUZZ_OPS", "10000"))
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=2400)
    # retraction events because A's pool was full: SGLang's warning (A logs warnings)
    pool_full = proc.stderr.count("KV cache pool is full. Retract requests.")
    print(_summary(proc.stdout) + f"\nretractions because the pool was full: {pool_full} (scheduler warnings)")
    # a mismatch prints seed, operation and first differing position (exit status 1); a failed
    # integrity check stops A's scheduler, and the driver with it, with the check's message
    assert proc.returncode == 0, _failure(proc)
    result = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))[len("RESULT "):])
    ops, events, on, off = result["ops"], result["events"], result["cache_on"], result["cache_off"]
    assert sum(ops.values()) >= num_ops and not result["mismatches"]
    assert result["overlap_schedule"] == (os.environ.get("SGLANG_DSV4_FUZZ_OVERLAP", "1") == "1")
    assert events["outputs_checked"] >= num_ops // 2, events
    # the integrity check ran after every forward step (SGLang's busy check) and never failed
    for engine in (on, off):
        assert engine["integrity_checks"] >= engine["forward_steps"] > 0 and engine["integrity_failures"] == 0
    assert on["rings_in_use"] == 0
    # every forward had its request rows on the host (no device read-back before a step)
    assert on["rows_read_back"] == 0 and off["rows_read_back"] == 0, (on["rows_read_back"], off["rows_read_back"])
    # every resume bound from the snapshot key its radix match announced (no read of the table)
    assert on["resume_keys_read_back"] == 0, on["resume_keys_read_back"]
    # the scheduler's hooks read no device value (matches walk the tree, publishes, frees and the
    # replaced rows' frees copy without a sync): a flush's read is all that remains; before, ~3
    # a request (match, publish, free)
    assert on["host_reads"] <= events["flushes"], (on, events)
    if num_ops < 10000:
        return  # a smaller run (reproducing a seed) need not reach every state below
    # every kind of operation ran, and what each is there for happened (no vacuous pass)
    kinds = {"new", "extend", "diverge", "prefix", "repeat", "fork_fill", "fork_branch", "nsample", "long",
             "abort_prefill", "abort_decode", "flush"}
    assert kinds <= {k for k, n in ops.items() if n > 0}, ops
    assert events["long_outputs"] > 0 and events["flushes"] > 0, events
    assert pool_full > 0 and events["retracted_requests"] > 0, "no retraction: the pool is not small enough"
    assert on["tree_tokens_evicted"] > 0 and on["snapshots_evicted"] > 0, on
    assert events["cache_hits"] > 0 and on["snapshots_restored"] > 0, (events, on)
    assert on["aborts_mid_prefill"] > 0 and on["aborts_running"] > 0, on


ROWS, SLOTS, MAX_LEN = 3, 1024, 512


def test_a_free_alone_makes_the_next_check_run_and_strict_checks_raise(micro):
    """The idle check skips only when nothing changed: a slot free between steps (an abort, a
    retraction) is checked too. ``strict=True`` (the per-step check) raises, and counts."""
    cfg, w = micro
    cache = SglangV4Cache.with_own_table(cfg, ROWS, SLOTS, max_seq_len=MAX_LEN, backend="torch")
    model = V4Model(cfg, w)
    for row, first in ((0, 1), (1, 201)):  # two requests of 140 tokens (C4 entries on their slots)
        cache.req_to_token[row, :140] = torch.arange(first, first + 140, dtype=torch.int32)
        model.forward(cache, [cache.bind(row, 1, 0)], [torch.arange(2, 142)])
    both, first = torch.cat((torch.arange(1, 141), torch.arange(201, 341))), torch.arange(1, 141)
    assert cache.run_integrity_check(both, [0, 1], strict=True)
    assert cache.run_integrity_check(both, [0, 1], strict=True) and cache.stats["integrity_checks"] == 1  # unchanged
    cache.free_token_slots(torch.arange(201, 341))  # SGLang drops the second request (say, an abort)
    cache.release_rows([1])
    assert cache.run_integrity_check(first, [0], strict=True)
    assert cache.stats["integrity_checks"] == 2 and cache.stats["integrity_failures"] == 0
    # slots SGLang freed behind the cache's back still own entries: the check fails, and raises
    cache._changes += 1
    with pytest.raises(AssertionError, match="owned by freed token slots"):
        cache.run_integrity_check(first[:50], [0], strict=True)
    assert cache.stats["integrity_failures"] == 1
    cache._changes += 1
    assert not cache.run_integrity_check(first[:50], [0], strict=False)  # counted, not raised
    assert cache.stats["integrity_failures"] == 2


def test_the_idle_audit_waits_for_a_quiet_spell_and_runs_at_most_every_interval(micro):
    """SGLang's idle loop asks on every pass; the audit (a scan a new request would wait for) is
    due only after a change, once the cache has been quiet for IDLE_AUDIT_QUIET_S and the last
    audit is IDLE_AUDIT_INTERVAL_S old; with SGLang's per-step check on (the fuzz), after every change."""
    from sglang_dsv4.srt.state import IDLE_AUDIT_INTERVAL_S, IDLE_AUDIT_QUIET_S

    cfg, _ = micro
    cache = SglangV4Cache.with_own_table(cfg, ROWS, SLOTS, max_seq_len=MAX_LEN, backend="torch")
    t = time.monotonic()  # the clock the audit's own time is read from
    assert not cache.idle_audit_due(now=t)  # the first idle pass since a change starts the quiet spell
    assert cache.idle_audit_due(now=t + IDLE_AUDIT_QUIET_S)  # nothing audited yet: no interval to wait
    cache.run_integrity_check(torch.empty(0, dtype=torch.long), [])
    t = time.monotonic()
    assert not cache.idle_audit_due(now=t + 100) and not cache.idle_audit_due(immediate=True, now=t)  # unchanged
    cache.release_rows([])  # a change
    assert cache.idle_audit_due(immediate=True, now=t)
    assert not cache.idle_audit_due(now=t)  # its quiet spell starts
    assert not cache.idle_audit_due(now=t + 2 * IDLE_AUDIT_QUIET_S)  # quiet, but the last audit is recent
    t0 = t + IDLE_AUDIT_INTERVAL_S
    assert cache.idle_audit_due(now=t0)
    cache.release_rows([])  # another change restarts the spell
    assert not cache.idle_audit_due(now=t0 + IDLE_AUDIT_QUIET_S / 2)
    assert not cache.idle_audit_due(now=t0 + IDLE_AUDIT_QUIET_S)  # the spell began half a spell ago
    assert cache.idle_audit_due(now=t0 + 1.5 * IDLE_AUDIT_QUIET_S)


def test_an_idle_audit_reaches_the_metrics_without_a_further_change(micro):
    """The idle pass that finds the audit not yet due refreshes the metrics for the change; the
    audit a second later changes no state, yet its count must reach ``/metrics`` (CI saw the
    server's check count stay put after a flush until the next request)."""
    cfg, _ = micro
    cache = SglangV4Cache.with_own_table(cfg, ROWS, SLOTS, max_seq_len=MAX_LEN, backend="torch")

    class Published:  # what V4CacheMetrics.update exports: the counts as of its last call
        checks = None

        def update(self):
            self.checks = cache.stats["integrity_checks"]

    cache.metrics = Published()
    cache.release_rows([])  # a change (a flush, a free)
    assert not cache.idle_audit_due()
    cache.refresh_metrics()  # the idle pass that found the audit not due
    assert cache.metrics.checks == 0
    cache.run_integrity_check(torch.empty(0, dtype=torch.long), [])  # the audit, once due
    assert cache.metrics.checks == 1 == cache.stats["integrity_checks"]
