"""The requests of a run and when they arrive, drawn from seeded generators.

Each aspect (prompt words, lengths, cancellation, arrival gaps) has its own random stream derived
from the seed, so changing one knob (say `--cancel-fraction`) leaves the others' draws unchanged.
`request_specs` and `arrival_offsets` restart from the seed on every call.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from loadgen.config import CancelMode, LengthDist, WorkloadConfig

# Common English words; with their leading space each is a single token for the usual BPE
# vocabularies, so a prompt of N words is about N tokens.
WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from "
    "or one had by word but not what all were we when your can said there use an each which she "
    "do how their if will up other about out many then them these so some her would make like "
    "him into time has look two more write go see number no way could people my than first water "
    "been call who oil its now find long down day did get come made may part over new sound take "
    "only little work know place year live me back give most very after thing our just name good "
    "sentence man think say great where help through much before line right too mean old any same "
    "tell boy follow came want show also around form three small set put end does another well "
    "large must big even such because turn here why ask went men read need land different home us"
).split()


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request to send: what to ask for, and whether, when and how the client cancels it.

    The load loop sends what the spec says, whoever made it: `request_specs` from a
    `WorkloadConfig`, or a script with its own mix (the soak).

    Attributes:
        request_id: sent as X-Request-Id (unless the run sends none); DELETE uses it.
        cancel_after_tokens: cancel once this many output tokens arrived; None: let it finish.
        cancel_mode: how it is cancelled (DELETE or the client leaving).
        raw_body: sent as the body instead of the JSON built from the fields (a malformed
            request, to check the server refuses it).
    """

    index: int
    request_id: str
    prompt: str
    max_tokens: int
    cancel_after_tokens: int | None
    stream: bool = True
    ignore_eos: bool = False
    temperature: float = 0.0
    cancel_mode: CancelMode = CancelMode.DELETE
    raw_body: bytes | None = None


@dataclass(frozen=True, slots=True)
class FilePrompt:
    """One line of a `--prompts-file`: {"prompt": "...", "max_tokens": 64} (max_tokens optional)."""

    prompt: str
    max_tokens: int | None


def request_specs(
    config: WorkloadConfig, num_requests: int | None, run_tag: str
) -> Iterator[RequestSpec]:
    """The run's requests in order: `num_requests` of them, or without end when None.

    A prompts file is read here, at once, so a bad one fails before the run starts.
    """
    file_prompts = read_prompts_file(config.prompts_file) if config.prompts_file else ()
    return generate_specs(config, file_prompts, num_requests, run_tag)


def generate_specs(
    config: WorkloadConfig,
    file_prompts: tuple[FilePrompt, ...],
    num_requests: int | None,
    run_tag: str,
) -> Iterator[RequestSpec]:
    prompt_rng = random.Random(f"{config.seed}:prompts")
    length_rng = random.Random(f"{config.seed}:lengths")
    cancel_rng = random.Random(f"{config.seed}:cancel")
    indices = itertools.count() if num_requests is None else range(num_requests)
    for index in indices:
        prompt_len = draw_length(length_rng, config.prompt_len, config.prompt_len_dist)
        output_len = draw_length(length_rng, config.output_len, config.output_len_dist)
        cancelled = cancel_rng.random() < config.cancel.fraction
        if file_prompts:
            line = file_prompts[index % len(file_prompts)]
            prompt = line.prompt
            output_len = line.max_tokens if line.max_tokens is not None else output_len
        else:
            prompt = synthetic_prompt(prompt_rng, prompt_len)
        yield RequestSpec(
            index=index,
            request_id=f"load-{run_tag}-{index}",
            prompt=prompt,
            max_tokens=output_len,
            cancel_after_tokens=config.cancel.after_tokens if cancelled else None,
            stream=config.stream,
            ignore_eos=config.ignore_eos,
            temperature=config.temperature,
            cancel_mode=config.cancel.mode,
        )


def draw_length(rng: random.Random, mean: int, dist: LengthDist) -> int:
    """One length (>= 1) with the given mean: fixed, uniform over mean±50%, or exponential."""
    if dist is LengthDist.FIXED:
        return mean
    if dist is LengthDist.UNIFORM:
        return rng.randint(max(1, round(mean * 0.5)), max(1, round(mean * 1.5)))
    return max(1, round(rng.expovariate(1.0 / mean)))


def synthetic_prompt(rng: random.Random, num_words: int) -> str:
    """`num_words` random common words; random from the first word, so no two share a prefix."""
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def read_prompts_file(path: Path) -> tuple[FilePrompt, ...]:
    """Read a JSONL prompts file; blank lines are skipped, anything else malformed raises."""
    prompts: list[FilePrompt] = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if line.strip():
                prompts.append(parse_prompt_line(line, f"{path}:{number}"))
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return tuple(prompts)


def parse_prompt_line(line: str, where: str) -> FilePrompt:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) or not item["prompt"]:
        raise ValueError(f'{where}: expected {{"prompt": "<non-empty text>", ...}}')
    max_tokens = item.get("max_tokens")
    if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
        raise ValueError(f"{where}: max_tokens must be an integer >= 1")
    return FilePrompt(prompt=item["prompt"], max_tokens=max_tokens)


def arrival_offsets(rate: float, burstiness: float, seed: int) -> Iterator[float]:
    """Send times in seconds from the run's start for an open loop; the first is 0.

    Inter-arrival times are gamma-distributed with shape `burstiness` and mean `1/rate`:
    burstiness 1 is a Poisson process, below 1 burstier, above 1 more regular. An infinite rate
    sends every request at time 0.
    """
    if math.isinf(rate):
        yield from itertools.repeat(0.0)
        return
    rng = random.Random(f"{seed}:arrivals")
    scale = 1.0 / (rate * burstiness)  # mean of gamma(shape, scale) is shape * scale
    offset = 0.0
    while True:
        yield offset
        offset += rng.gammavariate(burstiness, scale)
