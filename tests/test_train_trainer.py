"""train/trainer.py: the loss goes down, kill-and-resume equals an uninterrupted run, schedules,
bf16, logs and plots, and data parallel on 2 gloo processes equals one process."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from armkv.errors import ArmkvError
from armkv.train.data import DocumentSource, PackedSequences
from armkv.train.losses import make_arm_loss
from armkv.train.trainer import ScalarSchedule, TrainConfig, train

TEXT = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "A journey of a thousand miles begins with a single step. " * 2,
    "All that glitters is not gold; all who wander are not lost. " * 2,
    "It was the best of times, it was the worst of times. " * 3,
] * 4
EOS = 2


def ascii_tokens(text: str) -> list[int]:
    return [b if b > 2 else 3 for b in text.encode("ascii", "replace")]


def data(seq_len: int, seed: int = 0) -> PackedSequences:
    return PackedSequences(DocumentSource(TEXT, seed=seed), ascii_tokens, EOS, seq_len)


class TinyLM(torch.nn.Module):
    """Embedding -> dropout -> MLP -> vocabulary: enough to learn byte statistics."""

    def __init__(self, vocab: int = 128, dim: int = 32, dropout: float = 0.0):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.drop = torch.nn.Dropout(dropout)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(dim, dim), torch.nn.GELU(), torch.nn.LayerNorm(dim), torch.nn.Linear(dim, vocab)
        )

    def forward(self, input_ids):
        return self.mlp(self.drop(self.embed(input_ids)))  # [B, T, V]


def tiny_loss():
    return make_arm_loss(forward=lambda model, ids: model(ids))


def config(tmp_path, **kw) -> TrainConfig:
    base = dict(
        steps=10,
        seq_len=32,
        batch_tokens=4 * 32,
        micro_batch=2,
        lr=1e-2,
        warmup=0.1,
        out_dir=str(tmp_path),
        progress=False,
        plot=False,
    )
    base.update(kw)
    return TrainConfig(**base)


def trainable_state(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_loss_goes_down_on_a_tiny_torch_model(tmp_path):
    torch.manual_seed(0)
    model = TinyLM()
    result = train(model, tiny_loss(), data(32), config(tmp_path, steps=40, plot=True))
    losses = [r["loss"] for r in result.history]
    assert len(losses) == 40 and sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5
    rows = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 41))
    assert {"loss", "ce", "lr", "grad_norm", "tokens", "tokens_per_s", "elapsed_s"} <= rows[-1].keys()
    assert rows[-1]["tokens"] == 40 * 128
    assert (tmp_path / "loss.png").stat().st_size > 1000
    assert result.checkpoint.name == "step_00000040"


def test_loss_goes_down_on_a_tiny_llama_with_a_few_unfrozen_parameters(tmp_path, llama):
    llama.requires_grad_(False)
    trainable = [llama.model.layers[-1].self_attn.o_proj, llama.model.layers[-1].mlp.down_proj, llama.model.norm]
    for m in trainable:
        m.requires_grad_(True)
    n_trainable = sum(p.numel() for p in llama.parameters() if p.requires_grad)
    assert n_trainable < sum(p.numel() for p in llama.parameters()) / 5
    frozen_before = llama.model.embed_tokens.weight.clone()
    result = train(llama, make_arm_loss(), data(32), config(tmp_path, steps=25, lr=3e-3))
    losses = [r["loss"] for r in result.history]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.2
    assert torch.equal(llama.model.embed_tokens.weight, frozen_before)


def test_learning_rate_and_scalar_schedules():
    c = TrainConfig(steps=200, lr=4e-4, warmup=0.01)
    assert c.warmup_steps() == 2
    assert c.lr_at(0) == pytest.approx(2e-4) and c.lr_at(1) == pytest.approx(4e-4)
    assert c.lr_at(101) == pytest.approx(2e-4, rel=1e-6)  # half-way through the cosine
    assert c.lr_at(199) < 1e-7
    lin, cos = ScalarSchedule(1.0, 0.1), ScalarSchedule(1.0, 0.1, "cosine")
    assert (
        lin.value(0, 11) == 1.0 and lin.value(10, 11) == pytest.approx(0.1) and lin.value(5, 11) == pytest.approx(0.55)
    )
    assert cos.value(5, 11) == pytest.approx(0.55) and cos.value(1, 11) > lin.value(1, 11)
    assert ScalarSchedule(0.3, 0.0, "constant").value(7, 11) == 0.3
    with pytest.raises(ArmkvError, match="multiple"):
        TrainConfig(seq_len=100, batch_tokens=250).accum_steps(1)
    with pytest.raises(ArmkvError):
        ScalarSchedule(1, 0, "exp")


class Crash(Exception):
    pass


def noisy_loss(crash_at_call: int | None = None):
    """A loss that uses the RNG (dropout) and a schedule, so exact resume needs both restored."""
    base, calls = tiny_loss(), [0]

    def loss_fn(model, batch, schedule):
        calls[0] += 1
        if calls[0] == crash_at_call:
            raise Crash
        loss, metrics = base(model, batch, schedule)
        return loss * schedule["tau"] + torch.rand(()) * 1e-3, metrics

    return loss_fn


def test_kill_and_resume_equals_uninterrupted_training(tmp_path):
    kw = dict(steps=9, micro_batch=1, schedules={"tau": ScalarSchedule(1.0, 0.5, "cosine")}, save_every=3)
    torch.manual_seed(1)
    reference = TinyLM(dropout=0.2)
    ref = train(reference, noisy_loss(), data(32, seed=5), config(tmp_path / "ref", **kw))

    torch.manual_seed(1)
    model = TinyLM(dropout=0.2)
    # 4 micro-batches per step: the call in step 5 crashes; the last checkpoint is step 3.
    with pytest.raises(Crash):
        train(model, noisy_loss(crash_at_call=4 * 4 + 2), data(32, seed=5), config(tmp_path / "run", **kw))
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_00000003"]

    torch.manual_seed(123)  # the resumed process starts from another state: the checkpoint restores it
    model = TinyLM(dropout=0.2)
    resumed = train(model, noisy_loss(), data(32, seed=5), config(tmp_path / "run", **kw), resume=True)
    assert resumed.step == 9
    for name, p in trainable_state(reference).items():
        torch.testing.assert_close(trainable_state(model)[name], p, rtol=1e-6, atol=1e-7)
    strip = lambda rows: [{k: v for k, v in r.items() if k not in ("tokens_per_s", "elapsed_s")} for r in rows]
    assert strip(resumed.history) == strip(ref.history)  # the log was cut back to step 3 and continued
    with pytest.raises(ArmkvError, match="pass --resume"):
        train(TinyLM(dropout=0.2), noisy_loss(), data(32, seed=5), config(tmp_path / "run", **kw))
    with pytest.raises(ArmkvError, match="another training config"):
        train(
            TinyLM(dropout=0.2),
            noisy_loss(),
            data(32, seed=5),
            config(tmp_path / "run", **dict(kw, lr=1e-3)),
            resume=True,
        )
    with pytest.raises(ArmkvError, match="another model"):
        train(TinyLM(dim=16, dropout=0.2), noisy_loss(), data(32, seed=5), config(tmp_path / "run", **kw), resume=True)


def test_bf16_autocast_trains(tmp_path):
    torch.manual_seed(0)
    model = TinyLM()
    result = train(model, tiny_loss(), data(32), config(tmp_path, steps=15, precision="bf16"))
    losses = [r["loss"] for r in result.history]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_nothing_to_train_is_an_error(tmp_path):
    model = TinyLM().requires_grad_(False)
    with pytest.raises(ArmkvError, match="no trainable"):
        train(model, tiny_loss(), data(32), config(tmp_path))


DDP_SCRIPT = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_train_trainer import TinyLM, tiny_loss, data, config
from armkv.train.trainer import train
from safetensors.torch import save_file
import torch.distributed as dist
torch.manual_seed(0)
model = TinyLM()
result = train(model, tiny_loss(), data(16), config({out!r}, steps=6, seq_len=16, batch_tokens=8 * 16, micro_batch=2))
if dist.get_rank() == 0:
    save_file({{n: p.detach().contiguous() for n, p in model.named_parameters()}}, {out!r} + "/final.safetensors")
dist.destroy_process_group()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_gloo_processes_equal_one_process_with_the_same_global_batch(tmp_path):
    from safetensors.torch import load_file

    script = tmp_path / "ddp.py"
    script.write_text(DDP_SCRIPT.format(tests=str(Path(__file__).parent), out=str(tmp_path / "ddp")))
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(free_port()),
            str(script),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ddp = load_file(tmp_path / "ddp" / "final.safetensors")

    torch.manual_seed(0)
    single = TinyLM()
    start = {n: p.detach().clone() for n, p in single.named_parameters()}
    train(
        single,
        tiny_loss(),
        data(16),
        config(tmp_path / "single", steps=6, seq_len=16, batch_tokens=8 * 16, micro_batch=2),
    )
    for name, p in single.named_parameters():
        assert not torch.equal(p, start[name])  # it did train
        torch.testing.assert_close(ddp[name], p.detach(), rtol=1e-5, atol=1e-6)
    rows = [json.loads(line) for line in (tmp_path / "ddp" / "log.jsonl").read_text().splitlines()]
    single_rows = [json.loads(line) for line in (tmp_path / "single" / "log.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in single_rows], rel=1e-5)
