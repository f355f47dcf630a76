"""``kernels.fp8_cublas``'s choice on the CPU: which shapes cuBLAS's block-scaled GEMM takes, and
that nothing takes it unless requested, on a CUDA device, after a passed check (the GEMM itself
and the check run on the GPU: ``test_fp8_cublas_gpu.py``)."""

from __future__ import annotations

import torch

from sglang_dsv4.kernels import fp8_cublas
from sglang_dsv4.kernels import fp8_linear as fp8_mod


def test_the_shapes_cublas_takes():
    assert fp8_cublas.shape_ok(4, 1024, 4096) and fp8_cublas.shape_ok(256, 32768, 1024)
    assert not fp8_cublas.shape_ok(0, 1024, 4096)        # no rows
    assert not any(fp8_cublas.shape_ok(m, 1024, 4096) for m in (1, 2, 3, 5, 17))  # rows not in fours
    assert not fp8_cublas.shape_ok(8, 1024, 384)         # K / 128 = 3: not a multiple of 4
    assert not fp8_cublas.shape_ok(8, 1000, 4096)        # a partial weight block


def test_cublas_is_planned_only_where_it_measured_faster():
    assert fp8_cublas.faster(64, 32768) and fp8_cublas.faster(256, 4096) and fp8_cublas.faster(256, 8192)
    assert not fp8_cublas.faster(4, 32768)      # its fixed cost loses at a few rows
    assert not fp8_cublas.faster(256, 1024)     # wq_a: too few outputs
    assert not fp8_cublas.faster(64, 4096)      # wo_b, the shared expert at 64 rows


def test_nothing_takes_cublas_unless_requested_on_a_checked_cuda_device(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(fp8_cublas, "_checked", {})
    assert not fp8_cublas.planned(64, 32768, 1024, cuda, enabled=False)
    assert not fp8_cublas.planned(64, 32768, 1024, torch.device("cpu"), enabled=True)
    assert not fp8_cublas.planned(64, 32768, 1024, cuda, enabled=True)  # not checked yet
    fp8_cublas._checked[0] = False
    assert not fp8_cublas.planned(64, 32768, 1024, cuda, enabled=True)  # its check failed
    fp8_cublas._checked[0] = True
    assert fp8_cublas.planned(64, 32768, 1024, cuda, enabled=True)
    assert not fp8_cublas.planned(64, 32768, 384, cuda, enabled=True)  # a shape it does not take
    assert not fp8_cublas.planned(64, 1024, 4096, cuda, enabled=True)  # one where it is slower


def test_prepare_is_a_no_op_off_the_gpu_or_unrequested(monkeypatch):
    monkeypatch.setattr(fp8_cublas, "_checked", {})
    monkeypatch.setattr(fp8_cublas, "REQUESTED", True)
    fp8_mod.prepare(torch.device("cpu"))
    monkeypatch.setattr(fp8_cublas, "REQUESTED", False)
    fp8_mod.prepare(torch.device("cuda", 0))  # not requested: no check, no CUDA call
    assert fp8_cublas._checked == {}
