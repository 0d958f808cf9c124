"""One GGUF file served by our server (in one or more ``--quantization`` modes) and by
llama.cpp's ``llama-server``, side by side in one run: load time, RSS after load, decode
throughput in waves of concurrent streams, peak RSS, and prefill speed of a long prompt.

Every system gets the same requests through the same client (OpenAI ``/v1/completions``,
streamed, greedy, ``ignore_eos``), so the ratios are the result; absolute numbers move with
whatever else runs on the cores. Waves alternate their order between rounds
(``model_serving.measure_throughput``).

The file is read once before the first system starts (``warm_page_cache``), so every load time
is that of a file in the page cache, as a restart finds it: before, the first system to start
alone paid the disk read (the 1B file's first start read 5.4 s against llama.cpp's 1.4 s; a
restart took 3.6-4.1 s).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from harness.server import Server, ServerSpec
from loadgen import Api

from app.models.checkpoints.gguf_file import GGUFFile
from app.models.tokenizers import load_gguf_tokenizer
from scenarios.model_serving import (
    READY_TIMEOUT_S,
    HttpSystem,
    make_prompt,
    measure_throughput,
    run_wave,
)

MIB = 2**20


@dataclass(frozen=True, slots=True)
class GGUFBench:
    """What to run: the file, our modes, llama.cpp's binary (or None), the wave sizes."""

    model: Path
    modes: Sequence[str]
    llama_server: str | None
    sizes: Sequence[int]
    rounds: int
    max_tokens: int
    threads: int
    max_model_len: int
    prefill_tokens: int
    log_dir: Path


def our_spec(bench: GGUFBench, mode: str) -> ServerSpec:
    """``mode``: a ``--quantization`` value, ``+on`` / ``+off`` appended for
    ``--wide-copies on`` / ``off``, and ``@TREE`` for the server of another checkout (a
    ``git worktree`` of the commit before: "not slower than before", measured in the same
    run), e.g. ``auto@/tmp/before``."""
    mode, _, tree = mode.partition("@")
    quantization, _, wide = mode.partition("+")
    if tree:  # that checkout's app package first on the path, then its __main__
        start = f"import runpy, sys; sys.path.insert(0, {tree!r}); runpy.run_module('app', "
        start += "run_name='__main__', alter_sys=True)"
        argv: tuple[str, ...] = (sys.executable, "-c", start)
    else:
        argv = (sys.executable, "-m", "app")
    argv += ("serve", "--host", "127.0.0.1", "--model")
    argv += (str(bench.model), "--quantization", quantization, "--dtype", "bfloat16")
    argv += ("--wide-copies", wide) if wide else ()
    argv += ("--max-num-seqs", str(max(bench.sizes)), "--max-model-len", str(bench.max_model_len))
    argv += ("--torch-threads", str(bench.threads), "--log-level", "warning")
    return ServerSpec(f"slotserve-{mode}", argv, ready_timeout_s=READY_TIMEOUT_S)


def llama_spec(bench: GGUFBench) -> ServerSpec:
    assert bench.llama_server is not None
    slots = max(bench.sizes)
    argv = (bench.llama_server, "-m", str(bench.model), "--host", "127.0.0.1")
    argv += ("-np", str(slots), "-c", str(slots * bench.max_model_len), "-t", str(bench.threads))
    argv += ("--log-disable",)
    return ServerSpec("llama.cpp", argv, has_metrics=False, ready_timeout_s=READY_TIMEOUT_S)


def warm_page_cache(path: Path, chunk_bytes: int = 8 * MIB) -> None:
    """Reads ``path`` once, discarding the bytes: its pages are then cached for whichever
    system maps or reads it next."""
    with path.open("rb", buffering=0) as file:
        while file.read(chunk_bytes):
            pass


def long_prompt(model: Path, tokens: int) -> str:
    """Text of exactly ``tokens`` tokens of ``model``'s tokenizer (wave prompts, cut)."""
    tokenizer = load_gguf_tokenizer(GGUFFile(model))
    text = "\n".join(make_prompt(i) for i in range(tokens))
    return tokenizer.decode_bytes(tokenizer.encode(text)[:tokens]).decode(errors="ignore")


