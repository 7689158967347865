"""Command line: ``python -m benchmarks demo|bench``, run from the repository root."""

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    """The command line: ``demo`` and ``bench`` with their flags."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="replay the five field reports: today's way, stock, ours, the truth")
    demo.add_argument("--world-size", type=int, default=4, help="gloo CPU processes to spawn (default 4)")
    demo.add_argument("--report", type=int, choices=range(1, 6), default=None, help="run one section (1-5) only")
    bench = commands.add_parser("bench", help="stock torchmetrics vs torchmetrics_varlen sync cost, side by side")
    bench.add_argument("--world-size", type=int, default=2, help="gloo CPU processes to spawn (default 2)")
    bench.add_argument("--repeats", type=int, default=25, help="syncs per case; the median is reported")
    bench.add_argument("--json", dest="json_path", default=None, help="also write the results to this JSON file")
    bench.add_argument("--plot", dest="plot_path", default=None, help="write a PNG plot (needs matplotlib)")
    bench.add_argument("--table", dest="table_path", default=None, help="write the table as reStructuredText")
    bench.add_argument("--quick", action="store_true", help="smaller sizes, for smoke tests")
    bench.add_argument(
        "--memory-samples",
        type=int,
        default=None,
        help="samples of the memory case (BinaryAUROC, all-gather vs one-rank compute; default 4M, 0 skips it)",
    )
    bench.add_argument(
        "--skew",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the large-state cases: a skewed cat state (bytes, time, peak memory per rank; stock, padded gather, ours)"
        " and the memory of sync() alone (default: on; --no-skew skips them)",
    )
    bench.add_argument(
        "--skew-world-size", type=int, default=8, help="ranks of the skew case (default 8; --quick: at most 4)"
    )
    bench.add_argument("--skew-base", type=int, default=None, help="samples per rank (default 250k, quick 20k)")
    bench.add_argument("--skew-factor", type=int, default=8, help="the big rank holds this times the base (8)")
    bench.add_argument(
        "--scale",
        action="store_true",
        help="the scale benchmark instead: bytes per rank vs world size, planner time, small-metric latency",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run the demo or the benchmark."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.world_size < 1:
        parser.error(f"Expected `--world-size` to be at least 1 but got {args.world_size}")
    if args.command == "demo":
        from benchmarks.demo import main as demo_main

        return demo_main(args.world_size, args.report)
    if args.scale:  # its own world sizes (2, 4, 8) and repeats; shares --json, --plot, --table and --quick
        from benchmarks.scale import main as scale_main

        return scale_main(args.json_path, args.plot_path, args.table_path, args.quick)
    from benchmarks.bench import main as bench_main

    if args.memory_samples is not None and args.memory_samples < 0:
        parser.error(f"Expected `--memory-samples` to be 0 or more but got {args.memory_samples}")
    for flag, value, least in (("--skew-world-size", args.skew_world_size, 2), ("--skew-base", args.skew_base, 1)):
        if value is not None and value < least:
            parser.error(f"Expected `{flag}` to be at least {least} but got {value}")
    if args.skew_factor < 1:
        parser.error(f"Expected `--skew-factor` to be at least 1 but got {args.skew_factor}")
    skew = {"world_size": args.skew_world_size, "base": args.skew_base, "factor": args.skew_factor}
    return int(
        bench_main(
            args.world_size,
            args.repeats,
            args.json_path,
            args.plot_path,
            args.quick,
            args.table_path,
            args.memory_samples,
            skew if args.skew else None,
        )
    )


if __name__ == "__main__":
    sys.exit(main())
