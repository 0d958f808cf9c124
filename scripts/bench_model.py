"""The real model end to end: our server through HTTP, side by side with ``transformers``
``generate`` on the same weights (and llama.cpp's ``llama-server`` when given its path).

    python scripts/bench_model.py                  # full run, ~10 minutes on the 2-core CPU
    python scripts/bench_model.py --quick          # ~2 minutes: one round, shorter outputs
    python scripts/bench_model.py --llama-server ~/llama.cpp/build/bin/llama-server

What it measures, in this order (every figure of one run comes from the same machine state, so
the *ratios* are the result; absolute numbers move with whatever else runs on the cores):

1. **throughput**: for each server configuration (``--configs``), a server subprocess
   (``python -m app serve --model smollm2``), then waves of 1, 16 and 64 streams started
   together, each asking 128 greedy tokens with ``ignore_eos`` (``--rounds`` waves per size,
   after one warm-up wave). A wave's tok/s is its completion tokens over its wall time (first
   request sent to last stream done, prefill included).
2. **transformers**: ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`` in float32 and
   bfloat16, one static left-padded batch of the same prompts per wave size, ``generate`` with
   ``min_new_tokens == max_new_tokens``; tok/s the same way. Its greedy tokens are the
   reference our streams are compared with (identical sequences, matching prefix).
3. **TTFT under load**: 15 streams decode; a 100-token prompt arrives; its time to first token
   against the same request's TTFT on the idle server (its own prefill), in decode steps (the
   15 streams' median inter-token time while it was admitted).
4. **memory**: RSS of a server with 16 slots x 2048 positions after every slot's cache has been
   written to its last position (16 prompts of 2040 tokens), next to its RSS after loading.

``--llama-server PATH`` adds llama.cpp's server on the same GGUF to step 1 (OpenAI-compatible
``/v1/completions``; one slot per stream). Prints a table and writes ``--json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import aiohttp
import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app.models.gguf_file import GGUFFile  # noqa: E402
from app.models.gguf_tokenizer import GGUFTokenizer  # noqa: E402
from app.models.smollm2 import smollm2_gguf_path  # noqa: E402

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


def _sse_events(lines: Sequence[str]) -> Iterator[tuple[str, str]]:
    """(event name, data) of complete SSE events in ``lines``."""
    name, data = "message", []
    for line in lines:
        if not line:
            if data:
                yield name, "\n".join(data)
            name, data = "message", []
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())


@dataclass(frozen=True, slots=True)
class NativeEndpoint:
    """Our ``POST /generate`` with ``stream: true`` (events ``token`` ... ``done``)."""

    url: str

    async def stream(
        self, http: aiohttp.ClientSession, prompt: str, max_tokens: int
    ) -> StreamRecord:
        body = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        sent = time.perf_counter()
        async with http.post(f"{self.url}/generate", json=body) as response:
            response.raise_for_status()
            text, first = await read_stream(response, b"event: token")
        done = time.perf_counter()
        token_ids: list[int] = []
        usage: dict = {}
        for name, data in _sse_events([*text.splitlines(), ""]):
            payload = json.loads(data)
            if name == "token":
                token_ids.extend(payload["token_ids"])
            elif name == "done":
                usage = payload["usage"]
            elif name == "error":
                raise RuntimeError(f"server error: {payload}")
        return StreamRecord(
            prompt_tokens=usage.get("prompt_tokens"),
            completion_tokens=len(token_ids),
            token_ids=tuple(token_ids),
            sent_at=sent,
            first_token_at=first,
            done_at=done,
        )


@dataclass(frozen=True, slots=True)
class OpenAIEndpoint:
    """``POST /v1/completions`` streamed (llama.cpp's server): tokens counted from ``usage``
    when the server sends it, else one per content chunk (llama.cpp sends one per token).
    The first token's time is that of the first chunk holding a ``"text"``."""

    url: str

    async def stream(
        self, http: aiohttp.ClientSession, prompt: str, max_tokens: int
    ) -> StreamRecord:
        body = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        sent = time.perf_counter()
        async with http.post(f"{self.url}/v1/completions", json=body) as response:
            response.raise_for_status()
            text, first = await read_stream(response, b'"text"')
        done = time.perf_counter()
        chunks, usage = 0, None
        for line in text.splitlines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            payload = json.loads(line[5:])
            if payload.get("usage"):
                usage = payload["usage"]
            if any(choice.get("text") for choice in payload.get("choices", ())):
                chunks += 1
        return StreamRecord(
            prompt_tokens=usage and usage.get("prompt_tokens"),
            completion_tokens=usage["completion_tokens"] if usage else chunks,
            token_ids=None,
            sent_at=sent,
            first_token_at=first,
            done_at=done,
        )


async def run_wave(endpoint: Endpoint, prompts: Sequence[str], max_tokens: int) -> Wave:
    async with client_session(len(prompts) + 4) as http:
        records = await asyncio.gather(*(endpoint.stream(http, p, max_tokens) for p in prompts))
    return Wave(tuple(records))


# --------------------------------------------------------------------------- server processes


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rss_mib(pid: int) -> dict[str, float]:
    """VmRSS (now) and VmHWM (peak) of a process, MiB."""
    fields = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = round(int(value.split()[0]) / 1024, 1)
    return fields


@contextmanager
def server_process(command: list[str], url: str, *, env: dict[str, str] | None = None):
    """Starts ``command``, waits until ``url``/health answers 200, yields the process, stops it."""
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 300
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"server exited ({process.returncode}): {process.stderr.read()}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server did not become healthy: {' '.join(command)}")
            time.sleep(0.5)
        yield process
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


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

    def command(
        self,
        port: int,
        *,
        max_num_seqs: int,
        max_model_len: int,
        threads: int,
        extra: Sequence[str] = (),
    ) -> list[str]:
        return [
            sys.executable,
            "-m",
            "app",
            "serve",
            "--model",
            "smollm2",
            "--port",
            str(port),
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


def llama_server_command(path: str, port: int, *, parallel: int, threads: int) -> list[str]:
    return [
        path,
        "-m",
        str(smollm2_gguf_path()),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-np",
        str(parallel),
        "-c",
        str(parallel * 512),
        "-t",
        str(threads),
        "--log-disable",
    ]


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
            while min(len(times) for times in token_times) < 4:  # all 15 are decoding
                await asyncio.sleep(0.02)
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
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    async with http.post(f"{url}/generate", json=body) as response:
        async for chunk in response.content.iter_any():
            now = time.perf_counter()
            times.extend([now] * chunk.count(b"event: token"))


# --------------------------------------------------------------------------- memory


async def fill_every_slot(url: str, tokenizer: GGUFTokenizer, *, slots: int, context: int) -> None:
    """One request per slot whose prompt + output reach the last position of the context."""
    words = " ".join(f"word{i % 97}" for i in range(context * 2))
    ids = tokenizer.encode(words)[: context - 9]
    prompt = tokenizer.decode_bytes(ids).decode("utf-8", errors="ignore")
    while len(tokenizer.encode(prompt)) > context - 8:
        prompt = prompt[:-20]
    max_tokens = context - len(tokenizer.encode(prompt))
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}

    async def one(http: aiohttp.ClientSession) -> None:
        async with http.post(f"{url}/generate", json=body) as response:
            response.raise_for_status()
            await response.read()

    async with client_session(slots + 4, timeout_s=900) as http:
        await asyncio.gather(*(one(http) for _ in range(slots)))


