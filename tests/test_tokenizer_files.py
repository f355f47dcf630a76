"""Tokenizer files of a checkpoint: the real V4 tokenizer and a chat template equal to deepseek_recipe."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import deepseek_recipe as recipe
import pytest

from sglang_dsv4.tokenizer_files import (CHAT_TEMPLATE, THINK_END_ID, THINK_START_ID, load_tokenizer,
                                         render_chat, write_tokenizer_files)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer_files(tmp_path_factory.mktemp("tok"))


def U(content: Any) -> dict:
    return {"role": "user", "content": content}


def S(content: Any) -> dict:
    return {"role": "system", "content": content}


def A(content: Any, reasoning: str | None = None, **extra: Any) -> dict:
    msg = {"role": "assistant", "content": content, **extra}
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    return msg


def recipe_conversation(messages: list[dict], thinking: bool, effort: str | None) -> Any:
    """The conversation SGLang hands to deepseek_recipe for these chat messages (as pre_normalize builds it)."""
    body: dict[str, Any] = {"model": "DeepSeek-V4-Pro", "messages": copy.deepcopy(messages),
                            "thinking": {"type": "enabled" if thinking else "disabled"}}
    for m in body["messages"]:
        if m["role"] == "developer":
            m["role"] = "system"
    if effort is not None:
        body["reasoning_effort"] = effort
    return recipe.ChatCompletionRequest(body).convert(recipe.ConversionOptions()).conversation


CONVERSATIONS = [
    [U("Hello")],
    [S("You are a helpful assistant."), U("What is 2+2?")],
    [S("Be brief."), U("Hi"), A("Hello! How can I help?", "The user greets me."), U("Tell me a joke.")],
    [U("a"), A("b", "r1"), U("c"), A("d", "r2")],  # ends with an assistant turn
    [U("a"), A("b", "r1"), S("late system"), U("c")],  # system messages are hoisted
    [S("s1"), S(""), S("s2"), U(""), U("x"), U("")],  # empty ones skipped, users merged
    [U("x"), {"role": "latest_reminder", "content": "remember"}, U("y")],
    [U([{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}])],
    [{"role": "developer", "content": "dev"}, U(" spaced \n"), A(" keeps spaces ", " r ")],
    [U("多语言 ünïcode ✓"), A("答案", "思考")],
]
PREFIXES = [[U("a"), A("b", "r1")], [U("a"), A("b", "")], [U("a"), A("", "r1")], [U("a"), A("")],
            [U("x"), A("b", "r1"), A("partial", "r2")]]


def test_think_tokens_are_single_tokens(model_dir: Path) -> None:
    tok = load_tokenizer(model_dir)
    assert tok.token_to_id("<think>") == THINK_START_ID == 128821
    assert tok.token_to_id("</think>") == THINK_END_ID == 128822
    assert tok.encode("<think>x</think>", add_special_tokens=False).ids[::2] == [128821, 128822]
    assert tok.token_to_id("<｜begin▁of▁sentence｜>") == 0 and tok.token_to_id("<｜end▁of▁sentence｜>") == 1
    assert tok.get_vocab_size() == 129280


def test_files_written(model_dir: Path) -> None:
    assert json.loads((model_dir / "generation_config.json").read_text()) == {"bos_token_id": 0, "eos_token_id": 1}
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert cfg["chat_template"] == CHAT_TEMPLATE
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast" and cfg["add_bos_token"] is False


@pytest.mark.parametrize("effort", [None, "low", "high", "max"])
@pytest.mark.parametrize("thinking", [True, False])
def test_template_matches_recipe(thinking: bool, effort: str | None) -> None:
    encoding = recipe.DeepseekV4Encoding()
    for messages in CONVERSATIONS:
        want = encoding.render_conversation(recipe_conversation(messages, thinking, effort)).prompt
        assert render_chat(messages, thinking=thinking, reasoning_effort=effort) == want, messages
    for messages in PREFIXES:  # continued final assistant message (SGLang's continue_final_message)
        want = encoding.render_conversation(
            recipe_conversation([*messages[:-1], {**messages[-1], "prefix": True}], thinking, effort)).prompt
        got = render_chat([*messages[:-1], {**messages[-1], "prefix": True}], thinking=thinking,
                          reasoning_effort=effort)
        assert got == want, messages


def test_template_token_ids_match_recipe(model_dir: Path) -> None:
    tok = load_tokenizer(model_dir)
    encoding = recipe.DeepseekV4Encoding().with_tokenizer(recipe.Tokenizer.from_file(str(model_dir / "tokenizer.json")))
    for thinking in (True, False):
        for messages in CONVERSATIONS:
            want = encoding.encode(recipe_conversation(messages, thinking, None))
            got = tok.encode(render_chat(messages, thinking=thinking), add_special_tokens=False).ids
            assert got == want, messages


def test_template_rejects_what_it_cannot_render() -> None:
    from jinja2.exceptions import TemplateError

    with pytest.raises(TemplateError, match="tool"):
        render_chat([U("x"), {"role": "tool", "content": "out", "tool_call_id": "1"}])
    with pytest.raises(TemplateError, match="reasoning_effort"):
        render_chat([U("x")], thinking=True, reasoning_effort="extreme")
    with pytest.raises(TemplateError, match="prefix"):
        render_chat([U("x"), A("b", prefix=True), U("y")])


def test_hf_apply_chat_template(model_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    messages = CONVERSATIONS[2]
    want = recipe.DeepseekV4Encoding().render_conversation(recipe_conversation(messages, True, None)).prompt
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, thinking=True) == want
    plain = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert plain.endswith("<｜Assistant｜></think>") and "Reasoning Effort" not in plain
    assert hf.bos_token_id == 0 and hf.eos_token_id == 1
