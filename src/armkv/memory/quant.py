"""Low-bit storage shared by the cache methods: bit packing (KIVI's codes), symmetric
absmax quantisation, the int4 nibble layout (ARM's slots) and the orthogonal mixing that
spreads a vector's outlier channels before it is quantised."""

from __future__ import annotations

import functools
import math

import torch


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., d] of ``bits`` bits -> [..., d * bits / 8] bytes."""
    per_byte = 8 // bits
    grouped = codes.reshape(*codes.shape[:-1], -1, per_byte).to(torch.int32)
    shifts = torch.arange(per_byte, device=codes.device, dtype=torch.int32) * bits
    return (grouped << shifts).sum(-1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: [..., d * bits / 8] -> uint8 codes [..., d]."""
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, device=packed.device, dtype=torch.int32) * bits
    codes = (packed.to(torch.int32)[..., None] >> shifts) & (2**bits - 1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * per_byte).to(torch.uint8)


def quantise_symmetric(
    x: torch.Tensor, bits: int, groups: int = 1, scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] -> (codes int8 [..., d] in [-q, q], scale [..., groups] of ``scale_dtype``)
    with q = 2 ** (bits - 1) - 1 and x ~ codes * scale (absmax / q per group of d / groups
    channels, rounded to ``scale_dtype`` before the codes are taken, so that the codes fit
    the stored scale). Quantising the dequantised values again gives the same codes."""
    x = x.to(torch.float32)
    q = 2 ** (bits - 1) - 1
    xs = x.reshape(*x.shape[:-1], groups, x.shape[-1] // groups)
    scale = (xs.abs().amax(-1) / q).to(scale_dtype)
    codes = torch.round(xs / scale.float().clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)).clamp(-q, q)
    return codes.reshape(x.shape).to(torch.int8), scale


def dequantise_symmetric(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantise_symmetric` (fp32)."""
    groups = scale.shape[-1]
    xs = codes.to(torch.float32).reshape(*codes.shape[:-1], groups, codes.shape[-1] // groups)
    return (xs * scale.float().unsqueeze(-1)).reshape(codes.shape)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes in [-8, 7] [..., d] -> [..., d / 2] bytes (uint8): channel i in the low
    nibble and channel i + d / 2 in the high nibble of byte i, both two's complement, so that
    :func:`unpack_int4` is three integer ops (the decode step reads every slot's value)."""
    half = codes.shape[-1] // 2
    codes = codes.to(torch.int8)
    return ((codes[..., :half] & 15) | (codes[..., half:] << 4)).view(torch.uint8)


def int4_halves(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two nibble halves of :func:`pack_int4`'s bytes as int8 codes: channels [0, d / 2)
    and [d / 2, d) (arithmetic shifts sign-extend)."""
    signed = packed.view(torch.int8)
    return (signed << 4) >> 4, signed >> 4


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: int8 codes [..., d]."""
    return torch.cat(int4_halves(packed), -1)


@functools.lru_cache(maxsize=64)  # one copy per (size, dtype, device): no host-to-device copy per read
def mixing_matrix(d: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """An orthogonal d x d matrix Q (Q Q^T = I) that spreads every channel over all d:
    the normalised Hadamard matrix where d is a power of two, else a fixed (seeded) random
    orthogonal matrix. A vector x is stored as quantise(x Q) and read as dequantise(.) Q^T.

    Why (QuaRot's and QuIP's incoherence processing): keys and values have a few channels
    far larger than the rest, and an absmax scale spent on them leaves the others a few
    codes. Mixed, the channels are alike and the same bits hold more of the vector; dot
    products are unchanged, (q Q).(k Q) = q.k, so a reader may mix the query instead of
    unmixing every key."""
    # built outside inference mode: the cached copy is shared by reads under
    # torch.inference_mode and by training writes that autograd records
    with torch.inference_mode(False):
        return _mixing_matrix(d).to(device=device, dtype=dtype)


def _mixing_matrix(d: int) -> torch.Tensor:
    if d & (d - 1) == 0:
        q = torch.ones(1, 1, dtype=torch.float64)
        while q.shape[0] < d:  # Sylvester's construction
            q = torch.cat([torch.cat([q, q], 1), torch.cat([q, -q], 1)], 0)
        q = q / math.sqrt(d)
    else:  # no Hadamard matrix of this order: a fixed random orthogonal one does the same job
        g = torch.Generator().manual_seed(0)
        q, r = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
        q = q * torch.sign(torch.diagonal(r))
    return q


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """x in float32 where its dtype is narrower (bfloat16, float16), else x itself: where a
    read's logits are softmaxed and its weights summed."""
    return x.float() if x.dtype in (torch.bfloat16, torch.float16) else x
