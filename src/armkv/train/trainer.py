"""A training loop generic over a model and a loss function.

``train(model, loss_fn, data, config)`` optimises the parameters of ``model`` that have
``requires_grad`` with the paper's recipe by default (AdamW, lr 4e-4, weight decay 0.1,
betas (0.9, 0.95), clip 1.0, cosine schedule with 1% warm-up), a token-based batch with
gradient accumulation, fp32 or bf16 autocast, and exact resume from checkpoints.

Data parallel: under ``torchrun`` (``WORLD_SIZE`` > 1) every rank reads a disjoint shard
of each global batch (see :meth:`PackedSequences.next_step_batch`) and the gradients are
averaged with one all-reduce per optimizer step (gloo on CPU, nccl on GPU). We reduce the
flattened gradients ourselves instead of wrapping the model in DistributedDataParallel:
the loss function then sees the plain model (it reads ARM layers' auxiliary losses from
it), parameters that a step does not use need no special handling, and the trainable set
(the ARM parameters) is small enough that overlapping communication with backward would
not pay.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from armkv.errors import ArmkvError
from armkv.train.checkpoint import (
    capture_rng,
    latest_checkpoint,
    load_checkpoint,
    model_fingerprint,
    restore_rng,
    save_checkpoint,
)
from armkv.train.data import PackedSequences

# loss_fn(model, batch, schedule) -> (loss, metrics). batch: {"input_ids": LongTensor [B, T]}
# on the training device; schedule: the current value of every ScalarSchedule plus "step".
LossFn = Callable[[torch.nn.Module, dict, dict], tuple[torch.Tensor, dict]]


@dataclass
class ScalarSchedule:
    """A scalar annealed from ``start`` to ``end`` over the run (e.g. a Gumbel temperature)."""

    start: float
    end: float
    kind: str = "linear"  # "linear", "cosine" (slow at both ends) or "constant" (stays at start)

    def __post_init__(self) -> None:
        if self.kind not in ("linear", "cosine", "constant"):
            raise ArmkvError(f"schedule kind {self.kind!r}: use linear, cosine or constant")

    def value(self, step: int, total: int) -> float:
        """The value at optimizer step ``step`` (0-based) of ``total``."""
        t = min(max(step / max(total - 1, 1), 0.0), 1.0)
        if self.kind == "constant":
            return self.start
        if self.kind == "cosine":
            t = 0.5 * (1.0 - math.cos(math.pi * t))
        return self.start + (self.end - self.start) * t


@dataclass
class TrainConfig:
    """Everything that decides the trajectory of a run, and how the run is kept.

    The fields up to ``schedules`` decide the parameters reached: a resumed run must
    match them (see :meth:`trajectory`). The others (``out_dir`` on) can change
    between a run and its resume.
    """

    steps: int = 1000  # optimizer steps in the run
    seq_len: int = 2048  # tokens per packed sequence
    batch_tokens: int = 524_288  # tokens per optimizer step, all ranks together (the paper: 0.5 M)
    micro_batch: int = 1  # sequences per forward pass; accumulation makes up the rest
    lr: float = 4e-4  # peak learning rate
    min_lr: float = 0.0  # learning rate at the end of the cosine
    warmup: float = 0.01  # fraction of steps of linear warm-up
    weight_decay: float = 0.1  # AdamW decoupled decay, on parameters with 2+ dims only
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global gradient norm (0: no clipping)
    precision: str = "fp32"  # "fp32" or "bf16" (autocast; parameters and optimizer stay fp32)
    seed: int = 0
    schedules: dict[str, ScalarSchedule] = field(default_factory=dict)  # name -> schedule, given to loss_fn
    out_dir: str = "runs/train"  # log.jsonl, loss.png and checkpoints/ go here
    save_every: int = 0  # checkpoint every N steps (0: only at the end)
    keep_last: int = 3  # checkpoints kept
    log_every: int = 1  # log line every N steps
    progress: bool = True  # tqdm bar on rank 0
    plot: bool = True  # loss.png at the end

    def __post_init__(self) -> None:
        if self.precision not in ("fp32", "bf16"):
            raise ArmkvError(f"precision {self.precision!r}: use fp32 or bf16")
        for name in ("steps", "seq_len", "batch_tokens", "micro_batch", "log_every"):
            if getattr(self, name) < 1:
                raise ArmkvError(f"{name}={getattr(self, name)}: must be at least 1")
        if not 0.0 <= self.warmup < 1.0:
            raise ArmkvError(f"warmup={self.warmup}: a fraction of the steps in [0, 1)")
        self.betas = tuple(self.betas)

    def accum_steps(self, world_size: int) -> int:
        """Micro-batches per rank per optimizer step, so that
        ``world_size * accum * micro_batch * seq_len == batch_tokens``."""
        unit = world_size * self.micro_batch * self.seq_len
        if self.batch_tokens % unit:
            lower = max(unit, self.batch_tokens // unit * unit)
            raise ArmkvError(
                f"--batch-tokens {self.batch_tokens} is not a multiple of world_size x micro_batch x seq_len "
                f"= {world_size} x {self.micro_batch} x {self.seq_len} = {unit}; use e.g. {lower} or {lower + unit}"
            )
        return self.batch_tokens // unit

    def warmup_steps(self) -> int:
        return max(1, round(self.warmup * self.steps)) if self.warmup > 0 else 0

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step ``step`` (0-based): linear warm-up, then cosine."""
        w = self.warmup_steps()
        if step < w:
            return self.lr * (step + 1) / w
        t = min((step - w) / max(self.steps - w, 1), 1.0)
        return self.min_lr + (self.lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * t))

    def schedule_at(self, step: int) -> dict:
        values = {name: s.value(step, self.steps) for name, s in self.schedules.items()}
        values["step"] = step
        return values

    def trajectory(self) -> dict:
        """The fields a resumed run must share with the checkpoint (JSON-serialisable)."""
        keep = {f.name for f in dataclasses.fields(self)} - {
            "out_dir",
            "save_every",
            "keep_last",
            "log_every",
            "progress",
            "plot",
        }
        out = {k: v for k, v in dataclasses.asdict(self).items() if k in keep}
        out["betas"] = list(self.betas)
        return out


