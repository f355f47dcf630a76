"""The plugin's small hooks that need no server: a decode step's host rows."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang_dsv4.srt import plugin, state


def _mode(decode: bool):
    return SimpleNamespace(is_decode=lambda: decode)


def _batch(rows: list[int]):
    return SimpleNamespace(reqs=[SimpleNamespace(kv=SimpleNamespace(req_pool_idx=r)) for r in rows])


@pytest.fixture()
def serving(monkeypatch):
    monkeypatch.setattr(state, "_SERVING", object())  # a model of ours is served in this process


def test_a_decode_forward_gets_its_rows_on_the_host_in_the_batchs_order(serving):
    fb = SimpleNamespace(forward_mode=_mode(True), req_pool_indices_cpu=None)
    out = plugin._decode_rows_on_the_host(fb, None, _batch([7, 2, 5]))
    assert out is fb and fb.req_pool_indices_cpu.tolist() == [7, 2, 5]
    assert fb.req_pool_indices_cpu.device.type == "cpu"


def test_extends_and_other_models_keep_what_sglang_gave(serving, monkeypatch):
    given = object()
    fb = SimpleNamespace(forward_mode=_mode(False), req_pool_indices_cpu=None)
    assert plugin._decode_rows_on_the_host(fb, None, _batch([1])).req_pool_indices_cpu is None
    fb = SimpleNamespace(forward_mode=_mode(True), req_pool_indices_cpu=given)
    assert plugin._decode_rows_on_the_host(fb, None, _batch([1])).req_pool_indices_cpu is given
    fb = SimpleNamespace(forward_mode=_mode(True), req_pool_indices_cpu=None)
    assert plugin._decode_rows_on_the_host(fb, None, _batch([])).req_pool_indices_cpu is None  # an idle rank
    monkeypatch.setattr(state, "_SERVING", None)  # not our model
    assert plugin._decode_rows_on_the_host(fb, None, _batch([1])).req_pool_indices_cpu is None


class _Model:
    """What ``_after_memory_pools`` calls on our model class (the server builds the real one)."""

    def __init__(self):
        self.cache, self.publish_read_done = object(), None

    def attach_sglang_pools(self, *args):
        pass

    def enable_decode_graphs(self, server_args):
        pass


@pytest.mark.parametrize("enabled", [True, False])
def test_the_model_publishes_its_read_done_event_on_the_runner_only_when_asked(enabled, monkeypatch):
    monkeypatch.setenv("SGLANG_DSV4_READ_DONE", "1" if enabled else "0")
    monkeypatch.setattr(state, "_SERVING", None)
    runner = SimpleNamespace(model=_Model(), req_to_token_pool=None, token_to_kv_pool_allocator=None,
                             server_args=SimpleNamespace(enable_metrics=False), shared_read_done_event=None)
    plugin._after_memory_pools(None, runner)
    assert state.serving_cache() is runner.model.cache
    if enabled:
        event = object()
        runner.model.publish_read_done(event)  # what each forward does with end_forward's event
        assert runner.shared_read_done_event is event
    else:
        assert runner.model.publish_read_done is None
