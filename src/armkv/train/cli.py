"""``armkv train``: train the ARM parameters of a model (or, with ``--method lm``, the
model itself) with the paper's recipe. Runs as one process or under ``torchrun``.

Examples
--------
One CPU process, the offline corpus::

    armkv train --model DIR --method lm --unfreeze all --seq-len 256 --batch-tokens 4096 --steps 100

Two processes on one machine (gloo on CPU, nccl on GPU)::

    torchrun --nproc_per_node 2 -m armkv.cli train --model DIR ...
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from armkv.errors import ArmkvError
from armkv.train.data import PackedSequences, add_data_arguments, hf_tokenize, source_from_args
from armkv.train.losses import make_arm_loss
from armkv.train.models import load_model
from armkv.train.trainer import ScalarSchedule, TrainConfig, train

METHODS = ("arm", "lm", "policy")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--method",
        choices=METHODS,
        default="arm",
        help="arm: train the ARM parameters (router, writes, policy) through the model's loss; policy: fit only "
        "the top-M policy of --adapter to the M its layer's attention outputs need (--error); "
        "lm: train the model itself (needs --unfreeze all or --lora-rank)",
    )
    parser.add_argument(
        "--model", metavar="DIR", help="local Hugging Face model directory (default: the default model)"
    )
    parser.add_argument("--gguf-file", help="GGUF file inside --model to load")
    parser.add_argument(
        "--unfreeze",
        choices=("none", "all"),
        default="none",
        help="base model parameters to train beside the method's own",
    )
    parser.add_argument(
        "--lora-rank", type=int, default=0, help="train LoRA adapters of this rank on the attention projections (peft)"
    )
    parser.add_argument(
        "--budget", type=int, default=512, help="ARM memory budget in token-equivalents (sinks + window + slots)"
    )
    parser.add_argument("--chunk", type=int, default=256, help="P: prefill chunk of the ARM forward")
    parser.add_argument(
        "--adapter",
        help="start from this ARM adapter (e.g. a calibrated one) instead of a fresh initialisation "
        "(--method policy: the shipped one by default)",
    )
    add_data_arguments(parser)

    d = TrainConfig()
    g = parser.add_argument_group("optimisation (defaults: the paper's recipe)")
    g.add_argument("--steps", type=int, default=d.steps, help="optimizer steps")
    g.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per packed sequence")
    g.add_argument(
        "--batch-tokens", type=int, default=d.batch_tokens, help="tokens per optimizer step over all processes"
    )
    g.add_argument(
        "--micro-batch",
        type=int,
        default=d.micro_batch,
        help="sequences per forward pass (gradient accumulation makes up the batch)",
    )
    g.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    g.add_argument("--min-lr", type=float, default=d.min_lr, help="learning rate at the end of the cosine")
    g.add_argument("--warmup", type=float, default=d.warmup, help="fraction of steps of linear warm-up")
    g.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW weight decay")
    g.add_argument("--betas", type=float, nargs=2, default=list(d.betas), metavar=("B1", "B2"), help="AdamW betas")
    g.add_argument("--grad-clip", type=float, default=d.grad_clip, help="max gradient norm (0: off)")
    g.add_argument(
        "--precision", choices=("fp32", "bf16"), default=d.precision, help="autocast precision of the forward"
    )
    g.add_argument("--seed", type=int, default=d.seed, help="seed of the initialisation, data order and sampling")

    g = parser.add_argument_group("loss")
    g.add_argument("--ce-weight", type=float, default=1.0, help="weight of next-token cross-entropy")
    g.add_argument(
        "--kl-weight", type=float, default=0.0, help="weight of distillation from the full-cache model (KL on logits)"
    )
    g.add_argument("--kd-temperature", type=float, default=1.0, help="distillation temperature")
    g.add_argument("--alpha", type=float, default=0.01, help="weight of the router balance loss")
    g.add_argument(
        "--budget-penalty", type=float, default=0.01, help="lambda: weight of the policy's read cost E[M]/N_b"
    )
    g.add_argument(
        "--tau",
        type=float,
        nargs=2,
        default=[1.0, 0.1],
        metavar=("START", "END"),
        help="Gumbel-Softmax temperature over the run",
    )
    g.add_argument(
        "--tau-schedule",
        choices=("linear", "cosine", "constant"),
        default="linear",
        help="how --tau goes from START to END",
    )
    g.add_argument(
        "--epsilon",
        type=float,
        nargs=2,
        default=[0.1, 0.0],
        metavar=("START", "END"),
        help="policy exploration over the run",
    )
    g.add_argument(
        "--epsilon-schedule",
        choices=("linear", "cosine", "constant"),
        default="linear",
        help="how --epsilon goes from START to END",
    )

    from armkv.train.policy import add_arguments as add_policy_arguments

    add_policy_arguments(parser.add_argument_group("policy targets (--method policy)"))

    g = parser.add_argument_group("run")
    g.add_argument("--out", default="runs/train", help="directory for log.jsonl, loss.png and checkpoints/")
    g.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    g.add_argument("--keep-last", type=int, default=3, help="checkpoints kept")
    g.add_argument("--log-every", type=int, default=1, help="log every N steps")
    g.add_argument("--resume", action="store_true", help="continue exactly from the newest checkpoint in --out")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--no-plot", action="store_true", help="no loss.png at the end")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        steps=args.steps,
        seq_len=args.seq_len,
        batch_tokens=args.batch_tokens,
        micro_batch=args.micro_batch,
        lr=args.lr,
        min_lr=args.min_lr,
        warmup=args.warmup,
        weight_decay=args.weight_decay,
        betas=tuple(args.betas),
        grad_clip=args.grad_clip,
        precision=args.precision,
        seed=args.seed,
        schedules={
            "tau": ScalarSchedule(*args.tau, kind=args.tau_schedule),
            "epsilon": ScalarSchedule(*args.epsilon, kind=args.epsilon_schedule),
        },
        out_dir=args.out,
        save_every=args.save_every,
        keep_last=args.keep_last,
        log_every=args.log_every,
        progress=not args.no_progress,
        plot=not args.no_plot,
    )


def add_lora(model: torch.nn.Module, rank: int) -> torch.nn.Module:
    """Wrap ``model`` with LoRA adapters on q/k/v/o (their parameters are trainable)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ArmkvError("--lora-rank needs peft: pip install peft") from None
    return get_peft_model(
        model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    )


