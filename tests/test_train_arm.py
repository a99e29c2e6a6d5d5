"""Training the ARM parameters on a tiny model: the loss goes down, the balance loss
spreads tokens over buckets, and a resumed run equals an uninterrupted one."""

import json

import torch
from safetensors.torch import load_file

from armkv.cli import main
from armkv.memory.route import Router
from test_train_cli import corpus, model_dir, train_args  # noqa: F401, F811  (fixtures)


def arm_args(model_dir, corpus, out, *extra):
    # budget 10 leaves 28 slots (k4v4) for the 30 tokens of each sequence past the sink and window: the pool must merge
    args = train_args(
        model_dir,
        corpus,
        out,
        "--budget",
        "10",
        "--chunk",
        "8",
        "--seq-len",
        "32",
        "--batch-tokens",
        "64",
        "--lr",
        "2e-2",
        *extra,
    )
    args[args.index("lm")] = "arm"
    args[args.index("all")] = "none"
    return args


def test_arm_training_lowers_the_loss_and_writes_an_adapter(model_dir, corpus, tmp_path, capsys):  # noqa: F811
    assert (
        main(
            arm_args(
                model_dir, corpus, tmp_path, "--steps", "10", "--ce-weight", "0", "--kl-weight", "1.0", "--no-plot"
            )
        )
        == 0
    )
    rows = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    first = sum(r["loss"] for r in rows[:3]) / 3
    last = sum(r["loss"] for r in rows[-3:]) / 3
    assert last < first
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    saved = load_file(tmp_path / "checkpoints" / "step_00000010" / "tensors.safetensors")
    params = [k for k in saved if k.startswith("param.")]
    assert params and all(".arm." in k or k.startswith("param.arm.") for k in params)


def test_arm_resume_equals_uninterrupted(model_dir, corpus, tmp_path):  # noqa: F811
    assert main(arm_args(model_dir, corpus, tmp_path / "a", "--steps", "6", "--no-plot")) == 0
    assert main(arm_args(model_dir, corpus, tmp_path / "b", "--steps", "6", "--save-every", "3", "--no-plot")) == 0
    # drop the final checkpoint of run b and resume it from step 3
    import shutil

    shutil.rmtree(tmp_path / "b" / "checkpoints" / "step_00000006")
    assert (
        main(arm_args(model_dir, corpus, tmp_path / "b", "--steps", "6", "--save-every", "3", "--resume", "--no-plot"))
        == 0
    )
    a = load_file(tmp_path / "a" / "checkpoints" / "step_00000006" / "tensors.safetensors")
    b = load_file(tmp_path / "b" / "checkpoints" / "step_00000006" / "tensors.safetensors")
    for k in a:
        if k.startswith("param."):
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


def test_balance_loss_spreads_tokens_over_buckets():
    torch.manual_seed(0)
    router = Router(1, 8, depth=2, branching=4)
    with torch.no_grad():
        router.bias[0, :, 0] = 5.0  # everything starts in bucket 0
    x = torch.randn(1, 1, 512, 8)

    def occupancy_entropy():
        b = router.route_writes(x).flatten()
        p = torch.bincount(b, minlength=16).float() / b.numel()
        return float(-(p[p > 0] * p[p > 0].log()).sum())

    before = occupancy_entropy()
    opt = torch.optim.Adam(router.parameters(), lr=0.05)
    for _ in range(100):
        loss = router.balance_loss(x)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert occupancy_entropy() > before + 1.0
