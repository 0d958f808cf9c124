"""The real model end to end: our server through HTTP, side by side with ``transformers``
``generate`` on the same weights (``scenarios/transformers_reference.py``) and llama.cpp's
``llama-server`` when given its path. The command line, and what it measures in which order, is
``scripts/bench_model.py``.

The client is lean on purpose: aiohttp, the raw chunks kept as they come and parsed once the
stream has ended (``harness.sse.parse_events``), the first token's time taken from the first
chunk holding a token event. On the 2-core machine the client shares the cores with the server,
and httpx reading event by event cost ~3x the client CPU of this one per wave (see
docs/MODEL_PERF.md, "The client's share").
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import aiohttp
from harness.server import ServerSpec
from harness.sse import parse_events
from harness.wait import wait_for

from app.models.load.smollm2 import smollm2_gguf_path
from app.models.tokenizers import TextTokenizer

READY_TIMEOUT_S = 300.0  # loading SmolLM2 (and building the fused kernels) on a busy machine

# Figures given in the issue for llama.cpp's llama-server on this machine kind (same GGUF,
# 128 new tokens per request): 1 stream and 16 concurrent streams, aggregate tok/s.
LLAMA_CPP_ISSUE = {1: 74.0, 16: 149.0}

TOPICS = (
    "a lighthouse keeper",
    "the first snow of winter",
    "a robot learning to paint",
    "an old map found in an attic",
    "a city built on water",
    "the last train of the night",
    "a garden on the moon",
    "a detective who cannot see",
    "a library that never closes",
    "two rival bakers",
    "a storm over the desert",
    "a whale that sings",
    "a broken clock",
    "the smell of rain",
    "a chess game across centuries",
    "a village without names",
)


def make_prompt(index: int) -> str:
    topic = TOPICS[index % len(TOPICS)]
    return f"Write a long, detailed story about {topic}, part {index // len(TOPICS) + 1}."


# --------------------------------------------------------------------------- streams and waves


@dataclass(frozen=True, slots=True)
class StreamRecord:
    """One streamed request, times in seconds on the client's monotonic clock."""

    prompt_tokens: int | None
    completion_tokens: int
    token_ids: tuple[int, ...] | None  # None where the API does not return ids
    sent_at: float
    first_token_at: float | None
    done_at: float


@dataclass(frozen=True, slots=True)
class Wave:
    """N streams started together."""

    streams: tuple[StreamRecord, ...]

    @property
    def wall_s(self) -> float:
        return max(s.done_at for s in self.streams) - min(s.sent_at for s in self.streams)

    @property
    def tokens_per_s(self) -> float:
        return sum(s.completion_tokens for s in self.streams) / self.wall_s

    @property
    def median_ttft_ms(self) -> float | None:
        ttfts = [s.first_token_at - s.sent_at for s in self.streams if s.first_token_at is not None]
        return 1000 * statistics.median(ttfts) if ttfts else None


class Endpoint(Protocol):
    """Sends one streamed greedy request and records it."""

    async def stream(
        self, http: aiohttp.ClientSession, prompt: str, max_tokens: int
    ) -> StreamRecord: ...


def client_session(connections: int, timeout_s: float = 600) -> aiohttp.ClientSession:
    """The benchmark's HTTP client. aiohttp (C HTTP parser), as vLLM's serving benchmark uses:
    on the 2-core machine the client shares the cores with the server, and httpx spent ~4x
    more CPU per streamed token (1.6 s against 0.4 s for a 64-stream wave), time the server's
    threads then lost (see docs/MODEL_PERF.md, "The client's share")."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=connections),
        timeout=aiohttp.ClientTimeout(total=timeout_s),
    )


async def read_stream(
    response: aiohttp.ClientResponse, first_marker: bytes
) -> tuple[str, float | None]:
    """The whole body of a streamed ``response`` and when the first chunk holding
    ``first_marker`` arrived (``time.perf_counter()``; None if none did). Chunks are kept as
    they come and decoded once at the end: per chunk only a byte search."""
    first: float | None = None
    chunks: list[bytes] = []
    async for chunk in response.content.iter_any():
        if first is None and first_marker in chunk:
            first = time.perf_counter()
        chunks.append(chunk)
    return b"".join(chunks).decode(), first


def greedy_body(prompt: str, max_tokens: int, **fields: object) -> dict[str, object]:
    """A greedy streamed request that generates exactly ``max_tokens`` tokens."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return body | {"stream": True} | fields


