"""The real model's ``step`` without HTTP: decode tok/s against the memory-bandwidth limit,
mixed vs alternating prefill, short prompt chunks fused vs eager, threads, agreement with
float32, and RSS. What each part measures
and the command line: ``scripts/bench_model_step.py``."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import torch
from harness.process_stats import MIB, ProcessStats
from harness.server import SCRIPTS

from app.models.base import KVBlocks, SamplingParams, StepBatch, StepRow
from app.models.forward import forward_plan
from app.models.forward.forward_plan import ForwardPlan, RowSpec
from app.models.forward.kv_cache import blocks_for
from app.models.load.plan import load_checkpoint
from app.models.runner import ModelRunner
from app.models.weights.int4 import INT4_MAX_ROWS, Int4Linear
from app.models.weights.int8 import Int8Linear
from app.models.weights.projections import DenseLinear, PackedLinear

ENTRY_POINT = SCRIPTS / "bench_model_step.py"  # runs ``measure_rss_child`` in a fresh process

GREEDY = SamplingParams(temperature=0.0)
AGREEMENT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village by the sea,",
    "The three primary colours are",
    "<|im_start|>user\nWrite a haiku about autumn.<|im_end|>\n<|im_start|>assistant\n",
    "import numpy as np\n\ndef normalize(x):",
    "Water boils at a temperature of",
)


@dataclass(frozen=True, slots=True)
class Config:
    dtype: str
    quantization: str

    @property
    def name(self) -> str:
        return self.dtype + ("" if self.quantization == "none" else f"+{self.quantization}")


def rss_mib() -> float:
    """This process's resident set, MiB."""
    return round(ProcessStats().rss_bytes() / MIB, 1)


def prompt_ids(length: int, salt: int = 0) -> tuple[int, ...]:
    return tuple((17 + 31 * i + 1009 * salt) % 40000 + 100 for i in range(length))


# --------------------------------------------------------------------------- bandwidth


def measure_bandwidth() -> dict[str, float]:
    """Best-of-7 GB/s of a 1 GiB float32 read (sum) and copy, with 1 and 2 threads."""
    result = {}
    source = torch.ones(2**28)
    target = torch.empty_like(source)
    before = torch.get_num_threads()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        reads, copies = [], []
        for _ in range(7):
            started = time.perf_counter()
            source.sum()
            reads.append(source.nbytes / (time.perf_counter() - started) / 1e9)
            started = time.perf_counter()
            target.copy_(source)
            copies.append(2 * source.nbytes / (time.perf_counter() - started) / 1e9)
        result[f"read_gb_s_{threads}_threads"] = round(max(reads), 1)
        result[f"copy_gb_s_{threads}_threads"] = round(max(copies), 1)
    torch.set_num_threads(before)
    return result


def weight_bytes_per_step(runner: ModelRunner, rows: int) -> int:
    """Bytes of projection weights one step of ``rows`` decode rows reads (each matrix once)."""

    def size(linear) -> int:
        if isinstance(linear, Int4Linear):
            if rows <= INT4_MAX_ROWS:
                return linear.int4.packed.nbytes + linear.int4.scale_and_zeros.nbytes
            linear = linear.wide
        if isinstance(linear, Int8Linear):
            if rows <= 2:  # INT8_MAX_ROWS: the int8 kernel
                return linear.qweight.nbytes + linear.scales.nbytes
            linear = linear.wide
        if isinstance(linear, PackedLinear):
            return linear.packed.numel() * linear.packed.element_size()
        assert isinstance(linear, DenseLinear)
        return linear.weight.nbytes

    weights = runner.model.weights
    total = size(weights.lm_head)
    for layer in weights.layers:
        total += sum(size(m) for m in (layer.qkv, layer.attn_output, layer.gate_up, layer.down))
    return total


def kv_bytes_per_position(runner: ModelRunner) -> int:
    return runner.cache.bytes_per_slot // runner.cache.keys.shape[3]


# --------------------------------------------------------------------------- decode


class DecodeLoop:
    """``batch`` slots prefilled with a prompt, then greedy decode steps of all of them."""

    def __init__(self, runner: ModelRunner, batch: int, prompt_len: int) -> None:
        self.runner, self.batch = runner, batch
        for slot in range(batch):
            runner.release(slot)
        self.tokens = [
            runner.step(
                StepBatch((StepRow(s, prompt_ids(prompt_len, s), 0, True, GREEDY),))
            ).next_token_ids[0]
            for s in range(batch)
        ]
        self.position = prompt_len

    def run(self, steps: int) -> float:
        """Seconds for ``steps`` decode steps."""
        started = time.perf_counter()
        for _ in range(steps):
            rows = tuple(
                StepRow(s, (self.tokens[s],), self.position, True, GREEDY)
                for s in range(self.batch)
            )
            self.tokens = list(self.runner.step(StepBatch(rows)).next_token_ids)
            self.position += 1
        return time.perf_counter() - started


