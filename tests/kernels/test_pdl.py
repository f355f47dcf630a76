"""Programmatic dependent launch for the package's Triton kernels (``SGLANG_DSV4_PDL=1``,
``kernels.pdl_triton``): which launches take it, and that every kernel carries the wait (the
launches themselves need an SM90 GPU: ``test_fp8_gpu.py``'s PDL test)."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

from sglang_dsv4.kernels import triton_support

KERNELS = pathlib.Path(triton_support.__file__).parent


def test_no_launch_takes_pdl_unless_switched_on_and_on_a_cuda_gpu(monkeypatch):
    monkeypatch.setattr(triton_support, "PDL", False)
    assert triton_support.pdl_options(torch.zeros(1)) == {}
    monkeypatch.setattr(triton_support, "PDL", True)
    assert triton_support.pdl_options(torch.zeros(1)) == {}  # the interpreter / a CPU tensor: never


def _kernels() -> list[tuple[str, ast.FunctionDef]]:
    """Every ``@triton.jit`` function named ``*_kernel`` (the ones launched) of the kernel modules."""
    found = []
    for path in sorted(KERNELS.glob("*_triton.py")):
        for fn in ast.parse(path.read_text()).body:
            if (isinstance(fn, ast.FunctionDef) and fn.name.endswith("_kernel")
                    and any("triton.jit" in ast.unparse(d) for d in fn.decorator_list)):
                found.append((path.name, fn))
    return found


def test_the_kernels_are_found():
    assert len(_kernels()) >= 11


@pytest.mark.parametrize("where,fn", _kernels(), ids=lambda v: v.name if isinstance(v, ast.FunctionDef) else v)
def test_every_launched_kernel_waits_for_its_predecessor_first(where, fn):
    """A kernel launched with the PDL attribute may start before the kernel it reads from has
    finished: each one here takes the ``PDL`` flag and calls ``await_predecessor(PDL)`` before
    anything else (the helpers it calls are not launched)."""
    args = [a.arg for a in fn.args.args]
    assert args[-1] == "PDL", (where, fn.name, args)
    body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) else fn.body
    assert ast.unparse(body[0]) == "await_predecessor(PDL)", (where, fn.name)
