"""``armkv bench``: one subcommand per benchmark.

Each benchmark is a module with ``add_arguments(parser)`` and ``main(args) -> int``, listed in
:data:`BENCHES` and imported only to build its parser. A module that is not in this build
(``ops`` until it is written) still gets a subcommand, which says so in one line.
"""

from __future__ import annotations

import importlib
import sys

# name -> (module, one-line help)
BENCHES = {
    "ops": ("armkv.bench.ops", "memory kernels: route, scan, read against their naive references"),
    "decode": ("armkv.bench.decode", "per-token decode latency, cache bytes and prefill throughput against length"),
}


def add_arguments(parser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name, (module_name, help_text) in BENCHES.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name != module_name:
                raise
            p.set_defaults(_bench_missing=module_name)
            continue
        module.add_arguments(p)
        p.set_defaults(_bench_main=module.main)


def main(args) -> int:
    missing = getattr(args, "_bench_missing", None)
    if missing:
        print(f"armkv bench {args.bench}: not available in this build ({missing} is missing)", file=sys.stderr)
        return 2
    return int(args._bench_main(args) or 0)