# --------------------------------------------------------------------------- transformers


@dataclass(frozen=True, slots=True)
class TransformersSystem:
    """``transformers`` ``generate`` on one static left-padded batch of the same prompts.

    The weights are dequantised at load (``GgufConfig(dequantize=True)``): a plain dense model,
    as the issue measured it. (This transformers build otherwise keeps GGUF blocks packed and,
    without its hub kernels, unpacks them in every forward: ~0.7 tok/s in bfloat16.)
    """

    name: str
    model: object
    tokenizer: object

    @classmethod
    def load(cls, dtype: str) -> TransformersSystem:
        import torch
        import transformers

        path = smollm2_gguf_path()
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            str(path.parent), gguf_file=path.name
        )
        tokenizer.padding_side = "left"
        tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent),
            gguf_file=path.name,
            dtype=getattr(torch, dtype),
            quantization_config=transformers.GgufConfig(dequantize=True),
        ).eval()
        return cls(f"transformers {dtype}", model, tokenizer)

    async def wave(self, size: int, max_tokens: int) -> Wave:
        import torch

        batch = self.tokenizer(
            [make_prompt(i) for i in range(size)], return_tensors="pt", padding=True
        )
        with torch.inference_mode():
            started = time.perf_counter()
            output = self.model.generate(
                **batch, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False
            )
            done = time.perf_counter()
        generated = output[:, batch["input_ids"].shape[1] :]
        return Wave(
            tuple(
                StreamRecord(
                    prompt_tokens=int(mask.sum()),
                    completion_tokens=len(row),
                    token_ids=tuple(row.tolist()),
                    sent_at=started,
                    first_token_at=None,
                    done_at=done,
                )
                for row, mask in zip(generated, batch["attention_mask"], strict=True)
            )
        )


