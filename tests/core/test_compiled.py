"""``core.compiled.on_gpu``'s dim marks (the generic compile mode): every fused function declares
its token dims, and marked calls trace once for any token count where unmarked ones trace three
times (Dynamo's guards run the same on the CPU; the ``eager`` backend skips code generation); the
opt-in combo-kernel switch names an Inductor option this torch has."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

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


def test_the_fused_regions_traced_give_the_eager_steps_bits(micro, monkeypatch):
    """Every ``on_gpu`` region traced through AOTAutograd (functionalised, as Inductor takes it on
    the GPU), their in-place writes of slot states and tables included, gives the eager model's
    outputs and cache contents (scratch rows aside) bit for bit over a prefill and three decode
    steps (FlashMLA's fp8 storage, the GPU's entry-table widths)."""
    from sglang_dsv4.core import model as model_mod
    from sglang_dsv4.core.model import V4Model
    from sglang_dsv4.kernels import kv_layout, sparse_mla
    from sglang_dsv4.srt import state as state_mod
    from sglang_dsv4.srt.state import SglangV4Cache

    cfg, w = micro

    def run():
        cache = SglangV4Cache.with_own_table(cfg, 3, 512, max_seq_len=160, backend="torch-fp8")
        cache.req_to_token.copy_(torch.arange(1, 481).view(3, 160))
        model = V4Model(cfg, w)
        reqs = [cache.bind(r, 1, 0) for r in range(2)]
        g = torch.Generator().manual_seed(5)
        ids = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in (9, 130)]
        outs = [torch.cat(model.forward(cache, reqs, ids))]
        for _ in range(3):
            step_ids = [torch.randint(0, cfg.vocab_size, (1,), generator=g) for _ in reqs]
            outs.append(torch.cat(model.forward(cache, reqs, step_ids)))
        # the scratch slot, page and entry row last in each: what they hold is no one's (tokens
        # that write nothing real all land there, in either order)
        state = [t[:-1].clone() for t in cache.slot_state.values()]
        pools = [t[:-1].clone() for p in cache.pools.values() for t in p.tensors.values()]
        return outs, state + pools + [t[:-1].clone() for t in cache.req_entries.values()]

    want = run()
    torch._dynamo.reset()
    traced = 0
    for module in (ops, model_mod, kv_layout, sparse_mla, state_mod):
        for name in dir(module):
            fn = getattr(module, name)
            if callable(fn) and hasattr(fn, "eager"):
                monkeypatch.setattr(module, name, torch.compile(fn.eager, backend="aot_eager"))
                traced += 1
    assert traced >= 25
    # config.patch, not monkeypatch: undoing a monkeypatch of a dynamo config hides the key (its
    # module's __delattr__), so the next compile in the process failed reading it
    with torch._dynamo.config.patch(recompile_limit=256, accumulated_recompile_limit=4096):
        got = run()
    torch._dynamo.reset()
    assert all(torch.equal(a, b) for a, b in zip(got[0], want[0]))
    assert len(got[1]) == len(want[1]) and all(torch.equal(a, b) for a, b in zip(got[1], want[1]))


def test_the_combo_kernel_switch_names_an_option_this_torch_has():
    """``SGLANG_DSV4_COMBO_KERNELS=1`` hands Inductor an option it knows (an unknown one would fail
    the first compile on the GPU, not here); off, no options at all."""
    code = ("import torch, sglang_dsv4.core.compiled as c; "
            "assert all(hasattr(torch._inductor.config, k) for k in c.INDUCTOR_OPTIONS); "
            "print(sorted(c.INDUCTOR_OPTIONS))")
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_DSV4_COMBO_KERNELS"}
    on = subprocess.run([sys.executable, "-c", code], env={**env, "SGLANG_DSV4_COMBO_KERNELS": "1"},
                        capture_output=True, text=True, check=True)
    off = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert on.stdout.strip() == "['combo_kernels']" and off.stdout.strip() == "[]"
