"""The SGLang model class's head GEMM (``srt.model.CoreHeadMethod``): SGLang's own logits code
reaches the core's head, in the deterministic mode over whole tiles."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from sglang_dsv4.core import ops
from sglang_dsv4.core.model import V4Model
from sglang_dsv4.core.step import DETERMINISTIC_TILE
from sglang_dsv4.srt.model import CoreHeadMethod


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_sglangs_logits_code_runs_the_core_head(micro, monkeypatch, deterministic):
    from sglang.srt.layers.logits_processor import LogitsProcessor

    cfg, w = micro
    core = V4Model(cfg, w, deterministic=deterministic)
    lm_head = nn.Module()
    lm_head.weight = nn.Parameter(w["head.weight"], requires_grad=False)
    lm_head.quant_method = CoreHeadMethod(core)
    lm_head.quant_method.process_weights_after_loading(lm_head)  # SGLang's loader calls it
    rows: list[int] = []
    gemm = ops._gemm

    def spy(x, weight):
        if weight is lm_head.weight:
            rows.append(x.shape[0])
        return gemm(x, weight)

    # every head GEMM goes through ops._gemm: on the CPU over tiles of ops.CPU_ROW_TILE rows,
    # in the deterministic mode over tiles of DETERMINISTIC_TILE rows
    monkeypatch.setattr(ops, "_gemm", spy)
    hidden = torch.randn(70, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    # the head step of SGLang's LogitsProcessor, with the attributes that step reads
    logits = LogitsProcessor._compute_lm_head(SimpleNamespace(use_fp32_lm_head=False), hidden, lm_head)
    tile = DETERMINISTIC_TILE if deterministic else ops.CPU_ROW_TILE
    assert rows == [tile] * -(-70 // tile)
    assert torch.equal(logits, core.head_logits(hidden, lm_head.weight))
    # a row's logits do not depend on the rows with it (here on the CPU in both modes)
    alone = LogitsProcessor._compute_lm_head(SimpleNamespace(use_fp32_lm_head=False), hidden[5:6], lm_head)
    assert torch.equal(alone[0], logits[5])


@pytest.mark.parametrize("key", ["dsv4_cuda_graph_precapture_len", "dsv4_cuda_graph_max_bs"])
@pytest.mark.parametrize("value, message", [("1024", "got '1024'"), (-1, "got -1"), (2.5, "got 2.5"), (True, "got True")])
def test_a_bad_graph_override_is_refused_by_name_on_any_device(key, value, message):
    """The graph keys given straight in ``--json-model-override-args`` (the launcher's flags check
    their own): anything but a whole number >= 0 fails the load, naming the key, also on the CPU
    where no graph is captured."""
    from sglang_dsv4.srt.model import DeepseekV4ForCausalLM, override_count

    assert override_count(SimpleNamespace(), key) == 0
    assert override_count(SimpleNamespace(), key, unset=None) is None
    assert override_count(SimpleNamespace(**{key: 4096}), key) == 4096
    model = SimpleNamespace(config=SimpleNamespace(**{key: value}), core=None)  # a CPU load: no core on a GPU
    with pytest.raises(ValueError, match=f"{key}: expected a whole number >= 0, {message}"):
        DeepseekV4ForCausalLM.enable_decode_graphs(model, SimpleNamespace())
    model.config = SimpleNamespace(**{key: 0})
    DeepseekV4ForCausalLM.enable_decode_graphs(model, SimpleNamespace())  # valid: nothing to do on the CPU