def agreement(ours: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]) -> dict:
    """Identical sequences and the mean length of the common prefix, stream by stream."""
    prefixes = []
    for mine, theirs in zip(ours, reference, strict=True):
        same = 0
        for a, b in zip(mine, theirs, strict=False):
            if a != b:
                break
            same += 1
        prefixes.append(same)
    return {
        "identical": sum(p == len(r) for p, r in zip(prefixes, reference, strict=True)),
        "streams": len(prefixes),
        "mean_matching_prefix": round(statistics.mean(prefixes), 1),
    }


# --------------------------------------------------------------------------- the run


def _median(values: Sequence[float]) -> float:
    return round(statistics.median(values), 1)


def _summary(waves: dict[int, list[Wave]]) -> dict[int, dict]:
    summary = {}
    for size, runs in waves.items():
        ttfts = [w.median_ttft_ms for w in runs if w.median_ttft_ms is not None]
        summary[size] = {
            "tokens_per_s_median": _median([w.tokens_per_s for w in runs]),
            "tokens_per_s_all": [round(w.tokens_per_s, 1) for w in runs],
            "median_ttft_ms": _median(ttfts) if ttfts else None,
        }
    return summary


def _local_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round, 32 tokens, no RSS fill")
    parser.add_argument(
        "--configs",
        default="bfloat16:none,bfloat16:int8",
        help="dtype:quantization[:threads][:eager] of our server, comma-separated ('eager': "
        "--fused-decode false); the first is the default one (TTFT and memory are measured "
        "on it)",
    )
    parser.add_argument("--sizes", default="1,16,64", help="streams per wave")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=2,
        help="torch threads of our server and of transformers; llama.cpp's -t",
    )
    parser.add_argument("--hf-dtypes", default="float32,bfloat16", help="'' for none")
    parser.add_argument("--llama-server", help="path of llama.cpp's llama-server binary")
    parser.add_argument("--json", type=Path, default=Path("out/bench_model.json"))
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.max_tokens = 1, 32
        args.hf_dtypes = "bfloat16"
    import torch

    torch.set_num_threads(args.torch_threads)  # transformers runs in this process
    sizes = [int(s) for s in args.sizes.split(",")]
    configs = [ServerConfig.parse(c) for c in args.configs.split(",")]
    report: dict = {
        "load_average_at_start": os.getloadavg(),
        "torch_threads": args.torch_threads,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "llama_cpp_issue_figures": LLAMA_CPP_ISSUE,
    }
    with ExitStack() as servers:
        systems: list[System] = []
        pids = {}
        for config in configs:
            url = _local_url()
            command = config.command(
                int(url.rsplit(":", 1)[1]),
                max_num_seqs=max(sizes),
                max_model_len=2048,
                threads=args.torch_threads,
            )
            pids[config.name] = servers.enter_context(server_process(command, url)).pid
            systems.append(HttpSystem(config.name, NativeEndpoint(url)))
        if args.llama_server:
            url = _local_url()
            command = llama_server_command(
                args.llama_server,
                int(url.rsplit(":", 1)[1]),
                parallel=max(sizes),
                threads=args.torch_threads,
            )
            servers.enter_context(server_process(command, url))
            systems.append(HttpSystem("llama.cpp", OpenAIEndpoint(url)))
        systems += [TransformersSystem.load(d) for d in args.hf_dtypes.split(",") if d]
        print(f"== throughput: {[s.name for s in systems]}", flush=True)
        waves = asyncio.run(measure_throughput(systems, sizes, args.rounds, args.max_tokens))
        report["server_rss_mib_after_throughput"] = {n: rss_mib(p) for n, p in pids.items()}
    report["throughput"] = {name: _summary(by_size) for name, by_size in waves.items()}
    widest = max(sizes)
    report["agreement_with_transformers"] = {
        f"{ours} vs {reference}": agreement(
            [s.token_ids or () for s in waves[ours][widest][-1].streams],
            [s.token_ids or () for s in waves[reference][widest][-1].streams],
        )
        for ours in (c.name for c in configs)
        for reference in waves
        if reference.startswith("transformers")
    }

    default = configs[0]
    url = _local_url()
    tokenizer = GGUFTokenizer(GGUFFile(smollm2_gguf_path()))
    words = " ".join(f"item{i}" for i in range(200))
    prompt = tokenizer.decode_bytes(tokenizer.encode(words)[:100]).decode()
    print(f"== TTFT under load and memory ({default.name}, 16 slots x 2048)", flush=True)
    command = default.command(
        int(url.rsplit(":", 1)[1]), max_num_seqs=16, max_model_len=2048, threads=args.torch_threads
    )
    with server_process(command, url) as process:
        memory = {"after_load": rss_mib(process.pid)}
        report["ttft_under_load"] = asyncio.run(
            ttft_under_load(url, repeats=2 if args.quick else 5, prompt=prompt)
        )
        if not args.quick:
            asyncio.run(fill_every_slot(url, tokenizer, slots=16, context=2048))
            memory["every_slot_written_to_2048"] = rss_mib(process.pid)
        report["memory_16_slots_x_2048"] = memory

    print_table(report, sizes)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")