def measure_decode(
    runners: dict[str, ModelRunner], args: argparse.Namespace, bandwidth_gb_s: float | None
) -> list[dict]:
    results = []
    for batch in args.batches:
        loops = {name: DecodeLoop(r, batch, args.prompt_len) for name, r in runners.items()}
        seconds: dict[str, list[float]] = {name: [] for name in runners}
        for loop in loops.values():
            loop.run(args.warmup)
        for trial in range(args.trials):
            order = list(loops.items())
            for name, loop in order if trial % 2 == 0 else reversed(order):
                seconds[name].append(loop.run(args.steps))
        for name, runner in runners.items():
            median, best = statistics.median(seconds[name]), min(seconds[name])
            entry = {
                "config": name,
                "batch": batch,
                "tokens_per_s_median": round(batch * args.steps / median, 1),
                "tokens_per_s_best": round(batch * args.steps / best, 1),
                "ms_per_step_median": round(1000 * median / args.steps, 2),
            }
            if bandwidth_gb_s:
                context = args.prompt_len + args.warmup + args.trials * args.steps // 2
                step_bytes = weight_bytes_per_step(runner, batch) + batch * context * (
                    kv_bytes_per_position(runner)
                )
                limit = batch * bandwidth_gb_s * 1e9 / step_bytes
                entry["bandwidth_limit_tokens_per_s"] = round(limit, 1)
                entry["share_of_limit_median"] = round(entry["tokens_per_s_median"] / limit, 2)
            results.append(entry)
            print(json.dumps(entry), flush=True)
    return results


def measure_threads(runner: ModelRunner, args: argparse.Namespace) -> list[dict]:
    results = []
    before = torch.get_num_threads()
    for batch in args.batches:
        loop = DecodeLoop(runner, batch, args.prompt_len)
        seconds: dict[int, list[float]] = {1: [], 2: []}
        for trial in range(args.trials):
            for threads in (1, 2) if trial % 2 == 0 else (2, 1):
                torch.set_num_threads(threads)
                loop.run(1)
                seconds[threads].append(loop.run(args.steps))
        for threads, values in seconds.items():
            entry = {
                "batch": batch,
                "threads": threads,
                "tokens_per_s_median": round(batch * args.steps / statistics.median(values), 1),
                "tokens_per_s_best": round(batch * args.steps / min(values), 1),
            }
            results.append(entry)
            print(json.dumps(entry), flush=True)
    torch.set_num_threads(before)
    return results


# --------------------------------------------------------------------------- mixed vs alternating


def measure_mixed(runner: ModelRunner, args: argparse.Namespace) -> dict:
    """15 decode rows + a 100-token chunk: one mixed step vs two steps."""
    decoders, chunk_slot, chunk = 15, 15, prompt_ids(100, 99)
    loop = DecodeLoop(runner, decoders, args.prompt_len)

    def decode_rows() -> tuple[StepRow, ...]:
        return tuple(
            StepRow(s, (loop.tokens[s],), loop.position, True, GREEDY) for s in range(decoders)
        )

    def advance(output_tokens) -> None:
        loop.tokens = list(output_tokens[:decoders])
        loop.position += 1

    mixed, alternating = [], []
    for trial in range(args.trials * 2):
        for kind in ("mixed", "alternating") if trial % 2 == 0 else ("alternating", "mixed"):
            runner.release(chunk_slot)
            chunk_row = StepRow(chunk_slot, chunk, 0, True, GREEDY)
            started = time.perf_counter()
            if kind == "mixed":
                output = runner.step(StepBatch((*decode_rows(), chunk_row)))
                advance(output.next_token_ids)
                mixed.append(time.perf_counter() - started)
            else:
                output = runner.step(StepBatch(decode_rows()))
                runner.step(StepBatch((chunk_row,)))
                advance(output.next_token_ids)
                alternating.append(time.perf_counter() - started)
    decode_only = []
    for _ in range(args.trials):
        started = time.perf_counter()
        advance(runner.step(StepBatch(decode_rows())).next_token_ids)
        decode_only.append(time.perf_counter() - started)
    result = {
        "mixed_ms": round(1000 * statistics.median(mixed), 1),
        "alternating_ms": round(1000 * statistics.median(alternating), 1),
        "decode_step_ms": round(1000 * statistics.median(decode_only), 1),
    }
    result["alternating_over_mixed"] = round(result["alternating_ms"] / result["mixed_ms"], 2)
    print(json.dumps(result), flush=True)
    return result


