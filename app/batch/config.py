"""The flags of ``python -m app batch``: the serve flags that make sense offline, and its own.

The model and engine flags are ``ServerConfig``'s own fields (same names, defaults, bounds, help
and ``SLOTSERVE_*`` variables), taken from it rather than repeated, so a model flag added to the
server is a batch flag too; only the flags of an HTTP server (``SERVE_ONLY``) are left out.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationError, create_model, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, CliImplicitFlag, SettingsConfigDict

from app.api.errors import pydantic_message
from app.config import ServerConfig

# Flags that only an HTTP server has a use for: listening, keys, queues of clients, SSE, drain.
SERVE_ONLY = frozenset(
    {
        "host",
        "port",
        "api_key",
        "max_queue",
        "max_queued_tokens",
        "sse_send_timeout",
        "sse_ping_interval",
        "shutdown_timeout",
        "replica_id",
        "ui",
    }
)
STDIO = "-"  # -i - / -o -: standard input / output


def _engine_fields() -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for name, info in ServerConfig.model_fields.items():
        if name in SERVE_ONLY:
            continue
        if name == "log_level":  # the progress bar is the batch's voice; logs only if asked
            info = FieldInfo.merge_field_infos(info, default="warning")
        fields[name] = (info.annotation, info)
    return fields


class _BatchFiles(BaseSettings):
    """The batch's files (first, so that ``--help`` shows them first)."""

    input: str = Field(description="OpenAI Batch input file (JSONL); '-': standard input")
    output: str = Field(description="where the result lines go (JSONL); '-': standard output")


_EngineFlags = create_model("_EngineFlags", __base__=_BatchFiles, **_engine_fields())


class BatchConfig(_EngineFlags):  # type: ignore[misc, valid-type]
    """Everything ``python -m app batch`` can be told (every flag also reads
    ``SLOTSERVE_<FLAG>``; the command line wins)."""

    model_config = SettingsConfigDict(
        env_prefix="SLOTSERVE_", cli_kebab_case=True, extra="forbid", frozen=True
    )

    max_pending_lines: int = Field(
        1024,
        ge=1,
        description="most input lines read but not yet written (requests in flight and results "
        "waiting for an earlier line): bounds the read-ahead and the reorder buffer; more "
        "than --max-num-seqs keeps every slot busy behind a long request",
    )
    progress: CliImplicitFlag[bool] = Field(
        True, description="a progress bar on standard error (--no-progress: only the summary)"
    )

    @model_validator(mode="after")
    def _valid_for_the_server(self) -> BatchConfig:
        """Refuses, when the flags are read, what the server would refuse of the same flags."""
        try:
            self.server_config()
        except ValidationError as exc:
            messages = (pydantic_message(error) for error in exc.errors())
            raise ValueError("; ".join(messages)) from None
        return self

    def server_config(self) -> ServerConfig:
        """The model and engine settings as the server takes them (validated as its flags are).

        Raises:
            pydantic.ValidationError: a combination the server refuses.
        """
        names = ServerConfig.model_fields.keys() - SERVE_ONLY
        return ServerConfig(**{name: getattr(self, name) for name in names})
