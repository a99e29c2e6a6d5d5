"""The contract every cache method implements, and the one registry of methods.

A method's layer owns one attention layer's state for a batch. The attention function
(``armkv.hf.attention``) hands it the new tokens' post-RoPE queries, keys and values; the
layer attends (over its state and the new tokens, causally) and then commits the new
tokens, bringing its state back to budget. It processes the new tokens in chunks of
``chunk`` tokens, so one forward over a long prompt is exactly the budgeted chunked
prefill (docs/design.md): each layer's state after chunk c depends only on chunks <= c.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import torch

from armkv.errors import ArmkvError
from armkv.memory.rope import Rotary


@dataclass(frozen=True)
class ModelInfo:
    """What a cache needs to know about the model it serves."""

    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int
    head_dim: int
    max_positions: int
    dtype: torch.dtype = torch.float32
    device: torch.device | str = "cpu"

    @property
    def dtype_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def token_bytes(self) -> int:
        """Bytes of one token's K and V in one layer, all KV heads."""
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def budget_bytes(self, budget_tokens: int) -> int:
        """Bytes of a budget in token-equivalents, per layer and sequence."""
        return budget_tokens * self.token_bytes()


class CacheLayer(ABC):
    """One attention layer's cache for one method and one batch."""

    def __init__(self, layer_idx: int, info: ModelInfo, rotary: Rotary | None):
        self.layer_idx = layer_idx
        self.info = info
        self.rotary = rotary
        self.seen = 0  # tokens (padding included) this layer has been given
        self.peak_bytes = 0
        self.compiled = False  # decoded through a compiled forward of the whole model (compile_decode)
        self.in_graph = False  # set while that forward runs: attend is the bare decode_step
        self._marked_static = False  # the state tensors are marked static (state_tensors)

    chunk: int = 256  # P: new tokens are processed in chunks of this many (the sync point)
    # whether decode_step keeps static shapes and makes no host sync, so compile_decode
    # applies (the bounded methods; full and offload grow with every token)
    static_decode: bool = False

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        valid: torch.Tensor,
        positions: torch.Tensor,
        scaling: float,
    ) -> torch.Tensor:
        """Attend over the state and the new tokens (causally), then commit them, chunk by chunk.

        Parameters
        ----------
        query : [B, Hq, T, d] post-RoPE queries of the new tokens
        key, value : [B, Hkv, T, d] post-RoPE keys and values of the new tokens
        valid : [B, T] bool, False for padding (never attended, never stored)
        positions : [B, T] long, the RoPE positions of the new tokens
        scaling : softmax scale (usually d ** -0.5)

        Returns
        -------
        [B, T, Hq, d] attention output (transformers' layout after attention)
        """
        if self.in_graph:  # (a compiled forward: its caller does the step's Python work, finish_decode_step)
            return self.decode_step(query, key, value, valid, positions, scaling)
        outputs = []
        for start in range(0, query.shape[2], self.chunk):
            end = start + self.chunk
            outputs.append(
                self.attend_chunk(
                    query[:, :, start:end],
                    key[:, :, start:end],
                    value[:, :, start:end],
                    valid[:, start:end],
                    positions[:, start:end],
                    scaling,
                )
            )
            self.seen += outputs[-1].shape[1]
            self.note_peak()
        if self.compiled and not self._marked_static:  # (the state is allocated by the first chunk)
            self._marked_static = True
            for tensor in self.state_tensors().values():
                torch._dynamo.mark_static_address(tensor)
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)

    @abstractmethod
    def attend_chunk(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        valid: torch.Tensor,
        positions: torch.Tensor,
        scaling: float,
    ) -> torch.Tensor:
        """:meth:`attend` for at most ``chunk`` new tokens: same shapes, same contract."""

    def peek_chunk(self, query, key, value, valid, positions, scaling) -> torch.Tensor:
        """:meth:`attend_chunk`'s output without committing the tokens (the state unchanged):
        how a serving engine reads the first part of a chunk it schedules in pieces. The
        methods that serve in ``armkv.vllm`` implement it (arm, fifo, full)."""
        raise ArmkvError(f"{type(self).__name__} cannot read part of a chunk without committing it")

    # ------------------------------------------------------------------ compiled decoding
    def decode_step(self, query, key, value, valid, positions, scaling) -> torch.Tensor:
        """:meth:`attend_chunk` for one token (T = 1), what a compiled forward of the model runs
        in each layer (``ArmkvCache.forward``): in a method with ``static_decode`` it keeps its
        state in tensors allocated once and updated in place, allocates nothing whose shape
        depends on the sequence, makes no host synchronisation and reads no Python state that
        changes from step to step, so one graph serves every step (and, on a GPU, one CUDA
        graph). The Python work of a step (``seen``, the peak, and ARM's write every ``sync``
        tokens) runs after the graph, eagerly, in :meth:`finish_decode_step`."""
        return self.attend_chunk(query, key, value, valid, positions, scaling)

    def decode_ready(self) -> bool:
        """Whether the state is allocated (the first chunk does it): until then a token takes
        the eager path."""
        return True

    def finish_decode_step(self) -> None:
        """After a compiled forward: what :meth:`attend` does beside the step (count the
        token, run :meth:`after_decode_step`, note the peak), eagerly."""
        self.seen += 1
        self.after_decode_step()
        self.note_peak()

    def after_decode_step(self) -> None:
        """Eager work after a compiled decode step, between two steps (see :meth:`decode_step`)."""

    def compile_decode(self) -> None:
        """Decode through a compiled forward of the whole model (``make_cache(compile=)``): the
        state is allocated for it (static shapes, fixed addresses) and :meth:`decode_step` runs
        in the graph. Raises for a method whose decode step grows with the sequence."""
        if not self.static_decode:
            raise ArmkvError(
                f"{type(self).__name__}'s decode step grows with the sequence and cannot be compiled: "
                "compile a bounded method (sink, swa, kivi with a budget, arm, fifo)"
            )
        self.compiled = True

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the state a compiled step reads or updates, by name (empty before the
        first chunk). With ``compiled`` they are marked static after the first chunk
        (``torch._dynamo.mark_static_address``, as transformers' ``StaticCache`` marks its
        tensors: a CUDA graph reads and writes them where they are), so a method keeps them
        where they were allocated."""
        return {}

    @abstractmethod
    def state_bytes(self) -> int:
        """Bytes this layer holds now (all state tensors, metadata included)."""

    def note_peak(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.state_bytes())


@dataclass
class Method:
    """A registered cache method: a factory of layers and a one-line description."""

    name: str
    make_layer: Callable[..., CacheLayer]  # (layer_idx, info, rotary, budget, chunk, **options) -> CacheLayer
    description: str
    bounded: bool = True  # False: memory grows with the sequence (full, offload, kivi without budget)

    @property
    def takes_horizon(self) -> bool:
        """Whether the factory plans by the tokens a cache will see (a ``horizon`` parameter)."""
        return "horizon" in inspect.signature(self.make_layer).parameters


METHODS: dict[str, Method] = {}


def require_budget(method: str, budget: int | None, minimum: int, why: str) -> int:
    """The budget of a bounded method, or a one-line error that says the smallest one that works."""
    if budget is None:
        raise ArmkvError(f"method {method!r} needs a budget: pass --budget N (token-equivalents, at least {minimum})")
    if budget < minimum:
        raise ArmkvError(
            f"budget {budget} is too small for method {method!r} ({why}): raise --budget to at least {minimum}"
        )
    return budget


def reject_options(method: str, options: dict) -> None:
    """Options a method does not take are an input error, not something to ignore silently."""
    if options:
        raise ArmkvError(f"method {method!r} takes no option {', '.join(sorted(options))}")


def register_method(name: str, description: str, bounded: bool = True):
    def wrap(make_layer):
        METHODS[name] = Method(name, make_layer, description, bounded)
        return make_layer

    return wrap


def get_method(name: str) -> Method:
    _load_builtin_methods()
    if name not in METHODS:
        raise ArmkvError(f"unknown method {name!r}; choose one of: {', '.join(sorted(METHODS))}")
    return METHODS[name]


def _load_builtin_methods() -> None:
    # Importing the modules registers them; kept lazy so that base stays import-light.
    import importlib

    for module in ("full", "window", "kivi", "offload", "arm"):
        try:
            importlib.import_module(f"armkv.methods.{module}")
        except ModuleNotFoundError as e:
            if e.name != f"armkv.methods.{module}":
                raise
