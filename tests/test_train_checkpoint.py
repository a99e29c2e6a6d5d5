"""train/checkpoint.py: safetensors + JSON round trip, atomic writes, keep-last, and bad checkpoints."""

import json
import random

import numpy as np
import pytest
import torch

import armkv.train.checkpoint as ckpt_mod
from armkv.errors import ArmkvError
from armkv.train.checkpoint import (
    capture_rng,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    model_fingerprint,
    restore_rng,
    save_checkpoint,
)


def trained_model_and_optimizer(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    model[0].requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    for _ in range(3):
        model(torch.randn(5, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def save(root, step, model, opt, config=None, **kw):
    return save_checkpoint(
        root,
        step,
        params={n: p for n, p in model.named_parameters() if p.requires_grad},
        optimizer_state=opt.state_dict(),
        scheduler_state={"step": step},
        data_state={"doc": 3, "offset": 7},
        rng_states={0: capture_rng()},
        config=config or {"lr": 1e-2},
        fingerprint=model_fingerprint(model),
        **kw,
    )


def test_round_trip_restores_params_optimizer_data_and_rng(tmp_path):
    model, opt = trained_model_and_optimizer()
    random.seed(5)
    np.random.seed(6)
    torch.manual_seed(7)
    path = save(tmp_path, 3, model, opt)
    expected = (random.random(), np.random.rand(), torch.rand(3))
    assert sorted(p.name for p in path.iterdir()) == ["COMPLETE", "meta.json", "tensors.safetensors"]

    ck = load_checkpoint(tmp_path, fingerprint=model_fingerprint(model), config={"lr": 1e-2})
    assert ck.step == 3 and ck.data == {"doc": 3, "offset": 7} and ck.scheduler == {"step": 3}
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert torch.equal(ck.params[name], p)
    fresh_model, _ = trained_model_and_optimizer()
    fresh = torch.optim.AdamW([p for p in fresh_model.parameters() if p.requires_grad], lr=1.0)
    fresh.load_state_dict(ck.optimizer)
    loaded, original = fresh.state_dict()["state"], opt.state_dict()["state"]
    assert loaded.keys() == original.keys()
    for i in loaded:
        assert loaded[i].keys() == original[i].keys() and all(
            torch.equal(loaded[i][k], original[i][k]) for k in loaded[i]
        )
    assert fresh.param_groups[0]["lr"] == 1e-2 and fresh.param_groups[0]["betas"] == (0.9, 0.95)
    restore_rng(*ck.rng[0])
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])


def test_keep_last(tmp_path):
    model, opt = trained_model_and_optimizer()
    for step in (1, 2, 3, 4):
        save(tmp_path, step, model, opt, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000003", "step_00000004"]


@pytest.mark.parametrize("fail_on", [1, 2, 3])
def test_crash_mid_write_leaves_previous_checkpoint_intact(tmp_path, monkeypatch, fail_on):
    model, opt = trained_model_and_optimizer()
    good = save(tmp_path, 1, model, opt)
    before = {p.name: p.read_bytes() for p in good.iterdir()}
    real_replace, calls = ckpt_mod.os.replace, []

    def crash_after_temp_write(src, dst):  # the temp file is written and fsynced; crash before the rename
        calls.append(dst)
        if len(calls) == fail_on:
            raise OSError("simulated crash")
        real_replace(src, dst)

    monkeypatch.setattr(ckpt_mod.os, "replace", crash_after_temp_write)
    with pytest.raises(OSError, match="simulated"):
        save(tmp_path, 2, model, opt)
    monkeypatch.setattr(ckpt_mod.os, "replace", real_replace)
    assert latest_checkpoint(tmp_path) == good
    assert {p.name: p.read_bytes() for p in good.iterdir()} == before
    assert load_checkpoint(tmp_path).step == 1
    assert not list((tmp_path / "step_00000002").glob(".*tmp*"))  # no temp file left behind
    save(tmp_path, 3, model, opt)  # the next save clears the incomplete directory
    assert not (tmp_path / "step_00000002").exists()


def one_line_error(*args, **kw):
    with pytest.raises(ArmkvError) as e:
        load_checkpoint(*args, **kw)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_corrupt_truncated_and_foreign_checkpoints_are_refused(tmp_path):
    model, opt = trained_model_and_optimizer()
    path = save(tmp_path, 1, model, opt, config={"lr": 1e-2, "seq_len": 64})
    other, _ = trained_model_and_optimizer(seed=1)
    assert "another model" in one_line_error(tmp_path, fingerprint=model_fingerprint(other))
    assert "seq_len: 64 -> 128" in one_line_error(tmp_path, config={"lr": 1e-2, "seq_len": 128})

    tensors = path / "tensors.safetensors"
    data = tensors.read_bytes()
    tensors.write_bytes(data[: len(data) // 2])
    assert "corrupt or truncated" in one_line_error(path)
    tensors.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    assert "corrupt or truncated" in one_line_error(path)
    tensors.write_bytes(data)
    (path / "COMPLETE").write_text("{not json")
    assert "unreadable" in one_line_error(path)
    (path / "COMPLETE").unlink()
    assert "no complete checkpoint" in one_line_error(tmp_path)
    assert "does not exist" in one_line_error(tmp_path / "missing")


def test_fingerprint_tracks_architecture_and_frozen_weights():
    a, _ = trained_model_and_optimizer(seed=0)
    b, _ = trained_model_and_optimizer(seed=0)
    assert model_fingerprint(a) == model_fingerprint(b)
    with torch.no_grad():
        b[2].weight.add_(1.0)  # trainable: may change
    assert model_fingerprint(a) == model_fingerprint(b)
    with torch.no_grad():
        b[0].weight.add_(1.0)  # frozen base weights: another model
    assert model_fingerprint(a) != model_fingerprint(b)


def test_no_pickle_anywhere(tmp_path):
    model, opt = trained_model_and_optimizer()
    path = save(tmp_path, 1, model, opt)
    json.loads((path / "meta.json").read_text())
    from safetensors import safe_open

    with safe_open(str(path / "tensors.safetensors"), "pt") as f:
        assert {k.split(".")[0] for k in f.keys()} == {"param", "optim", "rng"}