@dataclass
class TrainResult:
    step: int  # optimizer steps completed
    history: list[dict]  # the log lines of this process's run (rank 0; empty on others)
    out_dir: Path
    checkpoint: Path | None  # the last checkpoint written


def init_distributed() -> tuple[int, int, torch.device]:
    """Join the process group torchrun describes (if any).

    Returns
    -------
    (rank, world_size, device): device is ``cuda:LOCAL_RANK`` when CUDA is present, else CPU.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    return rank, world, device


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _make_optimizer(params: dict[str, torch.nn.Parameter], config: TrainConfig) -> torch.optim.AdamW:
    # Decay matrices only: decaying gains, biases and scalars towards 0 hurts and is not
    # what the GPT-style recipe the paper follows does.
    decay = [p for p in params.values() if p.ndim >= 2]
    no_decay = [p for p in params.values() if p.ndim < 2]
    groups = [
        g
        for g in ({"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0})
        if g["params"]
    ]
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps)


def _all_reduce_grads(params: list[torch.nn.Parameter], world: int) -> None:
    """Average the gradients over ranks with one all-reduce of their concatenation."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset : offset + n].view_as(p).clone()
        offset += n


def _mean_over_ranks(values: dict[str, float], world: int, device: torch.device) -> dict[str, float]:
    if world == 1 or not values:
        return values
    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return {k: v / world for k, v in zip(keys, t.tolist())}


def _truncate_log(path: Path, step: int) -> list[dict]:
    """Keep the log lines up to ``step`` (the resumed checkpoint), drop the rest: those
    steps are about to be redone."""
    if not path.exists():
        return []
    kept = [
        r for r in (json.loads(line) for line in path.read_text().splitlines() if line.strip()) if r["step"] <= step
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in kept))
    return kept


