"""Server settings: every flag of ``python -m app serve``, its default and its env variable.

Each field ``some_flag`` is the CLI flag ``--some-flag`` and the environment variable
``SLOTSERVE_SOME_FLAG`` (pydantic-settings does both); the command line wins over the environment.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, CliImplicitFlag, SettingsConfigDict

from app.engine.chat_template import read_template_file


class ServerConfig(BaseSettings):
    """Everything the server can be told at start-up."""

    model_config = SettingsConfigDict(
        env_prefix="SLOTSERVE_", cli_kebab_case=True, extra="forbid", frozen=True
    )

    model: str = Field(
        "smollm2",
        min_length=1,
        description="smollm2: the bundled SmolLM2-135M-Instruct; mock: the deterministic byte "
        "model; or PATH: a .gguf file or a Hugging Face model directory (config.json, "
        "*.safetensors, tokenizer.json) of a supported architecture (llama, mistral, qwen2, qwen3, "
        "gemma3, phi3, qwen3moe, mixtral)",
    )
    served_model_name: str | None = Field(
        None,
        min_length=1,
        description="the model's name in /info, /v1/models and every answer; unset: the GGUF's "
        "general.name, else the directory's name (smollm2: SmolLM2-135M-Instruct; mock: "
        "mock-bytes)",
    )
    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=0, le=65535, description="TCP port (0: any free port)")
    max_num_seqs: int = Field(16, ge=1, le=1024, description="batch slots (concurrent sequences)")
    max_queue: int = Field(1024, ge=0, description="most requests waiting for a slot")
    max_queued_tokens: int = Field(
        1_000_000, ge=1, description="most prompt tokens of all requests waiting for a slot"
    )
    max_body_bytes: int = Field(1_048_576, ge=1024, description="largest request body (bytes)")
    max_prompt_tokens: int | None = Field(
        None,
        ge=1,
        description="largest prompt (tokens) a request may send; unset: the context length",
    )
    sse_send_timeout: float = Field(
        30.0,
        gt=0,
        allow_inf_nan=False,
        description="seconds one SSE send may block on a client that stopped reading, "
        "after which the request is cancelled",
    )
    api_key: str = Field(
        "",
        description="require 'Authorization: Bearer KEY' on every endpoint but /health; "
        "several keys separated by commas; empty: no key",
    )
    max_model_len: int = Field(
        2048,
        ge=16,
        description="context length per sequence (tokens); sizes the KV cache; capped at the "
        "model's own context length",
    )
    kv_cache_memory: str | None = Field(
        None,
        description="size of the paged KV cache pool: bytes with a unit (512MiB, 2GiB, 400MB) "
        "or a fraction of the memory available at start-up (0.3); unset: room for 16 "
        "sequences of --max-model-len positions (mock: 4 bytes a position)",
    )
    prefix_caching: CliImplicitFlag[bool] = Field(
        True,
        description="reuse the KV blocks of a prompt prefix computed before (a shared system "
        "prompt, earlier chat turns); --no-prefix-caching: every prompt is prefilled in full",
    )
    max_num_batched_tokens: int | None = Field(
        None,
        ge=1,
        description="most tokens per model step (decodes + prompt chunks); "
        "unset: the prefill chunk size",
    )
    speculative_ngram: int = Field(
        0,
        ge=0,
        le=16,
        description="n-gram (prompt lookup) speculative decoding: draft up to K tokens a step "
        "from the request's own earlier tokens and verify them in one step (same output); "
        "0: off",
    )
    max_tokens_cap: int | None = Field(
        None, ge=1, description="largest max_tokens a request may ask; unset: the context length"
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "bfloat16",
        description="weights and KV cache dtype of the real model (bfloat16: ~2x the decode "
        "throughput of float32, greedy tokens 98% the same; see docs/MODEL_PERF.md)",
    )
    quantization: Literal["auto", "none", "gguf", "int8", "int4"] = Field(
        "auto",
        description="real model: auto picks gguf for a GGUF file on the CPU in bfloat16, else "
        "none; gguf computes on the file's own blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, "
        "Q5_K, Q6_K) in C kernels chosen by cpuid, memory at the file's size (CPU only); int4 "
        "computes with Q4_0/Q4_1 codes in torch's int4 kernel, int8 re-quantises to "
        "weight-only int8 (both need --dtype bfloat16); none: dense weights",
    )
    fused_decode: bool = Field(
        True,
        description="real model, CPU bfloat16: run decode steps (without a seeded row) "
        "through fused C kernels built with the machine's C compiler at start-up "
        "(1.2-1.5x eager torch's tok/s; eager when there is no compiler)",
    )
    wide_copies: Literal["auto", "on", "off"] = Field(
        "auto",
        description="real model, GGUF on its blocks: also keep dense bfloat16 copies of the "
        "projections for wide steps (the block kernels are GEMVs at heart): steps of more than 32 "
        "rows on a CPU with AMX, where oneDNN's GEMM catches up from ~32 rows; of more than 127 "
        "(prompt chunks) on one with AVX-512 BF16 only, where the block kernels win up to ~128. "
        "auto: only when the copies are bfloat16 and come to at most 512 MiB (a small model "
        "such as SmolLM2, +270 MiB); a larger file, or an AVX2 CPU (whose tile kernels beat "
        "float32 copies), keeps its memory at the file's size",
    )
    warmup: CliImplicitFlag[bool] = Field(
        True,
        description="real model: run the largest step once before serving (every slot but one "
        "decoding beside a prompt chunk of the step budget), so its buffers and kernels are "
        "ready and an idle server's memory already holds them (llama.cpp's --warmup); "
        "--no-warmup: start seconds sooner",
    )
    torch_threads: int | None = Field(
        None, ge=1, description="torch intra-op threads for the real model; unset: torch's choice"
    )
    device: str = Field(
        "auto", description="torch device of the real model: auto, cpu, cuda or cuda:N"
    )
    scheduling: Literal["continuous", "static"] = Field(
        "continuous", description="admission policy: continuous batching or static batches"
    )
    sse_ping_interval: float = Field(
        15.0,
        gt=0,
        allow_inf_nan=False,
        description="seconds between ': ping' comments on an SSE stream",
    )
    mock_step_ms: float = Field(
        0.0, ge=0, allow_inf_nan=False, description="mock model: how long a step takes (ms)"
    )
    mock_context_length: int = Field(8192, ge=16, description="mock model: context length")
    mock_fail_every: int = Field(
        0,
        ge=0,
        description="mock model: every Nth step raises (0: never); a prompt containing "
        "'<<fail>>' fails only its own row",
    )
    shutdown_timeout: float = Field(
        30.0,
        ge=0,
        allow_inf_nan=False,
        description="seconds to let in-flight requests finish on SIGTERM",
    )
    replica_id: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9]{1,16}$",
        description="prefix of server-made request ids, for id-affine routing across replicas",
    )
    ui: CliImplicitFlag[bool] = Field(
        True,
        description="serve the chat page at / and /ui (--no-ui: 404 there; /docs is not affected)",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field("info")
    chat_template: str | None = Field(
        None,
        description="a Jinja chat template FILE that replaces the model's own (for models whose "
        "template is missing or wrong); run in the same sandbox as the model file's",
    )
    reasoning_parser: Literal["auto", "none", "think"] = Field(
        "auto",
        description="split <think>...</think> out of answers as reasoning content: auto: when "
        "the chat template opens a <think> block; think: always; none: never",
    )

    @field_validator("kv_cache_memory")
    @classmethod
    def _check_kv_cache_memory(cls, value: str | None) -> str | None:
        if value is not None:
            parse_memory_size(value)
        return value

    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", value):
            raise ValueError(f"expected auto, cpu, cuda or cuda:N, got {value!r}")
        return value

    @field_validator("api_key")
    @classmethod
    def _check_api_key(cls, value: str) -> str:
        # (found by a helper: " , " turned authentication off without a word)
        if value and not any(part.strip() for part in value.split(",")):
            raise ValueError("holds no key (only commas and blanks): give a key, or none at all")
        return value

    @field_validator("chat_template")
    @classmethod
    def _check_chat_template(cls, value: str | None) -> str | None:
        if value is not None:
            read_template_file(value)
        return value

    @model_validator(mode="after")
    def _check_budget(self) -> ServerConfig:
        budget = self.max_num_batched_tokens
        if budget is not None and budget < self.max_num_seqs:
            raise ValueError(
                f"--max-num-batched-tokens ({budget}) must be at least --max-num-seqs "
                f"({self.max_num_seqs}): every slot may decode a token in one step"
            )
        return self


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
}


def parse_memory_size(text: str) -> int | float:
    """``--kv-cache-memory``: bytes (an int) from ``"512MiB"``, ``"2GiB"``, ``"400MB"``,
    ``"1048576"``; or a fraction of available memory (a float in (0, 1)) from ``"0.3"``.

    Raises:
        ValueError: anything else, a size of 0, or a fraction outside (0, 1).
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"kv_cache_memory {text!r}: a size with a unit (512MiB, 2GiB) or a fraction (0.3)"
        )
    number = float(match.group(1))
    if not unit and "." in match.group(1):
        if not 0 < number < 1:
            raise ValueError(f"kv_cache_memory fraction {text!r} must be in (0, 1)")
        return number
    size = int(number * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"kv_cache_memory {text!r} must be more than 0 bytes")
    return size
