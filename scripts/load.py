"""Load generator for slotserve: sends generation requests and reports TTFT, TPOT, ITL, E2E,
throughput and goodput as the client measured them.

Closed loop (--concurrency N) keeps N requests in flight; open loop (--rate R) sends requests at
gamma-distributed arrival times (mean 1/R, shape --burstiness; 1.0 is Poisson) whatever is in
flight. Every run is bounded by --num-requests and/or --duration, whichever comes first; requests
in flight when it stops are allowed to finish (each bounded by --timeout).

Examples:
  python scripts/load.py --url http://127.0.0.1:8000 --concurrency 8 --num-requests 200
  python scripts/load.py --rate 4 --burstiness 0.5 --duration 60 --output-len 256 \\
      --output-len-dist exponential --slo-ttft-ms 500 --slo-tpot-ms 50 --out results.json
  python scripts/load.py --concurrency 4 --num-requests 50 --cancel-fraction 0.3 \\
      --cancel-after-tokens 8 --cancel-mode disconnect --plot load.png

Outcomes: ok, cancelled (by this client), rejected (429/503; Retry-After is not honoured, only
counted), error (other statuses and `event: error`, by status and error.type), transport_error.
Latencies are over ok requests; percentiles interpolate linearly (as numpy's default).
See scripts/loadgen/report.py for the layout of --out and scripts/loadgen/stats.py for the exact
definition of every number.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from enum import StrEnum
from pathlib import Path

from loadgen import Api, CancelMode, CancelPolicy, LengthDist, LoadConfig, Transport, WorkloadConfig
from loadgen.report import ProgressDisplay, print_summary, write_json
from loadgen.runner import LoadResult, run_load
from loadgen.workload import read_prompts_file
from rich.console import Console


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Keeps the examples' line breaks and shows each flag's default, when it has one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def add_choice(group: argparse._ArgumentGroup, flag: str, default: StrEnum, help: str) -> None:
    """A flag whose values are the members of ``default``'s enum."""
    kind = type(default)
    group.add_argument(flag, type=kind, choices=list(kind), default=default, help=help)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="load.py", description=__doc__, formatter_class=HelpFormatter
    )
    add_target_flags(parser.add_argument_group("server"))
    add_load_flags(parser.add_argument_group("load shape (give --concurrency or --rate)"))
    add_workload_flags(parser.add_argument_group("workload"))
    add_cancel_flags(parser.add_argument_group("cancellation"))
    add_report_flags(parser.add_argument_group("measurement and output"))
    return parser


def add_target_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    add_choice(
        group,
        "--api",
        Api.NATIVE,
        "native: POST /generate (SSE event: token/done); "
        "openai: POST /v1/completions (SSE data: {...} / data: [DONE])",
    )
    group.add_argument("--api-key", metavar="KEY", help="sent as 'Authorization: Bearer KEY'")
    group.add_argument(
        "--model", metavar="NAME", help="'model' field of OpenAI requests (omitted when not given)"
    )
    group.add_argument(
        "--timeout",
        type=float,
        metavar="S",
        default=300.0,
        help="seconds one request may take in all",
    )
    add_choice(
        group,
        "--transport",
        Transport.HTTPX,
        "httpx; aiohttp: less client CPU a request and a token (bursts of 100s of requests a "
        "second, hundreds of streams); streams are parsed by httpx-sse either way",
    )
    group.add_argument(
        "--request-ids",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send X-Request-Id (--no-request-ids: the server makes the ids)",
    )


def add_load_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--concurrency", type=int, metavar="N", help="closed loop: keep N requests in flight"
    )
    group.add_argument(
        "--rate",
        type=float,
        metavar="R",
        help="open loop: mean arrivals per second ('inf': all at once, needs --num-requests)",
    )
    group.add_argument(
        "--burstiness",
        type=float,
        metavar="SHAPE",
        default=1.0,
        help="open loop: shape of the gamma inter-arrival times (1 = Poisson, <1 burstier)",
    )
    group.add_argument("--num-requests", type=int, metavar="N", help="stop after sending this many")
    group.add_argument(
        "--duration", type=float, metavar="S", help="stop sending after this many seconds"
    )