def print_table(report: dict, sizes: Sequence[int]) -> None:
    throughput = report["throughput"]
    hf_bf16 = throughput.get("transformers bfloat16", {})
    llama = throughput.get("llama.cpp", {})
    print(
        f"\n{'system':<26}{'streams':>8}{'tok/s':>9}{'/ llama.cpp issue':>19}"
        f"{'/ llama.cpp here':>18}{'/ HF bf16 here':>16}"
    )
    for name, by_size in throughput.items():
        for size in sizes:
            if size not in by_size:
                continue
            value = by_size[size]["tokens_per_s_median"]
            issue = LLAMA_CPP_ISSUE.get(size)
            here = llama.get(size, {}).get("tokens_per_s_median")
            hf = hf_bf16.get(size, {}).get("tokens_per_s_median")
            print(
                f"{name:<26}{size:>8}{value:>9.1f}"
                f"{(f'{value / issue:.2f}x' if issue else '-'):>19}"
                f"{(f'{value / here:.2f}x' if here else '-'):>18}"
                f"{(f'{value / hf:.2f}x' if hf else '-'):>16}"
            )
    print("\nagreement with transformers (greedy, widest wave):")
    for pair, result in report["agreement_with_transformers"].items():
        print(f"  {pair}: {result}")
    print(f"\nTTFT under load: {report['ttft_under_load']}")
    print(f"memory (MiB): {report['memory_16_slots_x_2048']}")


if __name__ == "__main__":
    main()