@dataclass(frozen=True, slots=True)
class TimedStream:
    """A streamed answer read whole: its text, when it was sent, when the first token came and
    when it ended (``time.perf_counter()`` seconds)."""

    text: str
    sent_at: float
    first_token_at: float | None
    done_at: float

    @classmethod
    async def post(
        cls, http: aiohttp.ClientSession, url: str, body: dict[str, object], first_marker: bytes
    ) -> TimedStream:
        sent = time.perf_counter()
        async with http.post(url, json=body) as response:
            response.raise_for_status()
            text, first = await read_stream(response, first_marker)
        return cls(text, sent, first, time.perf_counter())

    def record(
        self, prompt_tokens: int | None, completion_tokens: int, token_ids: tuple[int, ...] | None
    ) -> StreamRecord:
        return StreamRecord(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            token_ids=token_ids,
            sent_at=self.sent_at,
            first_token_at=self.first_token_at,
            done_at=self.done_at,
        )


@dataclass(frozen=True, slots=True)
class NativeEndpoint:
    """Our ``POST /generate`` with ``stream: true`` (events ``token`` ... ``done``)."""

    url: str

    async def stream(
        self, http: aiohttp.ClientSession, prompt: str, max_tokens: int
    ) -> StreamRecord:
        body = greedy_body(prompt, max_tokens)
        answer = await TimedStream.post(http, f"{self.url}/generate", body, b"event: token")
        token_ids: list[int] = []
        usage: dict = {}
        for event in parse_events(answer.text):
            payload = event.json()
            if event.event == "token":
                token_ids.extend(payload["token_ids"])
            elif event.event == "done":
                usage = payload["usage"]
            elif event.event == "error":
                raise RuntimeError(f"server error: {payload}")
        return answer.record(usage.get("prompt_tokens"), len(token_ids), tuple(token_ids))


@dataclass(frozen=True, slots=True)
class OpenAIEndpoint:
    """``POST /v1/completions`` streamed (llama.cpp's server): tokens counted from ``usage``
    when the server sends it, else one per content chunk (llama.cpp sends one per token).
    The first token's time is that of the first chunk holding a ``"text"``."""

    url: str

    async def stream(
        self, http: aiohttp.ClientSession, prompt: str, max_tokens: int
    ) -> StreamRecord:
        body = greedy_body(prompt, max_tokens, stream_options={"include_usage": True})
        answer = await TimedStream.post(http, f"{self.url}/v1/completions", body, b'"text"')
        chunks, usage = 0, None
        for event in parse_events(answer.text):
            if event.data.strip() == "[DONE]":
                continue
            payload = event.json()
            if payload.get("usage"):
                usage = payload["usage"]
            if any(choice.get("text") for choice in payload.get("choices", ())):
                chunks += 1
        completion_tokens = usage["completion_tokens"] if usage else chunks
        return answer.record(usage and usage.get("prompt_tokens"), completion_tokens, None)


async def run_wave(endpoint: Endpoint, prompts: Sequence[str], max_tokens: int) -> Wave:
    async with client_session(len(prompts) + 4) as http:
        records = await asyncio.gather(*(endpoint.stream(http, p, max_tokens) for p in prompts))
    return Wave(tuple(records))


# --------------------------------------------------------------------------- server processes


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """One configuration of our server; ``threads`` None: ``--torch-threads``; ``eager``:
    ``--fused-decode false``."""

    dtype: str
    quantization: str
    threads: int | None = None
    eager: bool = False

    @classmethod
    def parse(cls, spec: str) -> ServerConfig:
        """``dtype:quantization[:threads][:eager]``."""
        dtype, quantization, *rest = spec.split(":")
        eager = bool(rest) and rest[-1] == "eager"
        if eager:
            rest.pop()
        return cls(dtype, quantization, int(rest[0]) if rest else None, eager)

    @property
    def name(self) -> str:
        name = f"slotserve {self.dtype}" + (
            "" if self.quantization == "none" else f"+{self.quantization}"
        )
        return (
            name + (f" {self.threads}T" if self.threads else "") + (" eager" if self.eager else "")
        )

    def spec(
        self, *, max_num_seqs: int, max_model_len: int, threads: int, extra: Sequence[str] = ()
    ) -> ServerSpec:
        """Our server in this configuration (the harness adds ``--port``)."""
        argv = [
            sys.executable,
            "-m",
            "app",
            "serve",
            "--model",
            "smollm2",
            "--max-num-seqs",
            str(max_num_seqs),
            "--max-model-len",
            str(max_model_len),
            "--dtype",
            self.dtype,
            "--quantization",
            self.quantization,
            "--torch-threads",
            str(self.threads or threads),
            "--device",
            "cpu",
            "--log-level",
            "warning",
            *(("--fused-decode", "false") if self.eager else ()),
            *extra,
        ]
        return ServerSpec(self.name.replace(" ", "-"), tuple(argv), ready_timeout_s=READY_TIMEOUT_S)


def llama_server_spec(path: str, *, parallel: int, threads: int) -> ServerSpec:
    """llama.cpp's server on the same GGUF, one slot per stream (no /metrics)."""
    argv = (path, "-m", str(smollm2_gguf_path()), "--host", "127.0.0.1", "-np", str(parallel))
    argv += ("-c", str(parallel * 512), "-t", str(threads), "--log-disable")
    return ServerSpec("llama.cpp", argv, has_metrics=False, ready_timeout_s=READY_TIMEOUT_S)


