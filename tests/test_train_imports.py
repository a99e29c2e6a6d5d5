"""The training tools import their heavy dependencies only when used, and the library core
never imports them."""

import subprocess
import sys


def modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys; print(' '.join(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return set(out.split())


def test_core_does_not_import_train():
    assert not {m for m in modules_after("import armkv") if m.startswith("armkv.train")}


def test_train_modules_import_no_heavy_dependency():
    loaded = modules_after("import armkv.train.cli, armkv.train.calibrate, armkv.train.data, armkv.train.trainer")
    assert not loaded & {"datasets", "matplotlib", "pyarrow", "transformers", "gensim", "peft"}
