"""``core.compiled.on_gpu``'s dim marks (the generic compile mode): every fused function declares
its token dims, and marked calls trace once for any token count where unmarked ones trace three
times (Dynamo's guards run the same on the CPU; the ``eager`` backend skips code generation)."""

from __future__ import annotations

import inspect

import pytest
import torch

from sglang_dsv4.core import compiled, ops


def _fused() -> dict:
    return {n: f for n in dir(ops) if callable(f := getattr(ops, n)) and hasattr(f, "marks")}


def test_every_fused_function_marks_its_first_arguments_token_dim():
    fused = _fused()
    assert len(fused) >= 17
    for name, fn in fused.items():
        first = next(iter(inspect.signature(fn.eager).parameters))
        assert any(arg == first and unbacked for _, arg, _, unbacked in fn.marks), name


def test_a_mark_of_an_unknown_argument_fails_at_decoration():
    with pytest.raises(ValueError, match="no argument 'y'"):
        compiled.on_gpu(rows={"y": (0,)})(lambda x: x)


def _traces(fn, marks, counts) -> int:
    torch._dynamo.reset()
    traced = 0

    def backend(gm, example_inputs):
        nonlocal traced
        traced += 1
        return gm.forward

    run = torch.compile(fn, backend=backend)
    for t in counts:
        args = (torch.randn(t, 16), torch.ones(16), 1e-6)
        if marks is not None:
            compiled.mark_dims(args, {}, marks)
        assert torch.equal(run(*args), fn(*args))
    return traced


def test_marked_token_dims_trace_once_for_any_count():
    fn = ops.rms_norm
    counts = (600, 1, 599, 7, 1)
    assert _traces(fn.eager, None, counts) == 3      # static 600, then size 1, then dynamic
    assert _traces(fn.eager, fn.marks, counts) == 1


def test_a_negative_dim_skips_tensors_with_fewer_dims():
    marks = ops.route_tokens.marks
    chosen, bias = torch.zeros(5, 6, dtype=torch.long), torch.zeros(6)
    compiled.mark_dims((torch.zeros(5, 8), None, chosen, None), {}, marks)
    compiled.mark_dims((torch.zeros(5, 8), None, bias, None), {}, marks)
    assert 0 in getattr(chosen, "_dynamo_unbacked_indices", set())
    assert not getattr(bias, "_dynamo_unbacked_indices", set())
