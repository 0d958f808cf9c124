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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

# ChatML, the format SmolLM2 and many other instruct models were trained on.
CHATML_END_OF_TURN = "<|im_end|>"
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """The template refused the conversation (its ``raise_exception``), e.g. roles out of order."""


@dataclass(frozen=True, slots=True)
class ToolCallTurn:
    """A function call an assistant turn made: its id, the function's name, and its arguments
    as the JSON text the model wrote."""

    id: str
    name: str
    arguments: str

    def as_template_value(self) -> dict[str, Any]:
        """Hugging Face's shape of a tool call in a chat (``arguments`` parsed when it is a
        JSON object, as the Qwen/Hermes templates expect; else the text)."""
        try:
            arguments: Any = json.loads(self.arguments)
        except ValueError:
            arguments = self.arguments
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": arguments},
        }


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One turn of a conversation: ``role`` is ``system``, ``user``, ``assistant`` or ``tool``.

    Attributes:
        tool_calls: the calls an assistant turn made (its ``content`` may then be "").
        tool_call_id: the call a ``tool`` turn answers.
    """

    role: str
    content: str
    tool_calls: tuple[ToolCallTurn, ...] = ()
    tool_call_id: str | None = None

    def as_template_value(self) -> dict[str, Any]:
        value: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            value["tool_calls"] = [call.as_template_value() for call in self.tool_calls]
        if self.tool_call_id is not None:
            value["tool_call_id"] = self.tool_call_id
        return value


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
    def of(cls, tokenizer: object, *, override: str | None = None) -> ChatTemplate:
        """The template of a model's tokenizer, or ChatML when it has none or its own is not
        valid Jinja (as llama.cpp's server falls back; :func:`syntax_error` says why);
        ``override`` (the source of ``--chat-template FILE``, checked when it was read)
        replaces the model's own."""
        source: str | None = override or getattr(tokenizer, "chat_template", None)
        if source and override is None and syntax_error(source) is not None:
            source = None
        return cls(
            source=source or CHATML_TEMPLATE,
            bos_token=getattr(tokenizer, "bos_token", None) or "",
            eos_token=getattr(tokenizer, "eos_token", None) or "",
            from_model=bool(source),
        )

    @property
    def renders_tools(self) -> bool:
        """The template reads a ``tools`` list (a Hermes/Qwen-style tool-aware template)."""
        return "tools" in self.source

    def render(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[dict[str, Any]] = (),
        *,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt for ``messages``, ending where the assistant's answer begins (or after
        the last message with ``add_generation_prompt=False``: ``/tokenize``).

        ``template_kwargs`` (a request's ``chat_template_kwargs``, e.g. ``enable_thinking``)
        are more variables for the template; they cannot replace ``messages``, ``tools``,
        ``add_generation_prompt`` or the special tokens.

        ``tools`` (OpenAI's ``{"type": "function", "function": {...}}`` entries) are passed to
        a template that renders them (``renders_tools``); for any other template they are
        described in a system message before the conversation (:func:`tools_system_prompt`).

        Raises:
            ChatTemplateError: the template rejected the conversation, or failed on it (an
                undefined value, a division by zero...: templates are written for the
                conversations their model was trained on, so the request is answered 4xx with
                the template's error, as vLLM answers it).
        """
        turns = [message.as_template_value() for message in messages]
        extra: dict[str, Any] = {}
        if tools and self.renders_tools:
            extra["tools"] = list(tools)
        elif tools:
            described = tools_system_prompt(tools)
            if turns and turns[0]["role"] == "system":
                turns[0] = {**turns[0], "content": f"{turns[0]['content']}\n\n{described}"}
            else:
                turns.insert(0, {"role": "system", "content": described})
        variables: dict[str, Any] = dict(template_kwargs or {})
        variables.update(
            messages=turns,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **extra,
        )
        try:
            return _compile(self.source).render(**variables)
        except ChatTemplateError:
            raise
        except Exception as exc:  # the template's own code failed on this conversation
            raise ChatTemplateError(
                f"the chat template failed: {type(exc).__name__}: {exc}"
            ) from None


def template_override(path: str | None) -> str | None:
    """The source of ``--chat-template`` (None when unset: the model's own template).

    Raises:
        ValueError: as ``read_template_file``.
    """
    return None if path is None else read_template_file(path)


def read_template_file(path: str) -> str:
    """The Jinja source of ``--chat-template FILE``, checked to compile in the sandbox the
    model files' templates run in.

    Raises:
        ValueError: the file cannot be read, is not UTF-8, holds a NUL byte (a binary file),
            is not a valid template, or never reads ``messages`` (it would render the same
            prompt for every conversation) (the message names the path and the reason).
    """
    try:
        with open(path, encoding="utf-8") as file:
            source = file.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    if not source.strip():
        raise ValueError(f"{path} is empty")
    if "\x00" in source:
        raise ValueError(f"{path} holds a NUL byte: a binary file, not a Jinja chat template")
    try:
        parsed = _compile(source).environment.parse(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"{path} is not a valid Jinja template: {exc}") from None
    if "messages" not in jinja2.meta.find_undeclared_variables(parsed):
        raise ValueError(f"{path} never reads `messages`: not a chat template")
    return source


def tools_system_prompt(tools: Sequence[dict[str, Any]]) -> str:
    """The tools described for a model whose template does not render them: each function's
    JSON, and the Hermes ``<tool_call>`` format the server parses (``tool_choice: auto``)."""
    signatures = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        "You may call one or more functions to answer. The functions:\n"
        f"<tools>\n{signatures}\n</tools>\n"
        "To call a function, write a JSON object with its name and arguments inside "
        "<tool_call></tool_call> tags:\n"
        '<tool_call>\n{"name": "<function-name>", "arguments": {<arguments>}}\n</tool_call>'
    )


@functools.lru_cache(maxsize=8)
def syntax_error(source: str) -> str | None:
    """Why ``source`` is not a valid Jinja template (the parser's message), or None."""
    try:
        _compile(source)
    except jinja2.TemplateSyntaxError as exc:
        return f"{exc.message} (line {exc.lineno})"
    return None


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
