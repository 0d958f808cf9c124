"""A chat conversation rendered into one prompt by the model's own Jinja chat template.

The template is a model capability: a model's tokenizer may carry ``chat_template: str | None``
(for SmolLM2, the GGUF's ``tokenizer.chat_template``) and the texts ``bos_token`` /
``eos_token``. A model without a template (the mock) is rendered with :data:`CHATML_TEMPLATE`,
and ``ChatTemplate.from_model`` says which one is in use (``GET /v1/models`` shows it).

Rendering follows Hugging Face's ``apply_chat_template`` so that one template gives one text:
templates ship inside model files, so they run in an ``ImmutableSandboxedEnvironment`` with
``trim_blocks``, ``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` that does not
escape HTML, and the globals ``raise_exception`` and ``strftime_now``. The prompt always ends with
the assistant's turn opened (``add_generation_prompt=True``).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

# ChatML, the format SmolLM2 and many other instruct models were trained on.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """The template refused the conversation (its ``raise_exception``), e.g. roles out of order."""


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One turn of a conversation: ``role`` is ``system``, ``user`` or ``assistant``."""

    role: str
    content: str


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    """A chat template and the special-token texts it may refer to.

    Attributes:
        source: the Jinja source.
        bos_token / eos_token: texts the template sees as ``bos_token`` / ``eos_token``
            ("" when the tokenizer does not name them).
        from_model: True when ``source`` is the model's own template, False for the ChatML
            fallback.
    """

    source: str
    bos_token: str = ""
    eos_token: str = ""
    from_model: bool = True

    @classmethod
    def of(cls, tokenizer: object) -> ChatTemplate:
        """The template of a model's tokenizer, or ChatML when it has none."""
        source: str | None = getattr(tokenizer, "chat_template", None)
        return cls(
            source=source or CHATML_TEMPLATE,
            bos_token=getattr(tokenizer, "bos_token", None) or "",
            eos_token=getattr(tokenizer, "eos_token", None) or "",
            from_model=bool(source),
        )

    def render(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True) -> str:
        """The prompt for ``messages``, ending where the assistant's answer begins (or after
        the last message with ``add_generation_prompt=False``: ``/tokenize``).

        Raises:
            ChatTemplateError: the template rejected the conversation.
            jinja2.TemplateError: the template itself is broken (a fault of the model file).
        """
        return _compile(self.source).render(
            messages=[{"role": message.role, "content": message.content} for message in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )


@functools.lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    """Compiles a template once per distinct source (a server has one or two)."""
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment.from_string(source)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)
