"""The comparison ``scripts/bench_model.py`` runs: throughput waves of our server (each
configuration), llama.cpp's server and transformers, their agreement, TTFT under load and memory
(see the entry point's docstring for what each step measures); and its table."""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from harness.server import running
from loadgen import Api

from app.models.checkpoints.gguf_file import GGUFFile
from app.models.load.smollm2 import smollm2_gguf_path
from app.models.tokenizers import load_gguf_tokenizer
from scenarios.model_serving import (
    LLAMA_CPP_ISSUE,
    HttpSystem,
    ServerSetup,
    System,
    Wave,
    fill_every_slot,
    llama_server_spec,
    measure_throughput,
    ttft_under_load,
)
from scenarios.transformers_reference import TransformersSystem, agreement


@dataclass(frozen=True, slots=True)
class Comparison:
    """One run: our server's ``configs`` (the first is the default one: TTFT and memory are
    measured on it), waves of ``sizes`` streams, ``rounds`` rounds of ``max_tokens`` tokens."""

    configs: tuple[ServerSetup, ...]
    sizes: tuple[int, ...]
    rounds: int
    max_tokens: int
    threads: int
    hf_dtypes: tuple[str, ...]
    llama_server: str | None
    quick: bool


def run_comparison(comparison: Comparison) -> dict:
    """Every measurement, as the JSON report."""
    sizes, threads, configs = comparison.sizes, comparison.threads, comparison.configs
    report: dict = {
        "load_average_at_start": os.getloadavg(),
        "torch_threads": threads,
        "max_tokens": comparison.max_tokens,
        "rounds": comparison.rounds,
        "llama_cpp_issue_figures": LLAMA_CPP_ISSUE,
    }
    log_dir = Path(tempfile.mkdtemp(prefix="bench-model-"))
    with ExitStack() as servers:
        systems: list[System] = []
        our_servers = {}
        for config in configs:
            spec = config.spec(max_num_seqs=max(sizes), max_model_len=2048, threads=threads)
            our_servers[config.name] = server = servers.enter_context(running(spec, log_dir))
            systems.append(HttpSystem(config.name, server.url))
        if comparison.llama_server:
            spec = llama_server_spec(comparison.llama_server, parallel=max(sizes), threads=threads)
            llama = servers.enter_context(running(spec, log_dir))
            systems.append(HttpSystem("llama.cpp", llama.url, Api.OPENAI))
        systems += [TransformersSystem.load(dtype) for dtype in comparison.hf_dtypes]
        print(f"== throughput: {[s.name for s in systems]}", flush=True)
        waves = asyncio.run(
            measure_throughput(systems, sizes, comparison.rounds, comparison.max_tokens)
        )
        report["server_rss_mib_after_throughput"] = {
            name: server.stats.rss_mib() for name, server in our_servers.items()
        }
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
    tokenizer = load_gguf_tokenizer(GGUFFile(smollm2_gguf_path()))
    words = " ".join(f"item{i}" for i in range(200))
    prompt = tokenizer.decode_bytes(tokenizer.encode(words)[:100]).decode()
    print(f"== TTFT under load and memory ({default.name}, 16 slots x 2048)", flush=True)
    spec = default.spec(max_num_seqs=16, max_model_len=2048, threads=threads)
    with running(spec, log_dir) as server:
        memory = {"after_load": server.stats.rss_mib()}
        report["ttft_under_load"] = asyncio.run(
            ttft_under_load(server.url, repeats=2 if comparison.quick else 5, prompt=prompt)
        )
        if not comparison.quick:
            asyncio.run(fill_every_slot(server.url, tokenizer, slots=16, context=2048))
            memory["every_slot_written_to_2048"] = server.stats.rss_mib()
        report["memory_16_slots_x_2048"] = memory
    return report


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
