"""A GGUF file served side by side: our server on the file's own blocks (and other
``--quantization`` modes) against llama.cpp's ``llama-server`` on the same file, same
context, same threads (``scenarios/gguf_serving.py``).

    python scripts/bench_gguf.py --llama-server "$(../shared/tools/llama-server.sh)"
    python scripts/make_random_gguf.py out/llama-1b-q4_k.gguf
    python scripts/bench_gguf.py --model out/llama-1b-q4_k.gguf --sizes 1,8,32 \\
        --llama-server "$(../shared/tools/llama-server.sh)"

Reports, per system: load time (process start to a healthy ``/health``), RSS after load, peak
RSS (``VmHWM``, after the widest wave), decode tok/s per wave size (completion tokens over the
wave's wall time, the median of ``--rounds``), and prefill tok/s of a ~``--prefill-tokens``
prompt (its prompt tokens over its time to first token, the better of two); then the ratios
to llama.cpp. Writes ``--json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

from scenarios.gguf_serving import GGUFBench, print_report, run_gguf_bench

from app.models.load.smollm2 import smollm2_gguf_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="default: the bundled SmolLM2")
    parser.add_argument(
        "--modes",
        default="auto",
        help="our --quantization modes, e.g. auto,int4,auto+off,auto@/tmp/before "
        "(+on / +off: --wide-copies; @TREE: the server of another checkout)",
    )
    parser.add_argument("--llama-server", help="path of llama.cpp's llama-server binary")
    parser.add_argument("--sizes", default="1,16,64", help="streams per wave")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--prefill-tokens", type=int, default=1000)
    parser.add_argument("--json", type=Path, default=Path("out/bench_gguf.json"))
    args = parser.parse_args()
    sizes = [int(n) for n in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as logs:
        bench = GGUFBench(
            model=args.model or smollm2_gguf_path(),
            modes=args.modes.split(","),
            llama_server=args.llama_server,
            sizes=sizes,
            rounds=args.rounds,
            max_tokens=args.max_tokens,
            threads=args.threads,
            max_model_len=args.max_model_len,
            prefill_tokens=args.prefill_tokens,
            log_dir=Path(logs),
        )
        report = asyncio.run(run_gguf_bench(bench))
    print_report(report, sizes)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
