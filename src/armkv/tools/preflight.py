"""Checks a tool runs before it loads a model: the method, its budget and options, and where
results go. Everything here reads only the model folder's ``config.json``, so a mistake in
the command line costs a second, not a model load.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from armkv.errors import ArmkvError
from armkv.options import check_options

DEFAULT_BUDGET = 512  # token-equivalents per layer: every tool's default for the bounded methods


def model_folder(model_dir: str | Path | None) -> Path | None:
    """The folder ``--model`` names, or the default model's converted folder; None where the
    default model is not converted yet (its first load converts it, and checks come after)."""
    if model_dir is not None:
        return Path(model_dir)
    # armkv.hf.model.default_model_dir()'s folder, found without importing transformers (a test keeps them equal)
    folder = (
        Path(os.environ.get("ARMKV_CACHE") or Path.home() / ".cache" / "armkv") / "models" / "smollm2-135m-instruct"
    )
    return folder if (folder / "config.json").is_file() else None


def check_model_folder(model_dir: str | Path | None) -> None:
    """Raise ArmkvError, before the load, for a ``--model`` that is not a model folder: missing,
    a file, no ``config.json``, or no safetensors weights (armkv loads no pickled weights)."""
    if model_dir is None:
        return
    folder = Path(model_dir)
    if not folder.exists():
        raise ArmkvError(f"--model {folder}: no such folder (give a local transformers model folder)")
    if not folder.is_dir():
        raise ArmkvError(f"--model {folder} is a file; give the folder holding config.json and the weights")
    if not (folder / "config.json").is_file():
        raise ArmkvError(f"--model {folder} is not a transformers model folder (no config.json)")
    if not any(folder.glob("*.safetensors")):
        pickled = sorted(p.name for p in folder.glob("*.bin"))
        hint = (
            f"it holds {pickled[0]}, pickled weights armkv does not load: save the model with "
            "save_pretrained(safe_serialization=True)"
            if pickled
            else "copy or save the model's weights there (save_pretrained)"
        )
        raise ArmkvError(f"--model {folder} holds no weights (*.safetensors): {hint}")


def check_output_folder(folder: Path) -> None:
    """One-line errors for an output folder that is a file or lies under one."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ArmkvError(f"--output {folder} is a file; this tool writes a folder of results there: name a folder")
    for parent in folder.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ArmkvError(f"--output {folder}: {parent} is a file, not a folder")
            break


def model_info_from_config(model_dir: str | Path | None):
    """``(ModelInfo, Rotary)`` of a model folder read from its ``config.json`` alone (fp32, CPU),
    or ``(None, None)`` where there is no readable config (the model load reports that)."""
    import torch

    from armkv.memory.rope import Rotary
    from armkv.methods.base import ModelInfo

    folder = model_folder(model_dir)
    if folder is None and model_dir is None:
        # the default model before its first load converts it: its shape ships with armkv
        path = Path(__file__).resolve().parent.parent / "data" / "model_configs" / "smollm2-135m.json"
    elif folder is None or not (folder / "config.json").is_file():
        return None, None
    else:
        path = folder / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
        config = config.get("text_config", config)
        heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        info = ModelInfo(
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            max_positions=int(config.get("max_position_embeddings") or 2**31),
        )
        rope = config.get("rope_parameters") or {}
        theta = float(rope.get("rope_theta") or config.get("rope_theta") or 10000.0)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None, None  # not a config this check understands: the model load decides
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    return info, Rotary(inv_freq)


def machine_memory_bytes() -> int | None:
    """Physical memory of this machine (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def resolve_budget(method: str, budget: int | None, warn=None) -> int | None:
    """The budget a method runs with: ``budget``, or :data:`DEFAULT_BUDGET` for a bounded method
    when none is given; None for a method that keeps every token (a budget given to one is
    reported through ``warn``, not silently dropped)."""
    from armkv.methods.base import get_method

    if budget is not None and budget < 1:
        raise ArmkvError(f"--budget {budget} must be >= 1 token-equivalent")
    if not get_method(method).bounded:
        if budget is not None and warn is not None:
            warn(f"--budget {budget} does not apply to method {method!r}: it keeps every token")
        return None
    return DEFAULT_BUDGET if budget is None else budget


def check_method(
    method: str,
    budget: int | None,
    chunk: int,
    options: dict,
    model_dir: str | Path | None = None,
) -> None:
    """Raise ArmkvError, before any model loads, for what would fail later: an unknown method,
    an option key the method does not take (the message lists the ones it does), a budget
    the method cannot split, beyond the model's positions or larger than this machine's
    memory, a bad option value. ``budget`` is the one the method will run with
    (:func:`resolve_budget`)."""
    from armkv.methods.base import get_method

    spec = get_method(method)
    if chunk < 1:
        raise ArmkvError(f"--chunk {chunk} must be >= 1")
    options = check_options(method, options)
    info, rotary = model_info_from_config(model_dir)
    if info is None:
        return
    if spec.bounded:
        check_budget(budget, model_dir, info)
    for layer_idx in range(info.num_layers):  # bad values and budget shares fail here, cheaply (no state yet)
        spec.make_layer(layer_idx, info, rotary, budget if spec.bounded else None, chunk, **options)


def check_budget(budget: int | None, model_dir: str | Path | None = None, info=None) -> None:
    """Raise ArmkvError for a budget beyond the model's positions (no cache holds more tokens
    than the model can see) or whose cache would not fit in this machine's memory."""
    if info is None:
        info, _ = model_info_from_config(model_dir)
    if info is not None and budget is not None:
        if budget > info.max_positions:
            raise ArmkvError(
                f"--budget {budget} is more than the model's {info.max_positions} positions: a cache never holds "
                f"more tokens than that; use --budget {info.max_positions} or less (or --method full)"
            )
        need = info.budget_bytes(budget) * info.num_layers
        memory = machine_memory_bytes()
        if memory is not None and need > memory:
            raise ArmkvError(
                f"--budget {budget} needs up to {need / 2**30:.1f} GiB of cache ({info.num_layers} layers), more than "
                f"this machine's {memory / 2**30:.1f} GiB; lower --budget"
            )


def warn(tool: str):
    """A one-line warning printer for ``tool`` (``armkv TOOL: warning: ...`` on stderr)."""

    def say(message: str) -> None:
        print(f"armkv {tool}: warning: {message}", file=sys.stderr)

    return say
