"""``armkv demo`` on a saved tiny model: the table, the answers, the plot and the JSON are written."""

import json

from armkv.cli import main


def test_demo_writes_table_plot_and_json(tmp_path, tiny_model_dir, capsys):
    out = tmp_path / "demo"
    code = main(
        [
            "demo",
            "--model",
            str(tiny_model_dir),
            "--methods",
            "full,sink,kivi",
            "--budget",
            "64",
            "--lengths",
            "96,160",
            "--samples",
            "1",
            "--max-new-tokens",
            "4",
            "--chunk",
            "32",
            "--output",
            str(out),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    # no latency column (a few tokens timed beside whatever else runs): the report says where to get it
    assert "| method | budget | accuracy % | cache MB @96 | cache MB @160 |\n" in printed
    assert "`armkv bench decode --methods full,sink,kivi --budget 64 --threads 1`" in printed
    assert "**sink**" in printed
    data = json.loads((out / "results.json").read_text())
    rows = {r["method"]: r for r in data["rows"]}
    assert set(rows) == {"full", "sink", "kivi"} and not any("ms_per_token" in r for r in rows.values())
    full, sink = rows["full"]["cache_mb_by_length"], rows["sink"]["cache_mb_by_length"]
    assert full["160"] > full["96"] and sink["160"] == sink["96"]
    assert (out / "demo.png").stat().st_size > 0 and (out / "table.md").is_file()


def test_demo_unknown_method(tmp_path, tiny_model_dir, capsys):
    code = main(["demo", "--model", str(tiny_model_dir), "--methods", "nope", "--output", str(tmp_path)])
    assert code != 0 and "unknown method" in capsys.readouterr().err
