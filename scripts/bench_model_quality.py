"""Greedy quality of the model's configurations against float32, teacher-forced (no HTTP).

    python scripts/bench_model_quality.py                       # SmolLM2, ~5 minutes
    python scripts/bench_model_quality.py --model path/to.gguf --configs bfloat16:auto

For every prompt of a fixed set, float32 decodes ``--tokens`` greedy tokens; each configuration
is then fed the same tokens (teacher forcing: at every position both have seen float32's
tokens) and scores the share of positions where its own greedy token equals float32's, with
the largest logit difference. Each configuration runs twice: one sequence per step (``1 row``:
the int4 kernel's path for int4, at most 4 rows) and every prompt in one step (``N rows``: the
path of a busy server; for int4 above 4 rows its bfloat16 copy of the 4-bit weights).
``auto`` is the server's default (``--quantization auto``). Writes
``out/bench_model_quality.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.models.forward.forward_plan import ForwardPlan, RowSpec  # noqa: E402
from app.models.load.plan import load_checkpoint  # noqa: E402
from app.models.runner import ModelRunner  # noqa: E402

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village by the sea,",
    "The three primary colours are",
    "<|im_start|>user\nWrite a haiku about autumn.<|im_end|>\n<|im_start|>assistant\n",
    "import numpy as np\n\ndef normalize(x):",
    "Water boils at a temperature of",
    "<|im_start|>user\nName three planets of the solar system.<|im_end|>\n<|im_start|>assistant\n",
    "The largest ocean on Earth is",
    "SELECT name, age FROM users WHERE",
    "<|im_start|>user\nTranslate 'good morning' into Spanish.<|im_end|>\n<|im_start|>assistant\n",
    "Photosynthesis is the process by which",
    "1, 1, 2, 3, 5, 8, 13,",
    "<|im_start|>user\nWhy is the sky blue?<|im_end|>\n<|im_start|>assistant\n",
    "The French Revolution began in",
)


def _logits(runner: ModelRunner, rows: list[RowSpec]) -> torch.Tensor:
    plan = ForwardPlan.build(rows, cache=runner.cache)
    with torch.inference_mode():
        return runner.model.forward(plan, runner.cache).float()


def reference_tokens(runner: ModelRunner, prompts: list[list[int]], count: int) -> list[list[int]]:
    """float32's greedy continuation of each prompt, one sequence at a time."""
    out = []
    for ids in prompts:
        tokens = [int(_logits(runner, [RowSpec(0, ids, 0, True)])[0].argmax())]
        for position in range(len(ids), len(ids) + count - 1):
            row = RowSpec(0, [tokens[-1]], position, True)
            tokens.append(int(_logits(runner, [row])[0].argmax()))
        out.append(tokens)
    return out


def teacher_forced(
    runner: ModelRunner, prompts: list[list[int]], expected: list[list[int]], *, together: bool
) -> list[torch.Tensor]:
    """Each prompt's logits ``[count, vocab]`` with float32's tokens fed back: one sequence per
    step, or all of them in every step (``together``)."""
    groups = [list(range(len(prompts)))] if together else [[i] for i in range(len(prompts))]
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    for group in groups:
        rows = [RowSpec(slot, prompts[i], 0, True) for slot, i in enumerate(group)]
        for step in range(len(expected[0])):
            step_logits = _logits(runner, rows)
            for slot, i in enumerate(group):
                logits[i].append(step_logits[slot])
            rows = [
                RowSpec(slot, [expected[i][step]], len(prompts[i]) + step, True)
                for slot, i in enumerate(group)
            ]
    for slot in range(len(prompts)):
        runner.release(slot)
    return [torch.stack(rows) for rows in logits]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--configs", default="bfloat16:none,bfloat16:auto,bfloat16:int8")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("out/bench_model_quality.json"))
    args = parser.parse_args()
    started = time.perf_counter()
    slots = len(PROMPTS)
    reference = load_checkpoint(
        args.model, max_num_seqs=slots, max_model_len=512, dtype="float32", quantization="none"
    )
    prompts = [reference.tokenizer.encode(text) for text in PROMPTS]
    expected = reference_tokens(reference, prompts, args.tokens)
    wanted = torch.tensor(expected)
    reference_logits = teacher_forced(reference, prompts, expected, together=False)
    report: dict = {"model": args.model, "positions": wanted.numel(), "configs": {}}
    for config in args.configs.split(","):
        dtype, quantization = config.split(":")
        runner = load_checkpoint(
            args.model,
            max_num_seqs=slots,
            max_model_len=512,
            dtype=dtype,
            quantization=quantization,
        )
        result = {"backend": runner.capabilities.backend}
        for together in (False, True):
            logits = teacher_forced(runner, prompts, expected, together=together)
            got = torch.stack([row.argmax(-1) for row in logits])
            pairs = zip(logits, reference_logits, strict=True)
            worst = max((a - b).abs().max().item() for a, b in pairs)
            result["16 rows" if together else "1 row"] = {
                "greedy_agreement": round((got == wanted).float().mean().item(), 4),
                "max_abs_logit_difference": round(worst, 3),
            }
        report["configs"][config] = result
        print(json.dumps({config: result}), flush=True)
    spread = max((r.max(-1).values - r.min(-1).values).max().item() for r in reference_logits)
    report["float32_logit_range"] = round(spread, 1)
    report["seconds"] = round(time.perf_counter() - started, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
