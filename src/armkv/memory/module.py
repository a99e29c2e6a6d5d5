"""The ARM parameters of a model: one ``ARMMemory`` per attention layer, and their
save/load as an adapter folder (config JSON + safetensors, in the spirit of PEFT)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from torch import nn

from armkv.config import ARMConfig
from armkv.errors import ArmkvError
from armkv.memory.checks import check_tensor
from armkv.memory.policy import TopMPolicy
from armkv.memory.route import Router
from armkv.memory.state import MemoryState
from armkv.memory.write import WriteParams, WriteRule, write_chunk

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


class ARMMemory(nn.Module):
    """One attention layer's ARM parameters: router, slot scorer and gate, top-M policy.

    Parameters
    ----------
    config : ARMConfig
    num_kv_heads, head_dim : of the attention layer it serves
    """

    def __init__(self, config: ARMConfig, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.config = config
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.router = Router(num_kv_heads, head_dim, config.depth, config.branching)
        self.writes = WriteParams(head_dim, config.scorer, config.gate, config.merge_threshold)
        self.policy = (
            TopMPolicy(num_kv_heads * head_dim, config.policy_hidden, config.max_m)
            if config.top_m == "adaptive"
            else None
        )

    def init_state(
        self, batch: int, dtype: torch.dtype, device: torch.device | str, config: ARMConfig | None = None
    ) -> MemoryState:
        """An empty state; ``config`` is the run-time config (slots, pool) if not the adapter's."""
        c = config or self.config
        return MemoryState.empty(
            batch * self.num_kv_heads, c.pool_slots, self.head_dim, dtype, device, c.slots_per_bucket
        )

    def write(
        self,
        state: MemoryState,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        valid: torch.Tensor,
        generator: torch.Generator | None = None,
        rule: WriteRule | None = None,
        inplace: bool = False,
    ) -> MemoryState:
        """Write a chunk of tokens into the memory (chunked scan; one token = decode step).

        keys : [B, H, N, d] pre-RoPE; values : [B, H, N, d]; positions : [B, N]; valid : [B, N]
        rule : the run-time write rule (write kind, pool, merging) if not the adapter config's
        inplace : (inference) write into ``state.key`` and ``state.value`` themselves, a state
            the caller gives up, instead of copying the pool
        """
        check_tensor("keys", keys, ndim=4, last=self.head_dim)
        check_tensor("values", values, ndim=4, last=self.head_dim)
        B, H, N, d = keys.shape
        if keys.shape != values.shape or H != self.num_kv_heads:
            raise ArmkvError(
                f"keys {tuple(keys.shape)} and values {tuple(values.shape)} must both be [B, {self.num_kv_heads}, N, "
                f"{d}]"
            )
        if valid.shape != (B, N) or positions.shape != (B, N):
            raise ArmkvError(
                f"valid and positions must be [{B}, {N}], got {tuple(valid.shape)}, {tuple(positions.shape)}"
            )
        rule = rule or WriteRule.from_config(self.config)
        bucket = self.router.route_writes(keys).reshape(B * H, N)
        flat = lambda x: x.reshape(B * H, N, d)  # noqa: E731
        expand = lambda x: x.unsqueeze(1).expand(B, H, N).reshape(B * H, N)  # noqa: E731
        return write_chunk(
            state,
            flat(keys),
            flat(values),
            expand(positions.float()),
            expand(valid.bool()),
            bucket,
            self.writes,
            rule,
            training=self.training,
            generator=generator,
            inplace=inplace,
        )

    def route_queries(self, queries: torch.Tensor, m: int) -> torch.Tensor:
        """Top-m buckets of each query under its KV head's tree.

        queries : [B, Hq, T, d] pre-RoPE -> [B, Hq, T, m'] bucket ids, best first
        """
        check_tensor("queries", queries, ndim=4, last=self.head_dim)
        B, Hq, T, d = queries.shape
        rep = Hq // self.num_kv_heads
        grouped = queries.reshape(B, self.num_kv_heads, rep * T, d)
        buckets, _ = self.router.topm_buckets(grouped, m, read=True)
        return buckets.reshape(B, Hq, T, -1)


