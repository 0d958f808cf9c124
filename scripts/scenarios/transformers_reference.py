"""The reference our server is measured against: ``transformers`` ``generate`` on the same GGUF,
one static left-padded batch per wave, and the agreement of two sets of greedy token streams."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from app.models.load.smollm2 import smollm2_gguf_path
from scenarios.model_serving import StreamRecord, Wave, make_prompt


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
