"""``armkv train`` and ``armkv calibrate`` end to end on a tiny Llama saved to disk, a real
SIGKILL-and-resume, and one-line errors."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from armkv.cli import main
from conftest import tiny_model

WORDS = (
    "the quick brown fox jumps over a lazy dog while it was best and worst of times "
    "all that glitters is not gold who wander are lost journey thousand miles begins with single step"
).split()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny-llama")
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{w: i + 4 for i, w in enumerate(dict.fromkeys(WORDS))}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    ).save_pretrained(path)
    tiny_model("llama").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "docs.jsonl"
    g = torch.Generator().manual_seed(0)
    lines = []
    for _ in range(60):
        n = int(torch.randint(5, 40, (), generator=g))
        lines.append(json.dumps({"text": " ".join(WORDS[i] for i in torch.randint(0, 12, (n,), generator=g))}))
    path.write_text("\n".join(lines) + "\n")
    return path


def train_args(model_dir, corpus, out, *extra):
    return [
        "train",
        "--method",
        "lm",
        "--model",
        str(model_dir),
        "--unfreeze",
        "all",
        "--data",
        str(corpus),
        "--seq-len",
        "16",
        "--batch-tokens",
        "64",
        "--micro-batch",
        "2",
        "--lr",
        "3e-3",
        "--out",
        str(out),
        "--no-progress",
        *extra,
    ]


def test_train_lm_end_to_end(model_dir, corpus, tmp_path, capsys):
    assert main(train_args(model_dir, corpus, tmp_path, "--steps", "12", "--save-every", "4")) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["step"] == 12 and summary["checkpoint"].endswith("step_00000012")
    rows = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert {"schedule/tau", "schedule/epsilon"} <= rows[0].keys()
    assert (tmp_path / "loss.png").exists()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_00000004",
        "step_00000008",
        "step_00000012",
    ]


def run_cli(args, **kw):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, "-m", "armkv.cli", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def test_sigkill_and_resume_equals_uninterrupted(model_dir, corpus, tmp_path):
    # enough steps after the kill point that a fast machine cannot finish them between two
    # polls and the kill (with 10 steps a quiet machine sometimes did)
    common = ("--steps", "100", "--save-every", "2", "--keep-last", "60")
    ref = run_cli(train_args(model_dir, corpus, tmp_path / "ref", *common))
    run = run_cli(train_args(model_dir, corpus, tmp_path / "run", *common))
    deadline = time.time() + 240
    while not (tmp_path / "run" / "checkpoints" / "step_00000004" / "COMPLETE").exists():
        assert run.poll() is None and time.time() < deadline, run.communicate()[1][-2000:]
        time.sleep(0.01)
    run.send_signal(signal.SIGKILL)
    run.wait()
    assert ref.wait(timeout=240) == 0, ref.communicate()[1][-2000:]
    done = {p.name for p in (tmp_path / "run" / "checkpoints").iterdir()}
    assert "step_00000100" not in done  # it really was killed before the end
    resumed = run_cli(train_args(model_dir, corpus, tmp_path / "run", *common, "--resume"))
    out, err = resumed.communicate(timeout=240)
    assert resumed.returncode == 0, err[-2000:]
    assert "resumed from" in out
    a = load_file(tmp_path / "ref" / "checkpoints" / "step_00000100" / "tensors.safetensors")
    b = load_file(tmp_path / "run" / "checkpoints" / "step_00000100" / "tensors.safetensors")
    params = [k for k in a if k.startswith("param.")]
    assert params and all(torch.allclose(a[k], b[k], rtol=1e-6, atol=1e-7) for k in params)


def one_line_error(args, capsys, match):
    assert main(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()  # model loading may draw a progress bar first
    errors = [line for line in lines if "error:" in line]
    assert errors == lines[-1:] and match in errors[0], lines
    err = errors[0]
    return err


def test_one_line_errors(model_dir, corpus, tmp_path, capsys):
    one_line_error(train_args(model_dir, tmp_path / "missing.jsonl", tmp_path), capsys, "does not exist")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"body": "x"}) + "\n")
    one_line_error(train_args(model_dir, bad, tmp_path), capsys, "no 'text' column")
    args = train_args(model_dir, corpus, tmp_path, "--adapter", str(tmp_path / "no-such-adapter"))
    args[args.index("lm")] = "arm"
    one_line_error(args, capsys, "not an armkv adapter")
    args = train_args(model_dir, corpus, tmp_path)
    args[args.index("all")] = "none"
    one_line_error(args, capsys, "nothing to train")
    one_line_error(train_args(model_dir, corpus, tmp_path, "--batch-tokens", "100"), capsys, "multiple")
    # A checkpoint of another training config, a corrupt checkpoint.
    assert main(train_args(model_dir, corpus, tmp_path / "r", "--steps", "2")) == 0
    one_line_error(
        train_args(model_dir, corpus, tmp_path / "r", "--steps", "2", "--lr", "1e-3", "--resume"),
        capsys,
        "another training config",
    )
    tensors = tmp_path / "r" / "checkpoints" / "step_00000002" / "tensors.safetensors"
    tensors.write_bytes(tensors.read_bytes()[:-10])
    one_line_error(
        train_args(model_dir, corpus, tmp_path / "r", "--steps", "2", "--resume"), capsys, "corrupt or truncated"
    )


def test_an_unknown_method_is_argparse_s_one_line_choice_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--method", "router"])
    assert exit_.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("armkv train: error: argument --method: invalid choice: 'router'") and "policy" in last


def test_calibrate_builds_an_adapter(model_dir, corpus, tmp_path):
    from armkv.memory.module import ARMModel

    args = [
        "calibrate",
        "--model",
        str(model_dir),
        "--data",
        str(corpus),
        "--seq-len",
        "16",
        "--tokens",
        "64",
        "--max-keys-per-head",
        "24",
        "--budget",
        "64",
        "--out",
        str(tmp_path / "adapter"),
    ]
    assert main([*args, "--depth", "0"]) == 2  # before the model loads
    assert main([*args, "--depth", "1", "--out", str(tmp_path / "d1")]) == 0
    assert ARMModel.load(tmp_path / "d1").config.num_buckets == 4  # --depth sets the tree, branching 4
    assert main(args) == 0
    arm = ARMModel.load(tmp_path / "adapter")
    assert len(arm.layers) == 2 and arm.config.meta["init"] == "kmeans"
    weights = arm.config.layer_weights  # budget shares from the retrieval score, mean 1
    assert len(weights) == 2 and abs(sum(weights) / 2 - 1) < 1e-3
    from armkv.train.calibrate import retrieval_layer_weights

    scores = arm.config.meta["retrieval_scores"]  # kept for the named share rules
    assert weights == retrieval_layer_weights(scores, "lift-late")  # calibrate's default rule
    # --layer-weights-only re-shares an existing adapter, its trees untouched
    assert (
        main(
            [
                "calibrate",
                "--model",
                str(model_dir),
                "--data",
                str(corpus),
                "--layer-weights-only",
                "--retrieval-passages",
                "2",
                "--out",
                str(tmp_path / "adapter"),
            ]
        )
        == 0
    )
    again = ARMModel.load(tmp_path / "adapter")
    assert again.config.layer_weights == retrieval_layer_weights(again.config.meta["retrieval_scores"])
    torch.testing.assert_close(again.layers[0].router.weight, arm.layers[0].router.weight)
    # every router row is a centroid of real keys, not the random start
    w = arm.layers[0].router.weight
    assert torch.isfinite(w).all() and float(arm.layers[0].router.bias.abs().sum()) > 0


def test_lora_trains_only_the_adapters(model_dir, corpus, tmp_path):
    pytest.importorskip("peft")
    args = train_args(model_dir, corpus, tmp_path, "--steps", "3", "--lora-rank", "4", "--no-plot")
    args[args.index("all")] = "none"
    assert main(args) == 0
    saved = load_file(tmp_path / "checkpoints" / "step_00000003" / "tensors.safetensors")
    params = [k for k in saved if k.startswith("param.")]
    assert params and all("lora_" in k for k in params)
