"""armkv report: the results page and README's table from a synthetic results folder."""

import json
import math

import pytest

from armkv.cli import main
from armkv.tools.report import END, START, geometric_mean

RULER = {
    "what": "synthetic needles",
    "within": 10.0,
    "bounded": ["arm", "sink"],
    "cells": {
        "noise": {
            "full": {
                "niah_single_1@2048": {"score": 100.0, "n": 10, "bytes": 9, "source": "f1", "max_new_tokens": None},
                "niah_multikey_1@4096": {"score": 50.0, "n": 30, "bytes": 9, "source": "f1", "max_new_tokens": 64},
            },
            "arm": {
                "niah_single_1@2048": {"score": 95.0, "n": 10, "bytes": 5, "source": "f2", "max_new_tokens": None},
                "niah_multikey_1@4096": {"score": 30.0, "n": 30, "bytes": 5, "source": "f2", "max_new_tokens": 64},
            },
            "sink": {
                "niah_single_1@2048": {"score": 40.0, "n": 10, "bytes": 5, "source": "f1", "max_new_tokens": None},
                "niah_multikey_1@4096": {"score": 35.0, "n": 30, "bytes": 5, "source": "f1", "max_new_tokens": 64},
            },
        }
    },
    "sources": {
        "f1": {"command": "armkv eval ruler --methods full,sink", "commit": "aaaaaaa"},
        "f2": {"command": "armkv eval ruler --methods arm", "commit": "bbbbbbb"},
    },
}
PPL = {
    "what": "held-out",
    "runs": [
        {
            "method": "full",
            "tokens": 2048,
            "ppl": 10.0,
            "cache_bytes": 100,
            "command": "armkv eval ppl --method full",
            "commit": "ccccccc",
        },
        {
            "method": "arm",
            "tokens": 2048,
            "ppl": 10.5,
            "cache_bytes": 25,
            "command": "armkv eval ppl --method arm",
            "commit": "ccccccc",
        },
    ],
}
WINDOWS = {
    "what": "windows",
    "rows": [
        {
            "method": "full",
            "options": {},
            "ppl": [10.0, 40.0],
            "cache_bytes": 100,
            "command": "ppl full wK",
            "commit": "ddddddd",
        },
        {
            "method": "arm",
            "options": {},
            "ppl": [11.0, 44.0],
            "cache_bytes": 25,
            "command": "ppl arm wK",
            "commit": "ddddddd",
        },
        {
            "method": "arm",
            "options": {"window": 96},
            "ppl": [10.5, 42.0],
            "cache_bytes": 25,
            "command": "ppl arm w96",
            "commit": "eeeeeee",
        },
    ],
}
DECODE = {
    "what": "decode",
    "command": "armkv bench decode --methods arm",
    "commit": "fffffff",
    "results": {
        "decode_ms_per_token": {"arm": {"1024": 110.0, "8192": 100.0}},
        "floor_ms_per_token": 100.0,
        "prefill_tokens_per_s": {"arm": {"1024": 120.0, "8192": 90.0}},
        "cache_bytes": {"arm": {"1024": 25, "8192": 25}},
    },
}


def _results(tmp_path, **files):
    folder = tmp_path / "results"
    folder.mkdir()
    for name, data in files.items():
        (folder / f"{name}.json").write_text(json.dumps(data))
    return folder


def test_the_page_has_every_table_the_bar_and_the_provenance(tmp_path):
    folder = _results(tmp_path, ruler=RULER, ppl=PPL, ppl_windows=WINDOWS, decode=DECODE)
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\nbefore\n{START}\nold table\n{END}\nafter\n")
    out = tmp_path / "docs" / "results.md"
    assert main(["report", "--results", str(folder), "--output", str(out), "--readme", str(readme), "--no-plots"]) == 0
    page = out.read_text()
    # arm: 95 within 10 of 100 and above sink's 40 -> bold; 30 is 20 under full and under sink -> plain
    assert "| arm | **95** | 30 (30) |" in page
    assert "ARM meets the bar in 1 of 2 cells." in page
    assert "| arm | 10.50 (+5.0%) | 25 |" in page
    gm_full, gm_arm = geometric_mean([10.0, 40.0]), geometric_mean([11.0, 44.0])
    assert gm_full == pytest.approx(20.0) and gm_arm == pytest.approx(22.0)
    assert "| arm | 11.000 | 44.000 | 22.000 | +10.00% | 25 |" in page
    assert "| arm (window=96) |" in page
    assert "| arm | 110.0 (1.10x) | 100.0 (1.00x) | 120 | 90 | 25 |" in page
    # the provenance names the cells each run gave, not the run's folder
    assert "- RULER noise full: single 2k, mk1 4k; noise sink: single 2k, mk1 4k: `armkv eval ruler" in page
    assert "- RULER noise arm: single 2k, mk1 4k: `armkv eval ruler --methods arm` at commit bbbbbbb" in page
    assert "`f1`" not in page and "`f2`" not in page
    for command, commit in [
        ("armkv eval ruler --methods arm", "bbbbbbb"),
        ("armkv eval ppl --method full", "ccccccc"),
        ("ppl arm w96", "eeeeeee"),
        ("armkv bench decode --methods arm", "fffffff"),
    ]:
        assert f"`{command}` at commit {commit}" in page
    assert ".png" not in page  # --no-plots: nothing linked that was not written
    text = readme.read_text()
    assert text.startswith("# x\n\nbefore\n") and text.endswith(f"{END}\nafter\n") and "old table" not in text
    table = text.split(START)[1].split(END)[0]
    # per method: mean RULER score of its cells, ppl at 2k, the windows' geometric mean
    assert "| arm | 62.5 | 10.50 | 22.00 |" in table and "| full | 75.0 | 10.00 | 20.00 |" in table
    assert "| sink | 37.5 | - | - |" in table


