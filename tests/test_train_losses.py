"""train/losses.py: cross-entropy, distillation, and the ARM hooks (set_schedule, aux_losses)."""

import pytest
import torch
import torch.nn.functional as F

from armkv.errors import ArmkvError
from armkv.train.losses import distill_kl, make_arm_loss, next_token_ce


def test_next_token_ce_matches_transformers_loss(llama):
    ids = torch.randint(3, 128, (2, 17))
    out = llama(input_ids=ids, labels=ids)
    torch.testing.assert_close(next_token_ce(out.logits, ids), out.loss)


def test_masked_ce_counts_only_the_masked_targets():
    logits, ids = torch.randn(2, 9, 11), torch.randint(0, 11, (2, 9))
    mask = torch.rand(2, 9) > 0.4
    per_token = F.cross_entropy(logits[:, :-1].reshape(-1, 11), ids[:, 1:].reshape(-1), reduction="none")
    keep = mask[:, 1:].reshape(-1)
    torch.testing.assert_close(next_token_ce(logits, ids, mask), per_token[keep].mean())


def test_distill_kl():
    student, teacher = torch.randn(2, 5, 7, requires_grad=True), torch.randn(2, 5, 7, requires_grad=True)
    assert distill_kl(teacher, teacher).abs() < 1e-6
    for temperature in (1.0, 2.0):
        p = F.softmax(teacher / temperature, -1)
        expected = (p * (p.log() - F.log_softmax(student / temperature, -1))).sum(-1).mean() * temperature**2
        torch.testing.assert_close(distill_kl(student, teacher, temperature), expected)
    distill_kl(student, teacher).backward()
    assert student.grad is not None and teacher.grad is None  # the teacher only gives targets


class FakeArmLayer(torch.nn.Module):
    """Stands in for an ARM layer: reads the schedule, reports auxiliary losses."""

    def __init__(self, balance: float):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(balance))
        self.schedule = None

    def set_schedule(self, values):
        self.schedule = values

    def aux_losses(self):
        return {"balance": self.w * 1.0, "budget": self.w * 0 + 0.25}


class FakeModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([FakeArmLayer(1.0), FakeArmLayer(3.0)])
        self.head = torch.nn.Embedding(10, 10)

    def forward(self, input_ids):
        return self.head(input_ids)


def test_arm_loss_adds_weighted_aux_losses_and_broadcasts_the_schedule():
    model, ids = FakeModel(), torch.randint(0, 10, (2, 6))
    loss_fn = make_arm_loss(aux_weights={"balance": 0.1, "budget": 2.0}, forward=lambda m, x: m(x))
    loss, metrics = loss_fn(model, {"input_ids": ids}, {"tau": 0.7, "step": 3})
    ce = next_token_ce(model(ids), ids)
    torch.testing.assert_close(loss, ce + 0.1 * 2.0 + 2.0 * 0.25)  # balance averaged over layers: (1 + 3) / 2
    assert set(metrics) == {"ce", "balance", "budget"} and metrics["balance"] == 2.0
    assert all(layer.schedule == {"tau": 0.7, "step": 3} for layer in model.layers)
    loss.backward()
    assert model.layers[0].w.grad == pytest.approx(0.05)


def test_arm_loss_with_distillation_and_bad_settings():
    model, ids = FakeModel(), torch.randint(0, 10, (2, 6))
    teacher_head = torch.nn.Embedding(10, 10)
    loss_fn = make_arm_loss(
        ce_weight=0.0,
        kl_weight=1.0,
        temperature=2.0,
        teacher=teacher_head,
        aux_weights={"balance": 0.0, "budget": 0.0},
        forward=lambda m, x: m(x),
    )
    loss, metrics = loss_fn(model, {"input_ids": ids}, {"step": 0})
    torch.testing.assert_close(loss, distill_kl(model(ids), teacher_head(ids), 2.0))
    assert set(metrics) == {"kl", "balance", "budget"}
    with pytest.raises(ArmkvError, match="without a weight"):
        make_arm_loss(aux_weights={"balance": 1.0}, forward=lambda m, x: m(x))(model, {"input_ids": ids}, {})
    with pytest.raises(ArmkvError, match="teacher"):
        make_arm_loss(kl_weight=1.0)