async def run_gguf_bench(bench: GGUFBench) -> dict:
    """Start every system, measure, stop; returns the report (see the module docstring)."""
    specs = {f"slotserve {mode}": our_spec(bench, mode) for mode in bench.modes}
    if bench.llama_server:
        specs["llama.cpp"] = llama_spec(bench)
    report: dict = {"model": str(bench.model), "size_mib": bench.model.stat().st_size / MIB}
    warm_page_cache(bench.model)  # the same cached file for every system's load time
    with ExitStack() as stack:
        servers: dict[str, Server] = {}
        for name, spec in specs.items():  # one at a time, so load times are not shared
            server = Server(spec, bench.log_dir)
            started = time.perf_counter()
            server.start()
            stack.callback(server.stop)
            await server.wait_ready()
            stats = server.stats
            servers[name] = server
            report[name] = {
                "load_s": round(time.perf_counter() - started, 2),
                "rss_after_load_mib": round(stats.rss_bytes() / MIB, 1),
            }
            print(
                f"  {name}: ready in {report[name]['load_s']} s, "
                f"RSS {report[name]['rss_after_load_mib']} MiB",
                flush=True,
            )
        systems = [HttpSystem(name, s.url, Api.OPENAI) for name, s in servers.items()]
        waves = await measure_throughput(systems, bench.sizes, bench.rounds, bench.max_tokens)
        prompt = long_prompt(bench.model, bench.prefill_tokens)
        for name, server in servers.items():
            entry = report[name]
            entry["tok_s"] = {
                size: round(sorted(w.tokens_per_s for w in runs)[len(runs) // 2], 1)
                for size, runs in waves[name].items()
            }
            entry["peak_rss_mib"] = round(server.stats.peak_rss_bytes() / MIB, 1)
            best = None
            for run in range(2):  # a new first line each time: no cached prefix to reuse
                unique = f"Run {run} of {name}.\n{prompt}"
                record = (await run_wave(server.url, Api.OPENAI, [unique], 1)).streams[0]
                # One token: a token without text (random weights) sends no chunk, and
                # then the answer's end is the first token's time.
                first = record.done_at if record.first_token_at is None else record.first_token_at
                seconds = first - record.sent_at
                rate = (record.prompt_tokens or 0) / seconds
                best = rate if best is None else max(best, rate)
                entry["prefill_prompt_tokens"] = record.prompt_tokens
            entry["prefill_tok_s"] = round(best or 0.0, 1)
    return report


def print_report(report: dict, sizes: Sequence[int]) -> None:
    llama = report.get("llama.cpp")
    print(f"\n{report['model']} ({report['size_mib']:.0f} MiB)")
    head = f"{'system':<22}{'load s':>8}{'RSS MiB':>9}{'peak MiB':>10}{'prefill t/s':>12}"
    print(head + "".join(f"{f'{n} str':>10}" for n in sizes))
    for name, entry in report.items():
        if not isinstance(entry, dict):
            continue
        row = f"{name:<22}{entry['load_s']:>8}{entry['rss_after_load_mib']:>9}"
        row += f"{entry['peak_rss_mib']:>10}{entry['prefill_tok_s']:>12}"
        row += "".join(f"{entry['tok_s'][n]:>10}" for n in sizes)
        print(row)
        if llama is not None and entry is not llama:
            ratio = f"{'  / llama.cpp':<22}{entry['load_s'] / llama['load_s']:>8.2f}"
            ratio += f"{entry['rss_after_load_mib'] / llama['rss_after_load_mib']:>9.2f}"
            ratio += f"{entry['peak_rss_mib'] / llama['peak_rss_mib']:>10.2f}"
            ratio += f"{entry['prefill_tok_s'] / max(llama['prefill_tok_s'], 1e-9):>12.2f}"
            ratio += "".join(f"{entry['tok_s'][n] / llama['tok_s'][n]:>10.2f}" for n in sizes)
            print(ratio)
