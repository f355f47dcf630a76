"""``benchmarks/count_step_ops.py`` runs (in its own process: it switches the CPU padding off)
and counts the GPU step's unfused ops, not the fused regions' insides."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_counts_the_unfused_ops_of_a_decode_step():
    r = subprocess.run([sys.executable, "-m", "benchmarks.count_step_ops", "--config", "micro", "--batch", "2",
                        "--context", "100"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    total = int(re.search(r"(\d+) ops outside the fused regions", r.stdout).group(1))
    sites = dict((s, int(n)) for n, s in re.findall(r"^\| (\d+) \| (\S+) \|$", r.stdout, re.M))
    assert total > 0 and sum(sites.values()) <= total
    layers = int(re.search(r"(\d+) layers \(ratios", r.stdout).group(1))
    # the GPU's decode call path ran in every layer
    assert int(re.search(r"layers through the decode kernel's path: (\d+)", r.stdout).group(1)) == layers
    assert not any(s.endswith((":rms_norm", ":hc_mixes", ":project_q")) for s in sites)  # fused on a GPU


def test_counts_the_fused_regions_traced_graphs():
    """``--regions``: each region's calls and the graphs Dynamo traced them into; a graph break
    adds graphs beyond one a call, and the table adds up to the totals."""
    r = subprocess.run([sys.executable, "-m", "benchmarks.count_step_ops", "--config", "micro", "--batch", "2",
                        "--context", "100", "--weights", "fp8", "--regions"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    calls, graphs, extra = map(int, re.search(
        r"(\d+) fused-region calls ran (\d+) traced graphs in one step \(([+-]\d+) against one a call",
        r.stdout).groups())
    rows = {name: (int(c), int(g)) for c, g, name in re.findall(r"^\| (\d+) \| (\d+) \| (\w+) \|$", r.stdout, re.M)}
    assert sum(c for c, _ in rows.values()) == calls and sum(g for _, g in rows.values()) == graphs
    assert graphs - calls == extra and all(g >= c for c, g in rows.values())  # the CPU runs no kernel
    layers = int(re.search(r"(\d+) layers", r.stdout).group(1))
    assert rows["hc_mixes"] == (2 * layers, 2 * layers)  # before attention and the MoE: no break inside
    reasons = re.findall(r"^\| (\d+) \| (.+) \|$", r.stdout.split("| graph breaks")[1], re.M)
    assert bool(reasons) == (extra > 0)  # a graph that ran beyond one a call came from a traced break


def test_counts_an_extend_with_new_tokens_per_request():
    """``--new N``: each request brings N tokens (cache hits' extends), which take the prefill
    attention path, not the decode kernel's."""
    r = subprocess.run([sys.executable, "-m", "benchmarks.count_step_ops", "--config", "micro", "--batch", "2",
                        "--context", "100", "--new", "9"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "9 new token(s) each" in r.stdout
    assert int(re.search(r"layers through the decode kernel's path: (\d+)", r.stdout).group(1)) == 0
    sites = dict((s, int(n)) for n, s in re.findall(r"^\| (\d+) \| (\S+) \|$", r.stdout, re.M))
    assert sites.get("kernels/sparse_mla.py:_prefill", 0) > 0
