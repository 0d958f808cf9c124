"""What a JSON-schema constraint costs: completion tok/s with and without one, at 1 and at 16
concurrent streams, interleaved round by round in one process (``app.llm.LLM`` on SmolLM2, the
server's scheduler and request builder without HTTP), and the compile time of the schema corpus
(``scenarios.schema_corpus``) on a fresh compiler: the first compile of each schema, then its
first mask (llguidance builds the lexer lazily).

Both sides generate ``max_tokens`` tokens per request: the free side with ``ignore_eos``, the
constrained side with a schema that cannot be complete before then (an array of up to 64
strings), so the two do the same number of model steps and differ only in the mask's cost.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from app.constraints import ConstraintCompiler, ConstraintSpec
from app.llm import LLM, SamplingOptions
from scenarios.schema_corpus import SCHEMA_CORPUS

LONG_SCHEMA = {
    "type": "array",
    "items": {"type": "string", "minLength": 8, "maxLength": 40},
    "minItems": 64,
    "maxItems": 64,
}
PROMPT = "List some things you can find in a kitchen, as a JSON array of strings: "


@dataclass(frozen=True, slots=True)
class ThroughputRound:
    streams: int
    free_tok_s: float
    constrained_tok_s: float

    @property
    def ratio(self) -> float:
        return self.constrained_tok_s / self.free_tok_s


@dataclass(frozen=True, slots=True)
class CompileTimes:
    compile_ms: tuple[float, ...]
    first_mask_ms: tuple[float, ...]


def throughput(llm: LLM, streams: int, max_tokens: int, *, constrained: bool) -> float:
    """Completion tokens per second of ``streams`` requests run together."""
    if constrained:
        options = SamplingOptions(
            max_tokens=max_tokens,
            temperature=0.8,
            constraint={"type": "json_schema", "schema": LONG_SCHEMA},
        )
    else:
        options = SamplingOptions(max_tokens=max_tokens, temperature=0.8, ignore_eos=True)
    started = time.perf_counter()
    results = llm.generate([PROMPT] * streams, options)
    elapsed = time.perf_counter() - started
    return sum(len(result.token_ids) for result in results) / elapsed


def run_throughput(
    llm: LLM, *, rounds: int, max_tokens: int, streams: tuple[int, ...] = (1, 16)
) -> list[ThroughputRound]:
    """Interleaved rounds: per round and per stream count, free then constrained."""
    for count in streams:  # warm: the vocabulary adapter, the compile cache, the kernels
        throughput(llm, count, 8, constrained=False)
        throughput(llm, count, 8, constrained=True)
    measured = []
    for _ in range(rounds):
        for count in streams:
            free = throughput(llm, count, max_tokens, constrained=False)
            tied = throughput(llm, count, max_tokens, constrained=True)
            measured.append(ThroughputRound(count, free, tied))
    return measured


def run_compile(llm: LLM) -> CompileTimes:
    """Each corpus schema compiled on a fresh compiler (the vocabulary built first, untimed)."""
    compiler = ConstraintCompiler(llm.model.tokenizer, llm.capabilities)
    compiler.compile(ConstraintSpec.json_object())
    compile_ms, mask_ms = [], []
    for case in SCHEMA_CORPUS:
        started = time.perf_counter()
        compiled = compiler.compile(ConstraintSpec.json_schema(case.schema))
        compiled_at = time.perf_counter()
        compiled.new_matcher().next_mask()
        compile_ms.append((compiled_at - started) * 1000)
        mask_ms.append((time.perf_counter() - compiled_at) * 1000)
    return CompileTimes(tuple(compile_ms), tuple(mask_ms))


def summary(rounds: list[ThroughputRound], compiled: CompileTimes) -> list[str]:
    lines = []
    for count in sorted({r.streams for r in rounds}):
        these = [r for r in rounds if r.streams == count]
        lines.append(
            f"{count:>2} streams: free {statistics.median(r.free_tok_s for r in these):7.1f} tok/s,"
            f" json-schema {statistics.median(r.constrained_tok_s for r in these):7.1f} tok/s,"
            f" ratio {statistics.median(r.ratio for r in these):.3f}"
            f" (per round: {', '.join(f'{r.ratio:.3f}' for r in these)})"
        )
    lines.append(
        f"compile ({len(compiled.compile_ms)} schemas): total {sum(compiled.compile_ms):.1f} ms, "
        f"median {statistics.median(compiled.compile_ms):.2f} ms, "
        f"max {max(compiled.compile_ms):.2f} ms; first mask median "
        f"{statistics.median(compiled.first_mask_ms):.2f} ms, "
        f"max {max(compiled.first_mask_ms):.2f} ms"
    )
    return lines