def plot_log(log_path: str | Path, out_path: str | Path) -> None:
    """Loss curves (the total and every metric logged beside it) and the learning rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in Path(log_path).read_text().splitlines() if line.strip()]
    if not rows:
        return
    steps = [r["step"] for r in rows]
    bookkeeping = {"step", "lr", "grad_norm", "tokens", "tokens_per_s", "elapsed_s"}
    numeric = sorted({k for r in rows for k, v in r.items() if isinstance(v, (int, float)) and k not in bookkeeping})
    # one panel per curve (their scales differ by orders of magnitude: a balance term near
    # -80 would flatten a KL near 0.01), the raw value faint and a running mean over it
    names = ["loss"] + [k for k in numeric if k != "loss" and not k.startswith("schedule/")]
    names += ["lr"] + [k for k in numeric if k.startswith("schedule/")]
    cols = min(4, len(names))
    nrows = -(-len(names) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.5 * cols, 3.2 * nrows), squeeze=False)
    window = max(1, len(rows) // 20)
    for ax, name in zip(axes.flat, names):
        values = [r.get(name, float("nan")) for r in rows]
        ax.plot(steps, values, color="tab:blue", alpha=0.35 if window > 1 else 1.0)
        if window > 1 and not name.startswith("schedule/") and name != "lr":
            smooth = [
                sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
                for i in range(len(values))
            ]
            ax.plot(steps, smooth, color="tab:blue", label=f"mean of {window}")
            ax.legend()
        ax.set_title(name)
        ax.set_xlabel("step")
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(out_path, dpi=120)
    plt.close(fig)


def train(
    model: torch.nn.Module,
    loss_fn: LossFn,
    data: PackedSequences,
    config: TrainConfig,
    *,
    resume: bool = False,
    fingerprint: str | None = None,
) -> TrainResult:
    """Train the parameters of ``model`` that require grad.

    Parameters
    ----------
    model : nn.Module
        Moved to the training device here. Its trainable parameters are those with
        ``requires_grad``; everything else stays frozen.
    loss_fn : callable (model, batch, schedule) -> (loss, metrics)
        ``batch = {"input_ids": LongTensor [micro_batch, seq_len]}``; ``schedule`` holds the
        current value of every ``config.schedules`` entry and ``"step"``. ``loss`` is a
        scalar mean over the micro-batch; ``metrics`` maps names to floats or 0-dim
        tensors, averaged and logged (every rank must report the same names).
    data : PackedSequences
        Every rank builds the same stream; each keeps its own shard of every batch.
    config : TrainConfig
    resume : bool
        Continue from the newest checkpoint in ``config.out_dir/checkpoints`` (a fresh
        start if there is none). The model, data and config must be those of the run
        that wrote it; the result is then the same as an uninterrupted run. The number
        of processes may change on resume (the global batch is ``batch_tokens`` either
        way); only per-rank randomness (e.g. Gumbel noise) then differs.
    fingerprint : str, optional
        Identifies the model in checkpoints (default: :func:`model_fingerprint`).

    Returns
    -------
    TrainResult
    """
    rank, world, device = init_distributed()
    model.to(device)
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    if not params:
        raise ArmkvError("the model has no trainable parameters (nothing has requires_grad=True)")
    param_list = list(params.values())
    accum = config.accum_steps(world)
    if data.seq_len != config.seq_len:
        raise ArmkvError(f"the data packs {data.seq_len}-token sequences but config.seq_len is {config.seq_len}")
    fingerprint = fingerprint or model_fingerprint(model)
    out_dir = Path(config.out_dir)
    ckpt_root = out_dir / "checkpoints"
    log_path = out_dir / "log.jsonl"
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)

    seed_everything(config.seed + rank)
    optimizer = _make_optimizer(params, config)
    start, history, last_ckpt = 0, [], None
    if resume and latest_checkpoint(ckpt_root) is not None:
        start, history, last_ckpt = _restore(
            ckpt_root,
            params=params,
            optimizer=optimizer,
            data=data,
            config=config,
            fingerprint=fingerprint,
            rank=rank,
            log_path=log_path,
        )
    elif latest_checkpoint(ckpt_root) is not None:
        # A fresh run would mix its checkpoints with the old ones (and keep-last would
        # delete its own, lower-numbered, first).
        raise ArmkvError(
            f"{ckpt_root} holds checkpoints of an earlier run: pass --resume to continue it, or use another --out"
        )
    elif rank == 0 and log_path.exists():
        log_path.unlink()
    last_ckpt_step = start if last_ckpt else None

    def save(step: int) -> Path | None:
        """Checkpoint from rank 0 with every rank's RNG state; the path on rank 0."""
        rng = capture_rng()
        if world > 1:
            gathered: list = [None] * world
            dist.all_gather_object(gathered, rng)
            rng_states = dict(enumerate(gathered))
        else:
            rng_states = {0: rng}
        path = None
        if rank == 0:
            path = save_checkpoint(
                ckpt_root,
                step,
                params=params,
                optimizer_state=optimizer.state_dict(),
                scheduler_state={"kind": "warmup_cosine", "step": step},
                data_state=data.state_dict(),
                rng_states=rng_states,
                config=config.trajectory(),
                fingerprint=fingerprint,
                keep_last=config.keep_last,
                extra={"world_size": world},
            )
        if world > 1:
            dist.barrier()
        return path

    from tqdm.auto import tqdm

    bar = tqdm(
        total=config.steps, initial=start, disable=not (config.progress and rank == 0), unit="step", dynamic_ncols=True
    )
    tokens_per_step = config.batch_tokens
    autocast = torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=config.precision == "bf16")
    t0 = time.perf_counter()
    step = start
    model.train()
    try:
        while step < config.steps:
            micro_batches = data.next_step_batch(config.micro_batch, accum, rank, world)
            if micro_batches is None:
                if rank == 0:
                    print(f"the data ran out after {step} steps")
                break
            schedule = config.schedule_at(step)
            lr = config.lr_at(step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            sums: dict[str, float] = {}
            for input_ids in micro_batches:
                with autocast:
                    loss, metrics = loss_fn(model, {"input_ids": input_ids.to(device)}, schedule)
                (loss / accum).backward()
                for k, v in {"loss": loss, **metrics}.items():
                    sums[k] = sums.get(k, 0.0) + float(v.detach() if isinstance(v, torch.Tensor) else v) / accum
            if world > 1:
                _all_reduce_grads(param_list, world)
            if config.grad_clip > 0:
                grad_norm = float(torch.nn.utils.clip_grad_norm_(param_list, config.grad_clip))
            else:
                grad_norm = float(
                    torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in param_list if p.grad is not None]))
                )
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            values = _mean_over_ranks(sums, world, device)
            elapsed = time.perf_counter() - t0
            tok_s = (step - start) * tokens_per_step / max(elapsed, 1e-9)
            if rank == 0:
                bar.update(1)
                bar.set_postfix(loss=f"{values['loss']:.4f}", tok_s=f"{tok_s:,.0f}")
                if step % config.log_every == 0 or step == config.steps:
                    row = {
                        "step": step,
                        **values,
                        "lr": lr,
                        "grad_norm": grad_norm,
                        **{f"schedule/{k}": v for k, v in schedule.items() if k != "step"},
                        "tokens": step * tokens_per_step,
                        "tokens_per_s": tok_s,
                        "elapsed_s": elapsed,
                    }
                    history.append(row)
                    with log_path.open("a") as f:
                        f.write(json.dumps(row) + "\n")
            if (config.save_every and step % config.save_every == 0) or step == config.steps:
                last_ckpt, last_ckpt_step = save(step) or last_ckpt, step
    finally:
        bar.close()
    if step != last_ckpt_step and step > start:
        # The data ran out before config.steps: keep what was trained.
        last_ckpt = save(step) or last_ckpt
    if rank == 0 and config.plot and log_path.exists():
        plot_log(log_path, out_dir / "loss.png")
    return TrainResult(step=step, history=history, out_dir=out_dir, checkpoint=last_ckpt)


