"""Chat templates: find a model's Jinja chat template and render messages with it.

Rendering follows what Hugging Face `transformers` does, so real models' templates
produce the same prompt here as there: a sandboxed immutable Jinja environment
with `trim_blocks`/`lstrip_blocks`, the loop-controls extension, a `tojson`
filter that keeps non-ASCII, and the `raise_exception` / `strftime_now` globals.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, NoReturn

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

TEMPLATE_FILE = "chat_template.jinja"


class ChatTemplateError(ValueError):
    """The model has no chat template, or the template rejected the messages."""


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not compile: {e}") from e


def load_chat_template(model_dir: str | Path, tokenizer_config: Mapping[str, Any]) -> str | None:
    """The model's template: `chat_template.jinja` if present, else the
    `chat_template` of `tokenizer_config.json` (a string, or a list of named
    templates of which the one named "default" is used). None if there is none."""
    path = Path(model_dir) / TEMPLATE_FILE
    if path.is_file():
        return path.read_text(encoding="utf-8")
    tmpl = tokenizer_config.get("chat_template")
    if isinstance(tmpl, list):
        named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
        tmpl = named.get("default")
    return tmpl if isinstance(tmpl, str) and tmpl else None


def _normalize_content(message: Mapping[str, Any]) -> dict[str, Any]:
    """OpenAI allows content as a list of parts; templates mostly expect a string.
    Text parts are joined; a message whose content is already a string is unchanged."""
    msg = dict(message)
    content = msg.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, Mapping) and part.get("type") == "text"):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ChatTemplateError(f"unsupported content part type: {kind}")
            texts.append(str(part.get("text", "")))
        msg["content"] = "".join(texts)
    elif content is None:
        msg["content"] = ""
    return msg


def render_chat_template(
    template: str | None,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    **extra: Any,
) -> str:
    """Render `messages` with `template`.

    Raises ChatTemplateError if `template` is None (the model has no chat
    template), if it does not compile, or if it rejects the messages (through
    `raise_exception` or a Jinja error).
    """
    if template is None:
        raise ChatTemplateError(
            "this model has no chat template (no chat_template in tokenizer_config.json "
            f"and no {TEMPLATE_FILE}); use a plain completion prompt instead"
        )
    compiled = _compile(template)
    try:
        return compiled.render(
            messages=[_normalize_content(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **extra,
        )
    except ChatTemplateError:
        raise
    except Exception as e:  # any failure of the template on this input is the input's (a 400)
        # jinja2's errors, TypeError, KeyError, the sandbox's OverflowError (a range too
        # long), SecurityError, RecursionError, MemoryError ...
        raise ChatTemplateError(f"chat template failed to render: {type(e).__name__}: {str(e)[:200]}") from None