class System(Protocol):
    """Something a wave of greedy requests can be run against."""

    name: str

    async def wave(self, size: int, max_tokens: int) -> Wave: ...


@dataclass(frozen=True, slots=True)
class HttpSystem:
    """A server: ``size`` concurrent streams of the first ``size`` prompts."""

    name: str
    endpoint: Endpoint

    async def wave(self, size: int, max_tokens: int) -> Wave:
        return await run_wave(self.endpoint, [make_prompt(i) for i in range(size)], max_tokens)


async def measure_throughput(
    systems: Sequence[System], sizes: Sequence[int], rounds: int, max_tokens: int
) -> dict[str, dict[int, list[Wave]]]:
    """``rounds`` rounds; in each, every wave size on every system in turn (order alternating
    between rounds), so that a busy neighbour on the cores slows every system alike."""
    for system in systems:
        await system.wave(2, 4)  # warm-up
    waves: dict[str, dict[int, list[Wave]]] = {s.name: {n: [] for n in sizes} for s in systems}
    for index in range(rounds):
        for size in sizes:
            for system in systems if index % 2 == 0 else reversed(systems):
                wave = await system.wave(size, max_tokens)
                waves[system.name][size].append(wave)
                print(
                    f"  round {index + 1} {system.name:<24} {size:>3} streams: "
                    f"{wave.tokens_per_s:7.1f} tok/s",
                    flush=True,
                )
    return waves


# --------------------------------------------------------------------------- TTFT under load


async def ttft_under_load(url: str, *, repeats: int, prompt: str) -> dict[str, float]:
    """15 streams decoding; the 100-token ``prompt`` arrives; its TTFT vs on the idle server."""
    endpoint = NativeEndpoint(url)
    async with client_session(32) as http:
        idle = [await endpoint.stream(http, prompt, 1) for _ in range(repeats + 1)][1:]
        loaded: list[StreamRecord] = []
        step_ms: list[float] = []
        for _ in range(repeats):
            token_times: list[list[float]] = [[] for _ in range(15)]
            background = [
                asyncio.create_task(_record_token_times(http, url, make_prompt(i), 200, times))
                for i, times in enumerate(token_times)
            ]
            await wait_for(  # all 15 are decoding
                lambda streams=token_times: min(len(times) for times in streams) >= 4,
                READY_TIMEOUT_S,
            )
            record = await endpoint.stream(http, prompt, 1)
            loaded.append(record)
            await asyncio.gather(*background)
            for times in token_times:  # the background streams' steps around the arrival
                step_ms.extend(
                    1000 * (b - a)
                    for a, b in zip(times, times[1:], strict=False)
                    if record.sent_at - 1.0 <= a <= record.done_at + 1.0
                )
    idle_ms = statistics.median(1000 * (r.first_token_at - r.sent_at) for r in idle)
    loaded_ms = statistics.median(1000 * (r.first_token_at - r.sent_at) for r in loaded)
    step = statistics.median(step_ms)
    return {
        "prompt_tokens": idle[0].prompt_tokens,
        "ttft_idle_ms": round(idle_ms, 1),
        "ttft_under_load_ms": round(loaded_ms, 1),
        "decode_step_ms": round(step, 1),
        "delay_beyond_own_prefill_steps": round((loaded_ms - idle_ms) / step, 2),
        "ttft_under_load_in_steps": round(loaded_ms / step, 2),
    }


async def _record_token_times(
    http: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int, times: list[float]
) -> None:
    """Appends the arrival time of every token event of one greedy stream to ``times``."""
    async with http.post(f"{url}/generate", json=greedy_body(prompt, max_tokens)) as response:
        async for chunk in response.content.iter_any():
            now = time.perf_counter()
            times.extend([now] * chunk.count(b"event: token"))


# --------------------------------------------------------------------------- memory


async def fill_every_slot(url: str, tokenizer: TextTokenizer, *, slots: int, context: int) -> None:
    """One request per slot whose prompt + output reach the last position of the context."""
    words = " ".join(f"word{i % 97}" for i in range(context * 2))
    ids = tokenizer.encode(words)[: context - 9]
    prompt = tokenizer.decode_bytes(ids).decode("utf-8", errors="ignore")
    while len(tokenizer.encode(prompt)) > context - 8:
        prompt = prompt[:-20]
    max_tokens = context - len(tokenizer.encode(prompt))
    body = greedy_body(prompt, max_tokens, stream=False)

    async def one(http: aiohttp.ClientSession) -> None:
        async with http.post(f"{url}/generate", json=body) as response:
            response.raise_for_status()
            await response.read()

    async with client_session(slots + 4, timeout_s=900) as http:
        await asyncio.gather(*(one(http) for _ in range(slots)))