def _restore(
    ckpt_root: Path,
    *,
    params: dict[str, torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    data: PackedSequences,
    config: TrainConfig,
    fingerprint: str,
    rank: int,
    log_path: Path,
) -> tuple[int, list[dict], Path]:
    """Load the newest checkpoint into the parameters, optimizer, data position and this
    rank's RNG; cut the log back to it. Returns (step, log rows so far, checkpoint path)."""
    ckpt = load_checkpoint(ckpt_root, fingerprint=fingerprint, config=config.trajectory())
    missing = set(params) ^ set(ckpt.params)
    if missing:
        raise ArmkvError(f"checkpoint {ckpt.path} trains other parameters than this model ({sorted(missing)[:3]} ...)")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(ckpt.params[name])
    optimizer.load_state_dict(ckpt.optimizer)
    data.load_state_dict(ckpt.data)
    if rank in ckpt.rng:
        restore_rng(*ckpt.rng[rank])
    else:
        # More ranks than the run that wrote the checkpoint: a fresh stream for this one.
        seed_everything(config.seed + rank + 1_000_003 * ckpt.step)
    history = []
    if rank == 0:
        history = _truncate_log(log_path, ckpt.step)
        print(f"resumed from {ckpt.path} at step {ckpt.step}")
    return ckpt.step, history, ckpt.path
