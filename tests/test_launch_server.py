"""The launcher's argument and environment handling (no server is started)."""

from __future__ import annotations

import json

import pytest

from sglang_dsv4.launch_server import _parallel_ranks, cpu_arguments, cpu_environment, dsv4_arguments


def test_dsv4_flags_become_model_overrides_and_merge_with_the_users():
    args = dsv4_arguments(["--port", "1", "--dsv4-snapshot-budget-mb", "64",
                           "--dsv4-attention-backend=torch-fp8", "--dsv4-deterministic",
                           "--dsv4-cuda-graph-precapture-len", "4096",
                           "--json-model-override-args", '{"other": 1}'])
    assert args[:2] == ["--port", "1"]
    i = args.index("--json-model-override-args")
    assert json.loads(args[i + 1]) == {"other": 1, "dsv4_snapshot_budget_mb": 64.0,
                                       "dsv4_attention_backend": "torch-fp8", "dsv4_deterministic": True,
                                       "dsv4_cuda_graph_precapture_len": 4096}
    assert dsv4_arguments(["--port", "1"]) == ["--port", "1"]


@pytest.mark.parametrize("argv, message", [
    (["--dsv4-snapshot-budget-mb", "lots"], "expected a number of MiB"),
    (["--dsv4-snapshot-budget-mb", "-1"], "must be >= 0"),
    (["--dsv4-attention-backend", "cuda"], "expected one of auto, torch, torch-fp8, flashmla"),
    (["--dsv4-attention-backend"], "expected a value"),
    (["--dsv4-deterministic=yes"], "takes no value"),
    (["--dsv4-cuda-graph-precapture-len", "-5"], "must be >= 0"),
])
def test_bad_dsv4_flags_are_refused_by_name(argv, message):
    with pytest.raises(SystemExit, match=message):
        dsv4_arguments(argv)


def test_user_arguments_win_over_cpu_defaults():
    args = cpu_arguments(["--dtype", "bfloat16"])
    assert args.count("--dtype") == 1 and "--sleep-on-idle" in args and "--device" in args


def test_the_cpu_keeps_sglangs_overlap_scheduler_unless_the_user_turns_it_off():
    assert "--disable-overlap-schedule" not in cpu_arguments(["--port", "1"])
    assert cpu_arguments(["--disable-overlap-schedule"]).count("--disable-overlap-schedule") == 1


def test_cpu_ranks_split_the_cores_and_use_gloo(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: {0, 1, 2, 3}, raising=False)
    assert _parallel_ranks(["--tp-size", "2", "--dp", "1"]) == 2
    assert _parallel_ranks(["--tp-size", "2", "--dp-size", "2"]) == 4  # two TP-2 replicas
    assert _parallel_ranks(["--tp-size", "2", "--attn-dp-size", "2"]) == 2  # attention groups of the TP ranks
    assert _parallel_ranks(["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention"]) == 2
    env = cpu_environment({}, ranks=2)
    assert env["SGLANG_CPU_OMP_THREADS_BIND"] == "0-1|2-3"
    assert env["SGLANG_NCCL_SO_PATH"].startswith("/nonexistent")
    assert "SGLANG_CPU_OMP_THREADS_BIND" not in cpu_environment({}, ranks=1)
    assert cpu_environment({"SGLANG_CPU_OMP_THREADS_BIND": "0|3"}, 2)["SGLANG_CPU_OMP_THREADS_BIND"] == "0|3"
    with pytest.raises(SystemExit, match="need at least 8 cores"):
        cpu_environment({}, ranks=8)
