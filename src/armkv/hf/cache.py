"""``ArmkvCache``: a transformers ``Cache`` whose layers are armkv cache-method layers."""

from __future__ import annotations

import warnings
from typing import Callable

import torch

from armkv.errors import ArmkvError
from armkv.hf.attention import ACTIVE, COMPILED
from armkv.hf.compat import Cache, cache_arg
from armkv.methods.base import CacheLayer


class ArmkvCache(Cache):
    """One :class:`~armkv.methods.base.CacheLayer` per attention layer, built by ``make_layer``.

    ``update`` stores nothing itself: it marks the layer active and returns the new key and
    value unchanged; the ``armkv`` attention function then lets the layer attend and commit
    (see :mod:`armkv.hf.attention`). Build it with :func:`armkv.hf.make_cache`.
    """

    def __init__(
        self,
        make_layer: Callable[[int], CacheLayer],
        num_layers: int,
        method: str,
        budget: int | None,
        compile_options: dict | None = None,
    ):
        self.make_layer = make_layer
        self.num_layers = num_layers
        self.method = method
        self.budget = budget
        # torch.compile's arguments for the compiled decode forward (:meth:`forward`), None: eager
        self.compile_options = compile_options
        self._in_forward = False  # inside :meth:`forward` (its eager fallback is on purpose)
        self._warned_eager = False
        super().__init__(layers=[make_layer(i) for i in range(num_layers)])

    def forward(self, model: torch.nn.Module, input_ids: torch.Tensor, attention_mask=None, **kwargs):
        """``model(input_ids, past_key_values=self, ...)``, a decode step (one token a row)
        through a compiled forward of the whole model where the cache was made with ``compile``
        and every layer is ready for it (its state allocated by a prefill); anything else eager.

        The compiled forward is transformers' own (``model.get_compiled_call``, the one its
        ``generate`` uses with a ``StaticCache``), with ``fullgraph=True`` and static shapes:
        every layer's :meth:`~armkv.methods.base.CacheLayer.decode_step` runs inside the
        graph over state tensors that stay where they were allocated (marked static by the
        layers, ``CacheLayer.state_tensors``, so that
        ``mode="reduce-overhead"`` replays the step as one CUDA graph), and each layer's
        Python work of the step (its count, ARM's write every ``sync`` tokens) runs after the
        graph, eagerly (``finish_decode_step``). ``attention_mask`` may be the whole [B, past
        + 1] mask: the step takes its last column (the validity of the new tokens, all the
        cache reads of it), so that its shape does not change from step to step."""
        if not self._compiled_step_ready(input_ids):
            self._in_forward = True
            try:
                return model(input_ids, attention_mask=attention_mask, **cache_arg(self), **kwargs)
            finally:
                self._in_forward = False
        from transformers import CompileConfig

        if attention_mask is not None:
            attention_mask = attention_mask[:, -input_ids.shape[1] :].contiguous()
        for layer in self.layers:
            layer.in_graph = True
        try:
            step = model.get_compiled_call(CompileConfig(fullgraph=True, dynamic=False, **self.compile_options))
            out = step(input_ids, attention_mask=attention_mask, **cache_arg(self), **kwargs)
        finally:
            for layer in self.layers:
                layer.in_graph = False
        for layer in self.layers:
            layer.finish_decode_step()
        return out

    def _compiled_step_ready(self, input_ids: torch.Tensor) -> bool:
        return (
            self.compile_options is not None
            and input_ids.shape[1] == 1
            and not torch.is_grad_enabled()
            and all(layer.decode_ready() for layer in self.layers)
        )

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        cache_kwargs: dict | None = None,
        *,
        kwargs: dict | None = None,
    ):
        """Called by each attention layer before its attention function: as
        ``update(key, value, layer_idx)`` up to transformers 5.23, ``update(key, value,
        layer_idx, kwargs=the layer's kwargs)`` from 5.24. Both are ignored: the layer's
        positions reach :func:`~armkv.hf.attention.armkv_attention` as ``position_ids``."""
        if torch.compiler.is_compiling():  # (a compiled forward: torch.compile cannot trace the context variable)
            COMPILED.active = (self, layer_idx)
            return key_states, value_states
        if ACTIVE.get() is not None:
            # The previous layer's update was never consumed: the attention that ran was not ours.
            ACTIVE.set(None)
            raise ArmkvError("an ArmkvCache needs the model attached: call armkv.hf.attach(model) first")
        if (
            self.compile_options is not None
            and key_states.shape[-2] == 1
            and not self._in_forward
            and not self._warned_eager
            and not torch.is_grad_enabled()
        ):
            self._warned_eager = True
            warnings.warn(
                "this cache was made with compile=True, but a decode step reached it through model(...) or "
                "model.generate, which run it eagerly: call cache.forward(model, input_ids, ...) for the "
                "compiled step (armkv's Runner and --compile do)",
                stacklevel=2,
            )
        ACTIVE.set((self, layer_idx))
        return key_states, value_states

    # transformers asks these to size masks and positions. Our mask is the [B, T] validity of
    # the new tokens only, so kv_length is the query length and the offset is what was seen.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].seen

    # In a compiled forward the offsets, which change every step, are not read (0): the armkv
    # mask function keeps only the new tokens' validity, and the layers count their tokens
    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0 if torch.compiler.is_compiling() else self.layers[layer_idx].seen

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return query_length, 0 if torch.compiler.is_compiling() else self.layers[layer_idx].seen

    def get_max_length(self, layer_idx: int | None = None) -> int:
        """-1: any sequence length fits (bounded methods drop or merge; the others grow)."""
        return -1

    def reset(self) -> None:
        """Back to an empty cache of the same method (fresh layers, peak cleared)."""
        self.layers = [self.make_layer(i) for i in range(self.num_layers)]

    def state_bytes(self) -> int:
        """Bytes the cache holds now, all layers."""
        return sum(layer.state_bytes() for layer in self.layers)

    def peak_bytes(self) -> int:
        """Largest size seen per layer, summed over layers."""
        return sum(layer.peak_bytes for layer in self.layers)

    def reset_peak(self) -> None:
        for layer in self.layers:
            layer.peak_bytes = layer.state_bytes()

    @property
    def is_compileable(self) -> bool:
        """False: transformers' ``generate`` would compile the forward without the work its
        layers do between steps (ARM's write); a cache made with ``compile`` compiles its
        decode steps itself (:meth:`forward`, what :class:`~armkv.hf.runner.Runner` calls)."""
        return False

    @property
    def is_initialized(self) -> bool:
        return any(layer.seen for layer in self.layers)

    @property
    def is_croppable(self) -> bool:
        return False

    def _unsupported(self, what: str):
        raise ArmkvError(f"ArmkvCache does not support {what} (greedy and sampled decoding only)")

    def reorder_cache(self, beam_idx: torch.LongTensor):
        self._unsupported("beam search")

    def crop(self, tokens_to_remove: int) -> None:
        self._unsupported("cropping (assisted decoding)")

    def batch_repeat_interleave(self, repeats: int):
        if self.is_initialized and repeats != 1:
            self._unsupported("expanding a filled cache")

    def batch_select_indices(self, indices: torch.Tensor):
        self._unsupported("selecting batch rows")