def test_plots_are_written_beside_the_json_and_linked(tmp_path):
    pytest.importorskip("matplotlib")
    folder = _results(tmp_path, ruler=RULER, ppl_windows=WINDOWS)
    out = tmp_path / "results.md"
    assert main(["report", "--results", str(folder), "--output", str(out), "--readme", str(tmp_path / "none.md")]) == 0
    assert (folder / "ruler.png").stat().st_size > 0 and (folder / "ppl_windows.png").stat().st_size > 0
    page = out.read_text()
    assert "](results/ruler.png)" in page and "](results/ppl_windows.png)" in page
    assert not list(folder.glob("*.tmp*"))


def test_a_readme_without_markers_is_left_alone_and_sections_are_optional(tmp_path):
    folder = _results(tmp_path, ppl=PPL)
    readme = tmp_path / "README.md"
    readme.write_text("no markers\n")
    out = tmp_path / "results.md"
    assert main(["report", "--results", str(folder), "--output", str(out), "--readme", str(readme), "--no-plots"]) == 0
    assert readme.read_text() == "no markers\n"
    page = out.read_text()
    assert "## Perplexity on held-out text" in page and "RULER" not in page and "Decode" not in page


def test_missing_or_empty_results_fail_with_one_line(tmp_path, capsys):
    assert main(["report", "--results", str(tmp_path / "nowhere"), "--output", str(tmp_path / "r.md")]) == 2
    assert "no such folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["report", "--results", str(tmp_path / "empty"), "--output", str(tmp_path / "r.md")]) == 2
    assert "none of" in capsys.readouterr().err
    (tmp_path / "empty" / "ppl.json").write_text("{not json")
    assert main(["report", "--results", str(tmp_path / "empty"), "--output", str(tmp_path / "r.md")]) == 2
    assert "not JSON" in capsys.readouterr().err
    assert not (tmp_path / "r.md").exists()


def test_geometric_mean():
    assert geometric_mean([2.0, 8.0]) == pytest.approx(4.0)
    assert geometric_mean([3.0]) == pytest.approx(3.0) and math.isfinite(geometric_mean([1e-3, 1e3]))


POLICY = {
    "what": "policy curve",
    "command": "armkv eval policy --fixed 8,64 --adapter p/adapter",
    "commit": "0123456",
    "curve": {
        "settings": {},
        "rows": [
            {"label": "M=8", "kind": "fixed", "read_share": 0.125, "ppl": 20.0, "cache_bytes": 7},
            {"label": "M=64", "kind": "fixed", "read_share": 1.0, "ppl": 18.0, "cache_bytes": 7},
            {
                "label": "p",
                "kind": "learned",
                "read_share": 0.5625,
                "ppl": 18.5,
                "cache_bytes": 7,
                "fixed_at_same_share": 19.0,
            },
        ],
    },
    "picked": {
        "adapter": "p",
        "inputs": 4,
        "tokens": 256,
        "num_buckets": 64,
        "per_layer": [{"layer": 0, "mean": 40.0}, {"layer": 1, "mean": 20.0}],
    },
}


def test_the_policy_section_sets_the_learned_m_beside_the_fixed_curve(tmp_path):
    pytest.importorskip("matplotlib")
    folder = _results(tmp_path, policy=POLICY)
    out = tmp_path / "results.md"
    assert main(["report", "--results", str(folder), "--output", str(out), "--readme", str(tmp_path / "none.md")]) == 0
    page = out.read_text()
    assert "| p | 56.2% | 18.500 | 19.000 | 7 |" in page and "| M=8 | 12.5% | 20.000 |  | 7 |" in page
    assert "below the fixed-M curve (lower perplexity at the same read cost) at 1 of 1 points" in page
    assert "policy `p` (the folder the command under Provenance writes): 40, 20." in page
    assert "](results/policy_curve.png)" in page and (folder / "policy_curve.png").stat().st_size > 0
    assert "`armkv eval policy --fixed 8,64 --adapter p/adapter` at commit 0123456" in page
