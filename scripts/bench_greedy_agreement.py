"""Greedy agreement with llama.cpp's ``llama-server`` on the same GGUF file: ``--prompts``
prompts x ``--max-tokens`` greedy tokens through both servers' ``/v1/completions``; how many
completions are identical, and for the others the first token where they part.

    python scripts/bench_greedy_agreement.py --llama-server "$(../shared/tools/llama-server.sh)"
    python scripts/bench_greedy_agreement.py --model FILE.gguf --llama-server PATH

Both servers run one request at a time (no batching differences); tokens are compared after
our tokenizer re-encodes llama.cpp's text (the same vocabulary: the same file).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

import httpx
from harness.server import Server, ServerSpec
from scenarios.model_serving import READY_TIMEOUT_S, TOPICS

from app.models.checkpoints.gguf_file import GGUFFile
from app.models.load.smollm2 import smollm2_gguf_path
from app.models.tokenizers import load_gguf_tokenizer

PROMPTS = [
    *(f"Write a short story about {topic}." for topic in TOPICS),
    "The capital of France is",
    "def fibonacci(n):",
    "Question: What is the boiling point of water?\nAnswer:",
    "List three primary colors:",
]


async def completions(url: str, prompts: list[str], max_tokens: int) -> list[str]:
    texts = []
    async with httpx.AsyncClient(trust_env=False, timeout=600) as http:
        for prompt in prompts:
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
            answer = await http.post(f"{url}/v1/completions", json=body)
            answer.raise_for_status()
            texts.append(answer.json()["choices"][0]["text"])
    return texts


async def run(args: argparse.Namespace) -> dict:
    model = args.model or smollm2_gguf_path()
    prompts = PROMPTS[: args.prompts]
    ours = ServerSpec(
        "slotserve",
        (sys.executable, "-m", "app", "serve", "--host", "127.0.0.1", "--model", str(model))
        + ("--quantization", args.quantization, "--max-num-seqs", "1", "--log-level", "warning"),
        ready_timeout_s=READY_TIMEOUT_S,
    )
    llama = ServerSpec(
        "llama.cpp",
        (args.llama_server, "-m", str(model), "--host", "127.0.0.1", "-np", "1", "-c", "2048")
        + ("-t", "2", "--log-disable"),
        has_metrics=False,
        ready_timeout_s=READY_TIMEOUT_S,
    )
    results = {}
    with tempfile.TemporaryDirectory() as logs:
        for spec in (ours, llama):
            server = Server(spec, Path(logs))
            server.start()
            try:
                await server.wait_ready()
                results[spec.name] = await completions(server.url, prompts, args.max_tokens)
            finally:
                server.stop()
    tokenizer = load_gguf_tokenizer(GGUFFile(Path(model)))
    report = {"model": str(model), "prompts": len(prompts), "identical": 0, "diverged": []}
    for prompt, a, b in zip(prompts, results["slotserve"], results["llama.cpp"], strict=True):
        ours_ids, theirs_ids = tokenizer.encode(a), tokenizer.encode(b)
        if ours_ids == theirs_ids:
            report["identical"] += 1
            continue
        first = next(
            (i for i, (x, y) in enumerate(zip(ours_ids, theirs_ids, strict=False)) if x != y),
            min(len(ours_ids), len(theirs_ids)),
        )
        report["diverged"].append(
            {"prompt": prompt, "first_divergent_token": first, "ours": a, "llama.cpp": b}
        )
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="default: the bundled SmolLM2")
    parser.add_argument("--llama-server", required=True)
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--json", type=Path, default=Path("out/greedy_agreement.json"))
    args = parser.parse_args()
    report = asyncio.run(run(args))
    print(json.dumps(report, indent=2))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
