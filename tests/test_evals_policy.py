"""armkv eval policy: it reports the M the policy picks, per layer and input."""

import json

import pytest
import torch

from armkv.cli import main
from armkv.evals.policy import picked_m, summarise
from armkv.train.arm import new_arm
from conftest import tiny_model


@pytest.mark.parametrize("bias, expect", [(-6.0, "min"), (6.0, "all")])
def test_picked_m_follows_the_policy(tmp_path, bias, expect):
    model = tiny_model("llama").eval()
    arm = new_arm(model, budget=96)
    for layer in arm.layers:
        torch.nn.init.constant_(layer.policy.out.bias, bias)
    arm.save(tmp_path / "adapter")
    windows = torch.randint(0, 100, (5, 24))
    m, buckets = picked_m(model, windows, 96, str(tmp_path / "adapter"))
    assert m.shape == (model.config.num_hidden_layers, 5)
    assert bool((m == (1 if expect == "min" else buckets)).all())
    summary = summarise(m, buckets)
    assert summary["histogram"] == {str(int(m[0, 0])): m.numel()}
    assert summary["read_share"] == pytest.approx(float(m.float().mean()) / buckets)


def test_policy_cli_writes_table_json_and_plot(tiny_model_dir, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("The grass is green. The sky is blue. " * 40)
    out = tmp_path / "out"
    args = [
        "eval",
        "policy",
        "--model",
        str(tiny_model_dir),
        "--adapter",
        "random",
        "--budget",
        "96",
        "--input",
        str(text),
        "--inputs",
        "3",
        "--tokens",
        "16",
        "--output",
        str(out),
        "--json",
    ]
    assert main(args) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(last["per_layer"]) == 2 and sum(last["histogram"].values()) == 2 * 3
    assert (out / "policy.png").stat().st_size > 0 and (out / "table.md").read_text().startswith("Top-M")
    assert len(json.loads((out / "policy.json").read_text())["m"][0]) == 3


def test_policy_cli_short_input_is_a_one_line_error(tiny_model_dir, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("short")
    args = [
        "eval",
        "policy",
        "--model",
        str(tiny_model_dir),
        "--adapter",
        "random",
        "--input",
        str(text),
        "--inputs",
        "8",
        "--tokens",
        "64",
    ]
    assert main(args) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("Loading")]
    assert len(err) == 1 and "fewer than --inputs x --tokens" in err[0]
