"""The one ``armkv`` command: generate, demo, calibrate, train, eval and bench.

Each subcommand lives in its own tool module with ``add_arguments(parser)`` and
``main(args) -> int``. The core install (``pip install armkv``) runs ``armkv --help``; a
tool that needs an optional extra says which one in one line when it runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from armkv.errors import ArmkvError

DESCRIPTION = """\
ARM (Attention with Routed-Memory): a fixed-size KV cache for Hugging Face
Llama-family models, with the baselines it is measured against.
Run 'armkv COMMAND --help' for a command's options."""

# name -> (module, one-line help).
SUBCOMMANDS = {
    "generate": ("armkv.tools.generate", "generate answers for a JSONL file with one cache method"),
    "demo": ("armkv.tools.demo", "needle-in-a-haystack demo: every method at one budget, table and plot"),
    "calibrate": ("armkv.train.calibrate", "training-free start: build each layer's tree from keys, save an adapter"),
    "train": ("armkv.train.cli", "train the ARM parameters (router, writes, policy)"),
    "eval": ("armkv.evals.cli", "evaluations: ruler, longbench, ablation, ppl, policy, reads, matrix"),
    "bench": ("armkv.bench.cli", "benchmarks: ops (memory kernels), decode (latency and memory against length)"),
    "report": ("armkv.tools.report", "the results page (docs/results.md) and README's table, from docs/results/*.json"),
}

# Top-level module -> the extra of pyproject.toml that installs it.
EXTRAS = {
    "transformers": "hf",
    "accelerate": "hf",
    "gguf": "hf",
    "tqdm": "hf",
    "matplotlib": "hf",
    "rouge_score": "eval",
    "rapidfuzz": "eval",
    "lm_eval": "eval",
    "datasets": "train",
    "peft": "train",
}


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written (their line breaks kept); every option's default shown once:
    appended unless its help already names it, and not for flags or options without one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            "default" in text
            or not action.option_strings
            or action.default is None
            or action.default is False
            or action.default == argparse.SUPPRESS
            or isinstance(action, (argparse._HelpAction, argparse._VersionAction))
        ):
            return text
        return text + " (default: %(default)s)"


def missing_extra(error: ModuleNotFoundError) -> str | None:
    """The extra that installs the module ``error`` is about, or None for a module no extra installs."""
    top = (error.name or "").split(".")[0]
    return EXTRAS.get(top)


def _format_all(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = HelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _format_all(child)


def build_parser() -> argparse.ArgumentParser:
    from armkv import __version__

    parser = argparse.ArgumentParser(prog="armkv", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"armkv {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            extra = missing_extra(e)
            if extra is None and not (e.name and e.name.startswith("armkv")):
                raise
            # the tool cannot even describe its options here: take any, and say why when it runs
            p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
            p.set_defaults(_missing=module_name, _extra=extra, _error=str(e))
            continue
        module.add_arguments(p)
        p.set_defaults(_main=module.main)
    _format_all(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if getattr(args, "_missing", None):
        if args._extra:
            print(
                f"armkv {args.command}: error: needs the '{args._extra}' extra ({args._error}): "
                f"pip install 'armkv[{args._extra}]'",
                file=sys.stderr,
            )
        else:
            print(f"armkv {args.command}: not available in this build ({args._missing} is missing)", file=sys.stderr)
        return 2
    try:
        return int(args._main(args) or 0)
    except ArmkvError as e:
        print(f"armkv {args.command}: error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        extra = missing_extra(e)
        if extra is None:
            raise
        print(
            f"armkv {args.command}: error: needs the '{extra}' extra ({e}): pip install 'armkv[{extra}]'",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        print(f"armkv {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
