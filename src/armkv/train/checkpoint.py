"""Training checkpoints: safetensors and JSON only (never pickle), written atomically.

A checkpoint is a directory ``<root>/step_<NNNNNNNN>/`` with
- ``tensors.safetensors``: trainable parameters (``param.<name>``), the optimizer's
  per-parameter tensors (``optim.<index>.<key>``: AdamW's exp_avg, exp_avg_sq, step)
  and each rank's RNG states (``rng.<rank>.torch``, ``rng.<rank>.cuda.<device>``,
  ``rng.<rank>.numpy``);
- ``meta.json``: step, model fingerprint, training config and its hash, optimizer
  param groups, scheduler state, data position, Python/numpy RNG scalars;
- ``COMPLETE``: written last, with the SHA-256 of both files.
Every file goes to a temporary name in the same directory, is fsynced and renamed over
its final name, so a crash leaves either the whole checkpoint or one without
``COMPLETE``, which loading ignores and the next save deletes. Previous checkpoints are
never touched before the new one is complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from armkv.errors import ArmkvError

FORMAT_VERSION = 1
TENSORS_FILE = "tensors.safetensors"
META_FILE = "meta.json"
MARKER_FILE = "COMPLETE"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


@dataclass
class Checkpoint:
    """A loaded checkpoint (see the module docstring for what each field holds)."""

    path: Path
    step: int
    params: dict[str, torch.Tensor]  # trainable parameter name -> tensor
    optimizer: dict  # a torch optimizer state_dict, ready for load_state_dict
    scheduler: dict
    data: dict  # PackedSequences.state_dict()
    rng: dict[int, tuple[dict[str, torch.Tensor], dict]]  # rank -> (tensors, scalars)
    config: dict
    extra: dict


def config_hash(config: dict) -> str:
    """SHA-256 of a JSON-serialisable config, independent of key order."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()


def model_fingerprint(model: torch.nn.Module) -> str:
    """Identify the model a checkpoint belongs to.

    Hashes the class name, every parameter's name, shape and dtype, and a rounded
    sum of every frozen parameter (so two checkpoints of the same architecture but other
    base weights differ; trainable parameters change during training and are left out).
    """
    h = hashlib.sha256(type(model).__name__.encode())
    with torch.no_grad():
        for name, p in model.named_parameters():
            h.update(f"{name}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad}".encode())
            if not p.requires_grad:
                h.update(f"{p.double().sum().item():.5g}".encode())
    return h.hexdigest()[:16]


def capture_rng() -> tuple[dict[str, torch.Tensor], dict]:
    """This process's RNG states as (tensors, JSON scalars): torch CPU, CUDA (every
    device, if present), numpy's global generator, Python's ``random``."""
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda.{i}"] = state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    tensors["numpy"] = torch.from_numpy(keys.astype(np.int64))
    version, py_state, gauss_next = random.getstate()
    scalars = {
        "numpy": {"kind": kind, "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": {"version": version, "state": list(py_state), "gauss_next": gauss_next},
    }
    return tensors, scalars


def restore_rng(tensors: dict[str, torch.Tensor], scalars: dict) -> None:
    """Inverse of :func:`capture_rng`."""
    torch.set_rng_state(tensors["torch"])
    cuda = sorted((k for k in tensors if k.startswith("cuda.")), key=lambda k: int(k.split(".")[1]))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensors[k] for k in cuda])
    n = scalars["numpy"]
    np.random.set_state(
        (n["kind"], tensors["numpy"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    p = scalars["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss_next"]))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that ``path`` holds either its old content or all
    of ``data``: temporary file in the same directory, fsync, rename."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and (p / MARKER_FILE).is_file()
    ]
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root``, or None."""
    found = list_checkpoints(root)
    return found[-1] if found else None


def _optimizer_to_tensors(state_dict: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """Split an optimizer state_dict into tensors (``optim.<index>.<key>``) and JSON."""
    tensors, scalars = {}, {}
    for index, per_param in state_dict["state"].items():
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim.{index}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(index), {})[key] = value
    return tensors, {"param_groups": state_dict["param_groups"], "scalar_state": scalars}


def _optimizer_from_tensors(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[int, dict] = {}
    for name, value in tensors.items():
        if name.startswith("optim."):
            _, index, key = name.split(".", 2)
            state.setdefault(int(index), {})[key] = value
    for index, values in meta["scalar_state"].items():
        state.setdefault(int(index), {}).update(values)
    groups = [dict(g, betas=tuple(g["betas"])) if "betas" in g else dict(g) for g in meta["param_groups"]]
    # safetensors returns tensors in no particular order; keep the optimizer's (by index).
    return {"state": dict(sorted(state.items())), "param_groups": groups}


def save_checkpoint(
    root: str | Path,
    step: int,
    *,
    params: dict[str, torch.Tensor],
    optimizer_state: dict,
    scheduler_state: dict,
    data_state: dict,
    rng_states: dict[int, tuple[dict[str, torch.Tensor], dict]],
    config: dict,
    fingerprint: str,
    keep_last: int = 3,
    extra: dict | None = None,
) -> Path:
    """Write checkpoint ``step`` under ``root``, then keep only the newest ``keep_last``.

    Parameters
    ----------
    params : trainable parameter name -> tensor
    optimizer_state : ``optimizer.state_dict()``
    scheduler_state, data_state, extra : JSON-serialisable dicts
    rng_states : rank -> :func:`capture_rng` of that rank
    config : the training config that must match on resume
    fingerprint : :func:`model_fingerprint` of the model

    Returns
    -------
    Path of the checkpoint directory.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.iterdir():
        # A directory without its marker is the remains of a crashed save.
        if _STEP_DIR.match(stale.name) and not (stale / MARKER_FILE).is_file():
            shutil.rmtree(stale, ignore_errors=True)
    path = root / f"step_{step:08d}"
    if path.exists():
        shutil.rmtree(path)
    path.mkdir()

    tensors = {f"param.{name}": t.detach().cpu().contiguous().clone() for name, t in params.items()}
    optim_tensors, optim_meta = _optimizer_to_tensors(optimizer_state)
    tensors.update(optim_tensors)
    rng_meta = {}
    for rank, (rng_tensors, rng_scalars) in rng_states.items():
        tensors.update({f"rng.{rank}.{k}": v.contiguous() for k, v in rng_tensors.items()})
        rng_meta[str(rank)] = rng_scalars
    tensor_bytes = st_save(tensors)
    meta = {
        "format": FORMAT_VERSION,
        "step": step,
        "fingerprint": fingerprint,
        "config": config,
        "config_hash": config_hash(config),
        "optimizer": optim_meta,
        "scheduler": scheduler_state,
        "data": data_state,
        "rng": rng_meta,
        "extra": extra or {},
    }
    meta_bytes = json.dumps(meta, indent=1, default=str).encode()
    write_atomic(path / TENSORS_FILE, tensor_bytes)
    write_atomic(path / META_FILE, meta_bytes)
    marker = {TENSORS_FILE: _sha256(tensor_bytes), META_FILE: _sha256(meta_bytes)}
    write_atomic(path / MARKER_FILE, json.dumps(marker).encode())
    _fsync_dir(root)

    if keep_last > 0:
        for old in list_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return path


