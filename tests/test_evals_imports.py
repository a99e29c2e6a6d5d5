"""The evals are tools around the library: light to import, and never imported by the core."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "transformers", "matplotlib", "lm_eval", "rouge_score", "rapidfuzz", "tqdm", "datasets")


def modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys; print(' '.join(sys.modules))"],
        capture_output=True, text=True, check=True,
    ).stdout
    return set(out.split())


def test_eval_modules_import_nothing_heavy():
    loaded = modules_after("import armkv.evals.cli, armkv.evals.ruler, armkv.evals.longbench, armkv.evals.ablation")
    assert not {m for m in HEAVY if m in loaded}


def test_library_core_does_not_import_the_evals():
    loaded = modules_after("import armkv, armkv.config, armkv.methods.base, armkv.hf.attach")
    assert not {m for m in loaded if m.startswith("armkv.evals")}
