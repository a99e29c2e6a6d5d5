"""``swa`` (sliding window) and ``sink`` (StreamingLLM: attention sinks + sliding window).

Both keep exact tokens in an :class:`~armkv.methods.buffers.ExactBuffer` and drop what
leaves the window. Keys keep the RoPE positions they were written at (StreamingLLM
re-positions them inside the cache; here the window never exceeds the model's positions
because the prompt itself may not).
"""

from __future__ import annotations

import torch

from armkv.memory.rope import Rotary
from armkv.methods.attention import joint_attention
from armkv.methods.base import CacheLayer, ModelInfo, register_method, reject_options, require_budget
from armkv.methods.buffers import ExactBuffer


class WindowLayer(CacheLayer):
    """``sinks`` first valid tokens and the ``window`` last ones, per batch row.

    Its decode step (one token: read the buffer, push the token into the window's ring) has
    static shapes and no host sync, so it compiles whole (``CacheLayer.compile_decode``).
    """

    static_decode = True

    def __init__(self, layer_idx: int, info: ModelInfo, rotary: Rotary | None, chunk: int, sinks: int, window: int):
        super().__init__(layer_idx, info, rotary)
        self.chunk = chunk
        self.sinks, self.window = sinks, window
        self.buffer: ExactBuffer | None = None  # allocated at the first chunk, once the batch size is known

    def attend_chunk(self, query, key, value, valid, positions, scaling):
        if self.buffer is None:
            self.buffer = ExactBuffer(
                self.sinks, self.window, key.shape[0], key.shape[1], key.shape[3], key.dtype, key.device
            )
        state_k, state_v, state_valid, _ = self.buffer.kv()
        out = joint_attention(query, key, value, valid, scaling, state_k, state_v, state_valid, state_clean=True)
        self.buffer.push(key, value, valid, positions)
        return out

    def decode_ready(self) -> bool:
        return self.buffer is not None

    def state_bytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.state_bytes()

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {} if self.buffer is None else self.buffer.tensors()


def held_window(window: int, sinks: int, horizon: int | None) -> int:
    """The window a layer allocates: ``window``, or, where the caller knows the tokens the
    cache will see (``horizon``: prompt + new tokens) and they are fewer, just what holds all
    of them past the sinks. A window that never fills keeps the same tokens at any size, so
    the result is the same and a large budget costs nothing it does not use."""
    return window if horizon is None else max(1, min(window, horizon - sinks))


@register_method("swa", "sliding window of the last `budget` tokens")
def make_swa(
    layer_idx: int,
    info: ModelInfo,
    rotary: Rotary | None,
    budget: int | None,
    chunk: int,
    horizon: int | None = None,
    **options,
):
    reject_options("swa", options)
    window = require_budget("swa", budget, 1, "the window holds budget tokens")
    return WindowLayer(layer_idx, info, rotary, chunk, sinks=0, window=held_window(window, 0, horizon))


@register_method("sink", "StreamingLLM: 4 attention sinks + a window of budget - 4 tokens")
def make_sink(
    layer_idx: int,
    info: ModelInfo,
    rotary: Rotary | None,
    budget: int | None,
    chunk: int,
    sinks: int = 4,
    horizon: int | None = None,
    **options,
):
    reject_options("sink", options)
    budget = require_budget("sink", budget, sinks + 1, f"{sinks} sinks + a window of at least 1")
    return WindowLayer(layer_idx, info, rotary, chunk, sinks=sinks, window=held_window(budget - sinks, sinks, horizon))
