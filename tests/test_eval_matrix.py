"""armkv eval matrix: cells from per-sample logs, later folders replacing earlier ones, and
the --bar check (within N points of the full cache and above every other bounded row)."""

import json

import pytest

from armkv.cli import main
from armkv.errors import ArmkvError
from armkv.evals.matrix import collect

CONFIG = {
    "eval": "ruler",
    "model": "default",
    "budget": 512,
    "chunk": 256,
    "chat": False,
    "seed": 42,
    "haystack": "noise",
}


def _folder(root, name, cells, **config):
    """cells: {(method, task, length): [scores]} -> a folder shaped like `armkv eval ruler`'s output."""
    folder = root / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**CONFIG, **config}))
    for (method, task, length), scores in cells.items():
        rows = [{"method": method, "task": task, "length": length, "score": s, "cache_bytes": 1000} for s in scores]
        (folder / f"{method}__{task}__{length}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def _run(capsys, *args) -> str:
    assert main(["eval", "matrix", *map(str, args)]) == 0
    return capsys.readouterr().out


def test_bar_marks_cells_and_counts_stale_sources(tmp_path, capsys):
    old = _folder(
        tmp_path,
        "old",
        {
            ("full", "niah_single_1", 2048): [100, 100],
            ("full", "niah_multikey_1", 2048): [100, 80],
            ("sink", "niah_single_1", 2048): [50, 50],
            ("sink", "niah_multikey_1", 2048): [100, 60],
            ("arm", "niah_single_1", 2048): [0, 0],
            ("arm", "niah_multikey_1", 2048): [100, 100],
        },
    )
    new = _folder(tmp_path, "new", {("arm", "niah_single_1", 2048): [100, 80]})
    out = _run(capsys, old, new, "--bar", "arm", "--current", new, "--output", tmp_path / "m")
    cells = json.loads(out.strip().splitlines()[-1])["noise"]
    assert cells["arm"]["niah_single_1@2048"]["score"] == 90  # the later folder replaced the earlier one
    assert cells["arm"]["niah_single_1@2048"]["source"] == str(new)
    # single: 90 >= 100 - 10 and above sink's 50 -> bold; multikey: 100 against full's 90 and
    # sink's 80 -> bold, and it comes from the old folder -> *
    assert "| arm | **100 (2)*** | **90 (2)** |" in out
    assert "arm meets the bar in 2 of 2 cells; not from" in out and "niah_multikey_1@2048" in out.split("not from")[-1]
    assert json.loads((tmp_path / "m" / "matrix.json").read_text())["noise"] == cells
    assert "arm meets the bar" in (tmp_path / "m" / "matrix.md").read_text()


def test_bar_fails_a_cell_below_the_line_or_not_above_another_row(tmp_path, capsys):
    folder = _folder(
        tmp_path,
        "f",
        {
            ("full", "niah_single_1", 2048): [100, 100],
            ("full", "niah_multikey_1", 2048): [50, 50],
            ("swa", "niah_single_1", 2048): [0, 0],
            ("swa", "niah_multikey_1", 2048): [50, 50],
            ("arm", "niah_single_1", 2048): [100, 70],
            ("arm", "niah_multikey_1", 2048): [50, 50],
        },
    )
    out = _run(capsys, folder, "--bar", "arm")
    assert "| arm | 50 (2) | 85 (2) |" in out  # 15 under full; ties swa instead of beating it
    assert "arm meets the bar in 0 of 2 cells." in out


def test_folders_of_another_setting_or_without_a_config_are_refused(tmp_path):
    a = _folder(tmp_path, "a", {("full", "niah_single_1", 1024): [100]})
    b = _folder(tmp_path, "b", {("arm", "niah_single_1", 1024): [100]}, budget=256)
    with pytest.raises(ArmkvError, match="differ"):
        collect([a, b])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ArmkvError, match="no config.json"):
        collect([tmp_path / "empty"])
    assert main(["eval", "matrix", str(tmp_path / "empty")]) == 2  # one line on stderr, exit status 2
