"""profile_server's trace summary: self time excludes children, a function nested in itself counts
once, record_function ranges (which open and close in different frames) do not upset the nesting,
and only the scheduler thread's host events are profiled."""

from __future__ import annotations

import gzip
import json

from benchmarks.profile_server import summarise

LOOP = "/x/site-packages/sglang/srt/managers/scheduler.py(2010): run_event_loop"
FWD = "/x/sglang_dsv4/core/model.py(156): forward"


def _ev(name: str, ts: float, dur: float, cat: str = "python_function", tid: int = 1, **args) -> dict:
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat, "tid": tid, "args": args}


def _rows(lines: list[str], header: str) -> dict[str, list[str]]:
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {header}"))
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def test_summary_of_a_synthetic_trace(tmp_path):
    events = [
        _ev(LOOP, 0, 10_000),
        _ev(FWD, 1_000, 6_000),
        _ev(FWD, 1_500, 4_000),  # nested in itself: inclusive time counts the outer call alone
        _ev("aten::mm", 2_000, 2_000, cat="cpu_op"),
        _ev("cudaStreamSynchronize", 7_000, 1_000, cat="cuda_runtime"),
        _ev("cudaLaunchKernel", 6_500, 10, cat="cuda_runtime", correlation=1),
        _ev("scheduler.recv_requests", 900, 7_000, cat="user_annotation"),  # straddles FWD's end
        _ev("gemm_kernel", 6_600, 3_000, cat="kernel", tid=7),
        _ev("/x/sglang/srt/utils/watchdog.py(127): _watchdog_thread", 0, 10_000, tid=2),  # another thread
    ]
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    lines = summarise(str(path), top=10)
    assert lines[0].startswith("trace span 10.0 ms; 1 GPU kernels/copies summing to 3.0 ms; 1 launches")
    assert _rows(lines, "blocking runtime call")["cudaStreamSynchronize"] == ["1", "1.0"]
    assert _rows(lines, "GPU kernel")["gemm_kernel"] == ["1", "3.00"]
    inclusive = _rows(lines, "SGLang / sglang_dsv4 function")
    assert inclusive["sglang_dsv4/core/model.py(156): forward"] == ["1", "6.0"]
    assert inclusive["sglang/srt/managers/scheduler.py(2010): run_event_loop"] == ["1", "10.0"]
    assert not any("watchdog" in k for k in inclusive)
    own = {k: float(v[0]) for k, v in _rows(lines, "self time").items()}
    # forward: outer 6.0 less the inner 4.0 = 2.0, inner 4.0 less mm 2.0 = 2.0
    assert own == {"sglang/srt/managers/scheduler.py(2010): run_event_loop": 3.0,
                   "sglang_dsv4/core/model.py(156): forward": 4.0, "aten::mm": 2.0,
                   "cudaStreamSynchronize": 1.0, "cudaLaunchKernel": 0.0}