def _config_diff(saved: dict, current: dict) -> str:
    keys = sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))
    return ", ".join(f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in keys[:6])


def load_checkpoint(path: str | Path, *, fingerprint: str | None = None, config: dict | None = None) -> Checkpoint:
    """Read and verify a checkpoint directory (or the latest one under a root directory).

    Raises
    ------
    ArmkvError
        No complete checkpoint, a file whose checksum or format is wrong (corrupt or
        truncated), or a checkpoint of another model (``fingerprint``) or another
        training config (``config``).
    """
    path = Path(path)
    if not path.exists():
        raise ArmkvError(f"checkpoint {path} does not exist")
    if not (path / MARKER_FILE).exists():
        latest = latest_checkpoint(path)
        if latest is None:
            raise ArmkvError(f"{path} holds no complete checkpoint (no {MARKER_FILE} marker)")
        path = latest
    try:
        marker = json.loads((path / MARKER_FILE).read_text())
        tensor_bytes = (path / TENSORS_FILE).read_bytes()
        meta_bytes = (path / META_FILE).read_bytes()
    except (OSError, ValueError) as e:
        raise ArmkvError(f"checkpoint {path} is unreadable: {e}") from None
    for name, data in ((TENSORS_FILE, tensor_bytes), (META_FILE, meta_bytes)):
        if marker.get(name) != _sha256(data):
            raise ArmkvError(f"checkpoint {path}: {name} is corrupt or truncated (checksum mismatch)")
    try:
        meta = json.loads(meta_bytes)
        tensors = st_load(tensor_bytes)
    except Exception as e:  # safetensors raises its own error types for malformed headers
        raise ArmkvError(f"checkpoint {path} is not a valid armkv checkpoint: {e}") from None
    if meta.get("format") != FORMAT_VERSION:
        raise ArmkvError(f"checkpoint {path} has format {meta.get('format')}, this armkv reads {FORMAT_VERSION}")
    if fingerprint is not None and meta["fingerprint"] != fingerprint:
        raise ArmkvError(
            f"checkpoint {path} belongs to another model (fingerprint {meta['fingerprint']}, this model {fingerprint})"
        )
    if config is not None and meta["config_hash"] != config_hash(config):
        raise ArmkvError(
            f"checkpoint {path} was written with another training config ({_config_diff(meta['config'], config)})"
        )

    rng: dict[int, tuple[dict[str, torch.Tensor], dict]] = {}
    for rank, scalars in meta["rng"].items():
        prefix = f"rng.{rank}."
        rng[int(rank)] = ({k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}, scalars)
    return Checkpoint(
        path=path,
        step=int(meta["step"]),
        params={k[len("param.") :]: v for k, v in tensors.items() if k.startswith("param.")},
        optimizer=_optimizer_from_tensors(tensors, meta["optimizer"]),
        scheduler=meta["scheduler"],
        data=meta["data"],
        rng=rng,
        config=meta["config"],
        extra=meta["extra"],
    )
