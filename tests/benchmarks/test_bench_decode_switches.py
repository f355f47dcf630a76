"""``bench_decode --switches``: each path is made with exactly its set of switched GPU kernels on
(``none``: all off, ``default``: as the process started, ``default+X``: those and X), and named
after it (the timing itself needs a GPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks import bench_decode
from sglang_dsv4.kernels import fp8_cublas, fp8_moe, hc_split


def test_a_path_is_made_with_its_switches_and_named_after_them(monkeypatch):
    monkeypatch.setattr(hc_split, "FUSED_PRE", False)
    monkeypatch.setattr(fp8_cublas, "REQUESTED", True)  # as an environment might set it
    monkeypatch.setattr(fp8_moe, "FOLD_SHARED", False)
    monkeypatch.setattr(bench_decode, "_AS_STARTED", {})
    seen = []

    def make():
        seen.append((hc_split.FUSED_PRE, fp8_cublas.REQUESTED, fp8_moe.FOLD_SHARED))
        return SimpleNamespace(name="graphs")

    assert bench_decode.switched("hc_fused_pre", make).name == "graphs+hc_fused_pre"
    assert bench_decode.switched("none", make).name == "graphs+none"
    assert bench_decode.switched("hc_fused_pre+fp8_cublas", make).name == "graphs+hc_fused_pre+fp8_cublas"
    assert bench_decode.switched("default", make).name == "graphs"  # as the process started
    assert bench_decode.switched("fold_shared", make).name == "graphs+fold_shared"
    # the defaults and one more: the process's own set, plus the named switch
    assert bench_decode.switched("default+hc_fused_pre", make).name == "graphs+default+hc_fused_pre"
    assert seen == [(True, False, False), (False, False, False), (True, True, False), (False, True, False),
                    (False, False, True), (True, True, False)]
    assert bench_decode.switched(None, make).name == "graphs" and seen[-1] == (True, True, False)  # left as set


def test_unknown_switches_are_refused_by_name(capsys):
    with pytest.raises(SystemExit) as e:
        bench_decode.main(["--switches", "default,fp9_magic"])
    assert e.value.code == 2
    assert "fp9_magic" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        bench_decode.main(["--switches", "default+fp9_magic"])
    assert e.value.code == 2 and "fp9_magic" in capsys.readouterr().err