class ARMModel(nn.Module):
    """The ARM parameters of a whole model: ``layers[i]`` serves attention layer i.

    ``model_info`` records the shape of the model it was made for (layers, KV heads,
    head size) so an adapter for another model is refused.
    """

    def __init__(self, config: ARMConfig, num_layers: int, num_kv_heads: int, head_dim: int, model_name: str = ""):
        super().__init__()
        self.config = config
        self.model_info = {
            "num_layers": num_layers,
            "num_kv_heads": num_kv_heads,
            "head_dim": head_dim,
            "model_name": model_name,
        }
        self.layers = nn.ModuleList(ARMMemory(config, num_kv_heads, head_dim) for _ in range(num_layers))

    def check_fits(self, num_layers: int, num_kv_heads: int, head_dim: int, where: str = "") -> None:
        mine = (self.model_info["num_layers"], self.model_info["num_kv_heads"], self.model_info["head_dim"])
        theirs = (num_layers, num_kv_heads, head_dim)
        if mine != theirs:
            raise ArmkvError(
                f"adapter{(' ' + where) if where else ''} was made for a model with {mine[0]} layers, {mine[1]} KV "
                "heads "
                f"and head size {mine[2]}, but this model has {theirs[0]}, {theirs[1]} and {theirs[2]}: "
                "use an adapter made for this model (armkv calibrate / armkv train)"
            )

    def save(self, directory: str | os.PathLike, dtype: torch.dtype | None = None, extra: dict | None = None) -> Path:
        """Write ``adapter_config.json`` and ``adapter_model.safetensors`` atomically."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {
            k: (v.detach().to(dtype) if dtype is not None else v.detach()).contiguous().cpu()
            for k, v in self.state_dict().items()
        }
        meta = {"format": "armkv-adapter", "version": 1, "arm_config": self.config.to_dict(), "model": self.model_info}
        if extra:
            meta["extra"] = extra
        _atomic_write(
            directory / ADAPTER_WEIGHTS, lambda path: save_file(tensors, str(path), metadata={"format": "pt"})
        )
        _atomic_write(directory / ADAPTER_CONFIG, lambda path: Path(path).write_text(json.dumps(meta, indent=2)))
        return directory

    @classmethod
    def load(cls, directory: str | os.PathLike, dtype: torch.dtype = torch.float32) -> "ARMModel":
        """Read an adapter folder; a missing, foreign or corrupt one is a one-line ArmkvError."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        directory = Path(directory)
        cfg_path, weights_path = directory / ADAPTER_CONFIG, directory / ADAPTER_WEIGHTS
        if not cfg_path.is_file() or not weights_path.is_file():
            raise ArmkvError(f"{directory} is not an armkv adapter: it needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")
        try:
            meta = json.loads(cfg_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ArmkvError(f"{cfg_path} is corrupt ({e.__class__.__name__}): re-create the adapter") from None
        if not isinstance(meta, dict) or meta.get("format") != "armkv-adapter":
            raise ArmkvError(f"{cfg_path} is not an armkv adapter config (no 'format': 'armkv-adapter')")
        config = ARMConfig.from_dict(meta["arm_config"])
        info = meta["model"]
        arm = cls(config, info["num_layers"], info["num_kv_heads"], info["head_dim"], info.get("model_name", ""))
        try:
            tensors = load_file(str(weights_path))
        except (SafetensorError, OSError, ValueError) as e:
            raise ArmkvError(f"{weights_path} is corrupt or not safetensors ({e}): re-create the adapter") from None
        missing = set(arm.state_dict()) - set(tensors)
        unexpected = set(tensors) - set(arm.state_dict())
        if missing or unexpected:
            raise ArmkvError(
                f"{weights_path} does not match its config ({len(missing)} tensors missing, {len(unexpected)} "
                "unexpected)"
            )
        bad = sorted(k for k, v in tensors.items() if v.is_floating_point() and not bool(torch.isfinite(v).all()))
        if bad:
            raise ArmkvError(
                f"{weights_path} holds NaN or infinite values ({len(bad)} tensors, e.g. {bad[0]}): re-create the "
                "adapter (a training run that diverged saves such parameters)"
            )
        arm.load_state_dict({k: v.to(dtype) for k, v in tensors.items()})
        return arm


def _atomic_write(path: Path, write) -> None:
    """Write to a temporary file in the same folder, then rename: never a half-written file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it private; an adapter is meant to be shared
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
