"""What one ``bench.py`` invocation runs: every scenario's sizes, full or ``--quick``.

Pure data; each scenario module reads its own sizes from the ``Plan`` in its ``Context``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path


@dataclass(frozen=True, slots=True)
class SaturationSizes:
    """Scenario 1: a closed loop of 2 x slots keeps every slot busy (the queue refills them)."""

    slots: int = 64
    step_ms: float = 10.0
    output_len: int = 128
    prompt_len: int = 8
    warmup_s: float = 1.5
    duration_s: float = 8.0
    bin_s: float = 0.25


@dataclass(frozen=True, slots=True)
class SseSizes:
    """Scenario 2: the same closed loop against the full stack and the two ceilings."""

    slots: int = 16
    concurrency: int = 16
    output_len: int = 256
    prompt_len: int = 8
    warmup_s: float = 1.0
    duration_s: float = 5.0


@dataclass(frozen=True, slots=True)
class SchedulingSizes:
    """Scenario 3, one model: a closed loop of 2 x slots over a fixed set of requests."""

    model: str
    slots: int
    num_requests: int
    mean_output_len: int
    prompt_len: int
    step_ms: float = 0.0  # mock only


@dataclass(frozen=True, slots=True)
class ConcurrencySizes:
    """Scenario 4: SmolLM2, ``requests[i]`` requests at concurrency ``levels[i]``."""

    slots: int = 16
    levels: tuple[int, ...] = (1, 4, 16)
    requests: tuple[int, ...] = (3, 8, 16)
    output_len: int = 64
    prompt_len: int = 16


@dataclass(frozen=True, slots=True)
class CancelSizes:
    """Scenario 5: 2 x slots clients, so a queue is there to refill a freed slot at once."""

    slots: int = 32
    step_ms: float = 10.0
    concurrency: int = 64
    output_len: int = 128
    prompt_len: int = 8
    cancel_fraction: float = 0.3
    cancel_after_tokens: int = 16
    warmup_s: float = 1.5
    duration_s: float = 8.0
    bin_s: float = 0.5


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything one invocation runs; `build_plan` makes the full or the --quick one."""

    scenarios: tuple[int, ...]
    repeats: int
    quick: bool
    smollm2: bool
    out_dir: Path
    argv: tuple[str, ...]
    s1: SaturationSizes = SaturationSizes()
    s2: SseSizes = SseSizes()
    s3_mock: SchedulingSizes = SchedulingSizes("mock", 16, 128, 48, 8, step_ms=10.0)
    s3_smollm2: SchedulingSizes = SchedulingSizes("smollm2", 8, 24, 32, 16)
    s4: ConcurrencySizes = ConcurrencySizes()
    s5: CancelSizes = CancelSizes()


def build_plan(args: argparse.Namespace, argv: Sequence[str]) -> Plan:
    plan = Plan(
        scenarios=args.scenarios,
        repeats=args.repeats if args.repeats is not None else (1 if args.quick else 3),
        quick=args.quick,
        smollm2=args.smollm2 if args.smollm2 is not None else not args.quick,
        out_dir=args.out_dir,
        argv=tuple(argv),
    )
    s1 = {
        name: value
        for name, value in (("slots", args.s1_slots), ("step_ms", args.s1_step_ms))
        if value is not None
    }
    if s1:
        plan = replace(plan, s1=replace(plan.s1, **s1))
    if not args.quick:
        return plan
    return replace(
        plan,
        s1=replace(plan.s1, output_len=32, warmup_s=0.5, duration_s=2.5),
        s2=SseSizes(output_len=128, warmup_s=0.2, duration_s=0.8),
        s3_mock=SchedulingSizes("mock", 16, 32, 16, 8, step_ms=10.0),
        s3_smollm2=SchedulingSizes("smollm2", 4, 8, 8, 8),
        s4=ConcurrencySizes(levels=(1, 4, 16), requests=(1, 4, 16), output_len=8),
        s5=CancelSizes(output_len=32, cancel_after_tokens=8, warmup_s=0.4, duration_s=1.4),
    )