def prepare_arm(model: torch.nn.Module, args: argparse.Namespace):
    """Wrap ``model`` for ARM training; returns ``(model, teacher)``.

    Only the ARM parameters (and what --unfreeze / --lora-rank add) train; the forward is
    the chunked ARM attention used at inference; the teacher is the same model with the
    full cache (see armkv.train.arm).
    """
    from armkv.train.arm import prepare_arm_training

    return prepare_arm_training(model, args.budget, args.chunk, args.adapter, args.seed)


def main_policy(args: argparse.Namespace) -> int:
    """``--method policy``: no gradient through the model, only the policy's fit (armkv.train.policy)."""
    from armkv.train import policy

    policy.check_error(args.error)  # a bad target is an error before the model loads
    if args.sequences < 1 or args.policy_steps < 0 or args.seq_len < 2:
        raise ArmkvError("--sequences must be at least 1, --policy-steps at least 0 and --seq-len at least 2")
    if args.adapter not in (None, "calibrated") and not Path(args.adapter).is_dir():
        raise ArmkvError(f"--adapter {args.adapter}: not a folder (an adapter folder, or omit it for the shipped one)")
    source_from_args(args, args.seed)  # bad data flags fail before the model loads
    model, tokenizer = load_model(args)
    return policy.main(args, model, tokenizer)


def main(args: argparse.Namespace) -> int:
    if args.method == "policy":
        return main_policy(args)
    config = config_from_args(args)
    config.accum_steps(int(os.environ.get("WORLD_SIZE", "1")))  # a bad batch size fails before the model loads
    source = source_from_args(args, args.seed)
    model, tokenizer = load_model(args)
    if tokenizer.eos_token_id is None:
        raise ArmkvError(f"the tokenizer of {args.model} has no EOS token to separate documents")
    if args.unfreeze == "all":
        model.requires_grad_(True)
    if args.lora_rank:
        model = add_lora(model, args.lora_rank)
    teacher = None
    if args.method == "arm":
        model, teacher = prepare_arm(model, args)
    elif args.kl_weight:
        raise ArmkvError("--kl-weight needs a teacher: only --method arm distils (from the full-cache model)")
    if not any(p.requires_grad for p in model.parameters()):
        raise ArmkvError("nothing to train: pass --unfreeze all or --lora-rank R")

    data = PackedSequences(source, hf_tokenize(tokenizer), tokenizer.eos_token_id, args.seq_len)
    loss_fn = make_arm_loss(
        ce_weight=args.ce_weight,
        kl_weight=args.kl_weight,
        temperature=args.kd_temperature,
        teacher=teacher,
        aux_weights={"balance": args.alpha, "budget": args.budget_penalty},
    )
    try:
        result = train(model, loss_fn, data, config, resume=args.resume)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    if args.method == "arm" and int(os.environ.get("RANK", "0")) == 0:
        adapter = model.arm.save(
            Path(args.out) / "adapter",
            dtype=torch.bfloat16,
            extra={"steps": result.step, "budget": args.budget, "chunk": args.chunk, "init": args.adapter or "random"},
        )
        print(f"ARM adapter: {adapter}")
    if result.history:
        last = result.history[-1]
        print(
            json.dumps(
                {
                    "step": result.step,
                    "loss": last["loss"],
                    "out_dir": str(result.out_dir),
                    "checkpoint": str(result.checkpoint) if result.checkpoint else None,
                }
            )
        )
    return 0
