"""Tensors laid out in storage someone else owns: one flat byte tensor carved into views.

A serving engine that allocates each request's memory itself (vLLM's blocks: ``armkv.vllm``)
hands a cache layer one flat ``uint8`` tensor; the layer asks for its tensors by a layout,
``{name: (shape, dtype)}``, and gets views of that storage, each starting on an
``ALIGN``-byte boundary, in the layout's order. :func:`layout_bytes` is the storage a layout
needs, so the same layout sizes the engine's block and then lays the state out in it.
"""

from __future__ import annotations

import math

import torch

ALIGN = 16  # bytes: every view starts at a multiple of this offset (any dtype may be viewed there)

Layout = dict[str, tuple[tuple[int, ...], torch.dtype]]


def _align(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def nbytes_of(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def layout_bytes(layout: Layout) -> int:
    """Bytes of storage that :func:`carve` needs for ``layout`` (alignment included)."""
    offset = 0
    for shape, dtype in layout.values():
        offset = _align(offset) + nbytes_of(shape, dtype)
    return _align(offset)


def carve(storage: torch.Tensor, layout: Layout) -> dict[str, torch.Tensor]:
    """Views of ``storage`` (a flat, contiguous uint8 tensor of at least
    :func:`layout_bytes` bytes), one per entry of ``layout``, in its order. The views share
    the storage's memory: writing them writes it. Their contents are whatever it held."""
    if storage.dtype != torch.uint8 or storage.dim() != 1 or not storage.is_contiguous():
        raise ValueError(f"storage must be a flat contiguous uint8 tensor, not {storage.dtype} {tuple(storage.shape)}")
    need = layout_bytes(layout)
    if storage.numel() < need:
        raise ValueError(f"storage of {storage.numel()} bytes is too small for this layout ({need} bytes)")
    if storage.data_ptr() % ALIGN:
        raise ValueError(f"storage must start on a {ALIGN}-byte boundary")
    views, offset = {}, 0
    for name, (shape, dtype) in layout.items():
        offset = _align(offset)
        n = nbytes_of(shape, dtype)
        views[name] = storage[offset : offset + n].view(dtype).view(shape)
        offset += n
    return views


def within(tensor: torch.Tensor, storage: torch.Tensor) -> bool:
    """Whether every byte ``tensor`` may address lies inside ``storage``'s bytes."""
    if tensor.numel() == 0:
        return storage.data_ptr() <= tensor.data_ptr() <= storage.data_ptr() + storage.nbytes
    lo = tensor.data_ptr()
    span = sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride())) + 1
    hi = lo + span * tensor.element_size()
    return storage.data_ptr() <= lo and hi <= storage.data_ptr() + storage.nbytes


__all__ = ["ALIGN", "Layout", "carve", "layout_bytes", "nbytes_of", "within"]
