"""``armkv eval``: one subcommand per evaluation.

Each evaluation is a module with ``add_arguments(parser)`` and ``main(args) -> int``,
listed in :data:`EVALS`; adding an evaluation is one file and one line here.
"""

from __future__ import annotations

import importlib

# name -> (module, one-line help)
EVALS = {
    "ruler": ("armkv.evals.ruler", "RULER's 13 synthetic tasks by context length, every method at one budget"),
    "longbench": ("armkv.evals.longbench", "LongBench from local JSONL files, the official prompts and metrics"),
    "ablation": ("armkv.evals.ablation", "the paper's Table 6: ARM variants on RULER's needle tasks"),
    "ppl": ("armkv.evals.ppl", "perplexity through each cache method"),
    "policy": ("armkv.evals.policy", "the top-M the policy picks, per layer and input (histogram)"),
    "reads": (
        "armkv.evals.reads",
        "the share of the full read's attention that sparse reads skip, on RULER needle samples",
    ),
    "matrix": ("armkv.evals.matrix", "one RULER table from several eval ruler / ablation output folders"),
}


def add_arguments(parser) -> None:
    sub = parser.add_subparsers(dest="eval", metavar="EVAL", required=True)
    for name, (module_name, help_text) in EVALS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name == module_name:
                continue
            raise
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(_eval_main=module.main)


def main(args) -> int:
    return int(args._eval_main(args) or 0)