def measure_chunks(runner: ModelRunner, args: argparse.Namespace) -> list[dict]:
    """One short prompt chunk's step, through the fused C kernels (one row per token) against
    the eager path (SDPA), from position 0 and after a cached prefix, interleaved."""
    prefix = prompt_ids(args.chunk_prefix, 7)
    blocks = tuple(range(1, 1 + blocks_for(args.chunk_prefix + max(args.chunk_sizes))))
    runner.step(
        StepBatch((StepRow(0, prefix, 0, False, GREEDY, kv_blocks=KVBlocks(blocks, True)),))
    )
    runner.release(0)  # its blocks keep the prefix: chunks below start after it

    def step(tokens: int, start: int) -> float:
        ids = prompt_ids(start + tokens, 7)[start:]
        kv = KVBlocks(blocks, starts_sequence=True, prefix_token_ids=prefix[:start])
        started = time.perf_counter()
        runner.step(StepBatch((StepRow(0, ids, start, True, GREEDY, kv_blocks=kv),)))
        seconds = time.perf_counter() - started
        runner.release(0)
        return seconds

    results = []
    saved = (forward_plan.FUSED_PREFILL_MAX_TOKENS, forward_plan.FUSED_PREFILL_KEY_BUDGET)
    try:
        for start in (0, args.chunk_prefix):
            for tokens in args.chunk_sizes:
                times: dict[str, list[float]] = {"fused": [], "eager": []}
                for trial in range(args.trials + 1):
                    for kind in ("fused", "eager") if trial % 2 == 0 else ("eager", "fused"):
                        # fused: every chunk here takes the kernels; eager: none does
                        fused = kind == "fused"
                        forward_plan.FUSED_PREFILL_MAX_TOKENS = 1 << 20 if fused else 0
                        forward_plan.FUSED_PREFILL_KEY_BUDGET = 1 << 62 if fused else 0
                        seconds = step(tokens, start)
                        if trial:  # the first round warms both paths up
                            times[kind].append(seconds)
                fused_ms, eager_ms = (1000 * statistics.median(times[k]) for k in times)
                row = {
                    "start": start,
                    "tokens": tokens,
                    "fused_ms": round(fused_ms, 1),
                    "eager_ms": round(eager_ms, 1),
                    "fused_over_eager": round(fused_ms / eager_ms, 2),
                }
                print(json.dumps(row), flush=True)
                results.append(row)
    finally:
        forward_plan.FUSED_PREFILL_MAX_TOKENS, forward_plan.FUSED_PREFILL_KEY_BUDGET = saved
    return results


# --------------------------------------------------------------------------- agreement


def measure_agreement(reference: ModelRunner, candidate: ModelRunner, num_tokens: int) -> dict:
    """Teacher-forced greedy agreement and the largest |logit difference| (with the float32
    logit range for scale), over ``AGREEMENT_PROMPTS``."""
    agreed = total = 0
    worst = spread = 0.0
    for text in AGREEMENT_PROMPTS:
        ids = tuple(reference.tokenizer.encode(text))
        rows = [StepRow(0, ids, 0, True, GREEDY)]
        for position in range(len(ids), len(ids) + num_tokens):
            ref_logits = _logits(reference, rows[-1])
            cand_logits = _logits(candidate, rows[-1])
            want, got = int(ref_logits.argmax()), int(cand_logits.argmax())
            agreed, total = agreed + (want == got), total + 1
            worst = max(worst, (ref_logits - cand_logits).abs().max().item())
            spread = max(spread, (ref_logits.max() - ref_logits.min()).item())
            rows.append(StepRow(0, (want,), position, True, GREEDY))
        reference.release(0)
        candidate.release(0)
    return {
        "greedy_agreement": round(agreed / total, 3),
        "positions": total,
        "max_abs_logit_difference": round(worst, 3),
        "float32_logit_range": round(spread, 1),
    }


def _logits(runner: ModelRunner, row: StepRow) -> torch.Tensor:
    """The float32 logits of one row (a step through the runner's model and cache)."""
    plan = ForwardPlan.build(
        [RowSpec(row.slot, row.token_ids, row.position, True)], cache=runner.cache
    )
    with torch.inference_mode():
        return runner.model.forward(plan, runner.cache)[0].float()


# --------------------------------------------------------------------------- RSS


def measure_rss_child(config: Config) -> dict:
    """In a fresh process: RSS after loading 16 slots x 2048, after a 16-row prefill in
    512-token chunks, and with every cache position written."""
    import app.api.server  # noqa: F401  (the server's own imports, for a like-for-like RSS)

    runner = load_checkpoint(
        "smollm2",
        max_num_seqs=16,
        max_model_len=2048,
        dtype=config.dtype,
        quantization=config.quantization,
    )
    result = {"config": config.name, "after_load_mib": rss_mib()}
    for slot in range(16):
        ids = prompt_ids(512, slot)
        runner.step(StepBatch((StepRow(slot, ids, 0, True, GREEDY),)))
    result["after_16_prompts_of_512_mib"] = rss_mib()
    runner.cache.keys.fill_(0)  # what 16 sequences of 2048 positions leave resident
    runner.cache.values.fill_(0)
    result["every_position_written_mib"] = rss_mib()
    result["kv_cache_mib"] = round(runner.cache.total_bytes / 2**20, 1)
    result["kv_per_slot_mib"] = round(runner.cache.bytes_per_slot / 2**20, 2)
    return result


def measure_rss(configs: list[Config]) -> list[dict]:
    results = []
    for config in configs:
        child = [
            sys.executable,
            str(ENTRY_POINT),
            "--rss-child",
            f"{config.dtype}:{config.quantization}",
        ]
        done = subprocess.run(child, capture_output=True, text=True, env=os.environ)
        if done.returncode != 0:
            raise SystemExit(f"RSS of {config.name} failed:\n{done.stderr}")
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(results[-1]), flush=True)
    return results