def add_workload_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--prompt-len",
        type=int,
        metavar="TOKENS",
        default=128,
        help="mean prompt length in tokens (~words)",
    )
    add_choice(
        group,
        "--prompt-len-dist",
        LengthDist.FIXED,
        "prompt length: fixed, uniform over mean±50%%, or exponential",
    )
    group.add_argument(
        "--output-len",
        type=int,
        metavar="TOKENS",
        default=128,
        help="mean output length (sent as max_tokens)",
    )
    add_choice(
        group,
        "--output-len-dist",
        LengthDist.FIXED,
        "output length: fixed, uniform over mean±50%%, or exponential",
    )
    group.add_argument(
        "--prompts-file",
        type=Path,
        metavar="FILE",
        help='JSONL, one {"prompt": ..., "max_tokens": ...} a line (max_tokens optional); '
        "used in order and cycled; replaces the synthetic prompts",
    )
    group.add_argument(
        "--ignore-eos", action="store_true", help="generate until max_tokens even past EOS"
    )
    group.add_argument(
        "--temperature", type=float, metavar="T", default=0.0, help="sampling temperature"
    )
    group.add_argument(
        "--stream",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="stream tokens (needed for TTFT, ITL, TPOT and cancellation)",
    )
    group.add_argument(
        "--seed",
        type=int,
        metavar="N",
        default=0,
        help="makes prompts, lengths, arrivals, cancels repeatable",
    )


def add_cancel_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--cancel-fraction",
        type=float,
        metavar="F",
        default=0.0,
        help="fraction of requests to cancel",
    )
    group.add_argument(
        "--cancel-after-tokens",
        type=int,
        metavar="K",
        default=1,
        help="cancel a chosen request once it has received this many output tokens",
    )
    add_choice(
        group,
        "--cancel-mode",
        CancelMode.DELETE,
        "delete: DELETE /generate/{X-Request-Id} (native API only); disconnect: close the stream",
    )


def add_report_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--slo-ttft-ms", type=float, metavar="MS", help="TTFT objective for goodput (ms)"
    )
    group.add_argument(
        "--slo-tpot-ms", type=float, metavar="MS", help="TPOT objective for goodput (ms)"
    )
    group.add_argument(
        "--out",
        type=Path,
        metavar="FILE",
        help="write config, summary and every request's record as JSON",
    )
    group.add_argument(
        "--plot",
        type=Path,
        metavar="FILE",
        help="write a PNG: TTFT/TPOT/E2E CDFs and output tokens/s over time",
    )
    group.add_argument(
        "--no-progress", action="store_true", help="no progress bar (e.g. in CI logs)"
    )


def config_from_args(args: argparse.Namespace) -> LoadConfig:
    """Build the run's config; raises ValueError naming the flags when they don't fit."""
    workload = WorkloadConfig(
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        prompt_len_dist=args.prompt_len_dist,
        output_len_dist=args.output_len_dist,
        prompts_file=args.prompts_file,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        stream=args.stream,
        cancel=CancelPolicy(
            fraction=args.cancel_fraction,
            after_tokens=args.cancel_after_tokens,
            mode=args.cancel_mode,
        ),
        seed=args.seed,
    )
    return LoadConfig(
        url=args.url,
        concurrency=args.concurrency,
        rate=args.rate,
        burstiness=args.burstiness,
        num_requests=args.num_requests,
        duration_s=args.duration,
        api=args.api,
        api_key=args.api_key,
        model=args.model,
        transport=args.transport,
        send_request_ids=args.request_ids,
        timeout_s=args.timeout,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        workload=workload,
    )


def describe(config: LoadConfig) -> str:
    load = (
        f"closed loop, concurrency {config.concurrency}"
        if config.closed_loop
        else f"open loop, rate {config.rate}/s, burstiness {config.burstiness}"
    )
    bounds = [f"{config.num_requests} requests"] if config.num_requests else []
    bounds += [f"{config.duration_s:g} s"] if config.duration_s else []
    mode = "stream" if config.workload.stream else "no stream"
    return f"{config.api.value} API at {config.url}: {load}, {' or '.join(bounds)}, {mode}"


def run_with_progress(config: LoadConfig, console: Console, show: bool) -> LoadResult:
    if not show:
        return asyncio.run(run_load(config))
    with ProgressDisplay(config, console) as progress:
        return asyncio.run(run_load(config, on_record=progress.on_record))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
        if config.workload.prompts_file is not None:
            read_prompts_file(config.workload.prompts_file)  # fail now, not mid-run
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    console = Console()
    console.print(describe(config))
    try:
        result = run_with_progress(config, Console(stderr=True), show=not args.no_progress)
    except KeyboardInterrupt:
        console.print("interrupted: no summary")
        return 130
    print_summary(result, console)
    if args.out is not None:
        write_json(result, args.out)
        console.print(f"wrote {args.out}")
    if args.plot is not None:
        from loadgen.plot import write_plot  # matplotlib is slow to import: only when asked

        write_plot(result, args.plot)
        console.print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
