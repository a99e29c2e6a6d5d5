"""The model pieces the training tools share: the training model itself, and its attention
modules. (``calibrate``, ``policy`` and ``cli`` import from here, not from each other.)"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from armkv.errors import ArmkvError


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The attention modules (those with a ``k_proj``), in layer order."""
    found = [m for m in model.modules() if isinstance(getattr(m, "k_proj", None), torch.nn.Module)]
    if not found:
        raise ArmkvError(f"{type(model).__name__} has no attention module with a k_proj: not a Llama-family model")
    return found


def module_head_dim(attn: torch.nn.Module, model: torch.nn.Module) -> int:
    """The head size of attention module ``attn`` (its ``head_dim``, else the model config's)."""
    if getattr(attn, "head_dim", None):
        return int(attn.head_dim)
    config = model.config
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def load_model(args: argparse.Namespace):
    """The model (fp32, all parameters frozen) and its tokenizer."""
    if not args.model:
        from armkv.hf.model import load_model as load_default

        model, tokenizer = load_default()
        model.requires_grad_(False)
        return model, tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per run: the trainer's

    path = Path(args.model)
    if not path.is_dir():
        raise ArmkvError(f"--model {path}: not a directory")
    kwargs = {"gguf_file": args.gguf_file} if args.gguf_file else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32, **kwargs)
    except (OSError, ValueError) as e:
        raise ArmkvError(f"--model {path}: {str(e).splitlines()[0]}") from None
    model.requires_grad_(False)
    return model, tokenizer
