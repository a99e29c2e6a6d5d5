"""The one ``armkv`` command. Each subcommand lives in its own tool module, imported
only when that subcommand runs, so ``armkv --help`` stays fast and the library core
never imports a tool."""

from __future__ import annotations

import argparse
import importlib
import sys

from armkv.errors import ArmkvError

# name -> (module, one-line help). Each module defines add_arguments(parser) and main(args) -> int.
SUBCOMMANDS = {
    "generate": ("armkv.tools.generate", "generate answers for a JSONL file with one cache method"),
    "demo": ("armkv.tools.demo", "needle-in-a-haystack demo: every method at one budget, table and plot"),
    "calibrate": ("armkv.train.calibrate", "training-free start: build each layer's tree from keys, save an adapter"),
    "train": ("armkv.train.cli", "train the ARM parameters (router, writes, policy)"),
    "eval": ("armkv.evals.cli", "evaluations: ruler, longbench, ablation, ppl"),
    "bench": ("armkv.bench.cli", "benchmarks: ops (memory kernels), decode (latency and memory against length)"),
    "report": ("armkv.tools.report", "the results page (docs/results.md) and README's table, from docs/results/*.json"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="armkv", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith("armkv"):
                p.set_defaults(_missing=module_name)
                continue
            raise
        module.add_arguments(p)
        p.set_defaults(_main=module.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if getattr(args, "_missing", None):
        print(f"armkv {args.command}: not available in this build ({args._missing} is missing)", file=sys.stderr)
        return 2
    try:
        return int(args._main(args) or 0)
    except ArmkvError as e:
        print(f"armkv {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"armkv {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
