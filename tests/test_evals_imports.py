"""The evals are tools around the library: light to import, and never imported by the core."""

from __future__ import annotations

import re
from pathlib import Path

import armkv
from conftest import modules_after

HEAVY = ("torch", "transformers", "matplotlib", "lm_eval", "rouge_score", "rapidfuzz", "tqdm", "datasets")


def test_eval_modules_import_nothing_heavy():
    loaded = modules_after("import armkv.evals.cli, armkv.evals.ruler, armkv.evals.longbench, armkv.evals.ablation")
    assert not {m for m in HEAVY if m in loaded}


def test_library_core_does_not_import_the_evals():
    """No module outside ``armkv/evals`` names ``armkv.evals``, but the CLI's lazy dispatch table."""
    root = Path(armkv.__file__).parent
    offenders = [
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if "evals" not in path.relative_to(root).parts[:1]
        and path.relative_to(root) != Path("cli.py")
        and re.search(r"armkv\.evals|from armkv import evals|from \. import evals", path.read_text(encoding="utf-8"))
    ]
    assert not offenders
