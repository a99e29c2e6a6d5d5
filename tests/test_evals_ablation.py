"""The ablation table: rows as (name, method, overrides), fractions of N_b resolved, options passed to the runner."""

from __future__ import annotations

import json

import pytest

from armkv.errors import ArmkvError
from armkv.evals import ablation, ruler
from armkv.evals.cli import add_arguments, main
from test_evals_fixtures import fake_factory, tiny_tokenizer


def test_rows_resolve_fractions_of_the_buckets_and_share_the_arm_options():
    rows = {r.label: r for r in ablation.resolve_rows(ablation.ROWS, 64, {"arm": {"adapter": "a"}, "fifo": {"x": 1}})}
    assert rows["fixed-M-1/2"].options == {
        "adapter": "a",
        "arm_overrides": {"top_m": "fixed", "m_fixed": 32, "read_rank": "tree"},
    }
    assert rows["fixed-M-1/4"].options["arm_overrides"]["m_fixed"] == 16
    assert rows["fifo"].method == "fifo" and rows["fifo"].options == {"adapter": "a", "x": 1, "arm_overrides": {}}
    assert rows["mean-writes"].options["arm_overrides"] == {"write": "mean"}
    assert rows["no-empty-slot-rule"].options["arm_overrides"] == {"empty_slot_rule": False}
    assert rows["no-log-count-bias"].options["arm_overrides"] == {"log_count_bias": False}
    assert {
        rows["positions-fixed"].options["arm_overrides"]["position_mode"],
        rows["positions-stored"].options["arm_overrides"]["position_mode"],
    } == {"fixed", "stored"}
    table = ablation.describe(list(rows.values()))
    assert rows["fixed-M-1/8"].options["arm_overrides"] == {"top_m": "fixed", "m_fixed": 8}
    assert "| fixed-M-1/4 | arm | top_m=fixed, m_fixed=16, read_rank=tree |" in table and "| fifo | fifo | - |" in table


def test_overrides_are_armconfig_fields():
    from armkv.config import ARMConfig

    assert all(set(overrides) <= set(ARMConfig.__dataclass_fields__) for _, _, overrides in ablation.ROWS)


def test_each_row_reaches_the_runner_with_its_overrides(tmp_path):
    seen = {}

    def answer(method, request):
        return " 0"

    def factory(method, options):
        seen.setdefault(method, []).append(options["arm_overrides"])
        return fake_factory(answer)(method, options)

    rows = ablation.resolve_rows([r for r in ablation.ROWS if r[0] in ("fifo", "fixed-M-1/4", "mean-writes")], 16, {})
    summary = ruler.evaluate(
        ruler.RulerGenerator(tiny_tokenizer()),
        rows,
        ["niah_single_1"],
        [1024],
        1,
        tmp_path,
        factory,
        settings={"eval": "ablation"},
        title="Ablation",
        notes=ablation.describe(rows),
        plot=False,
    )
    assert set(summary) == {"fifo", "fixed-M-1/4", "mean-writes"}
    assert seen == {"fifo": [{}], "arm": [{"top_m": "fixed", "m_fixed": 4, "read_rank": "tree"}, {"write": "mean"}]}
    assert "| mean-writes | arm | write=mean |" in (tmp_path / "table.md").read_text()
    assert json.loads((tmp_path / "summary.json").read_text()) == summary


def test_bad_rows_and_tasks_are_one_line_errors(tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(ArmkvError, match="unknown ablation row 'gated'"):
        main(parser.parse_args(["ablation", "--output", str(tmp_path), "--rows", "fifo,gated"]))
    with pytest.raises(ArmkvError, match="'cwe' is not one"):
        main(parser.parse_args(["ablation", "--output", str(tmp_path), "--tasks", "cwe"]))
