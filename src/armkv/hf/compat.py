"""The one place that knows which transformers versions armkv works with.

Tested with transformers 5.20 - 5.24. What armkv relies on there: the attention and mask
interfaces (``AttentionInterface`` / ``AttentionMaskInterface`` registration), attention
layers that call the cache's ``update(key, value, layer_idx)`` right before the attention
function and pass ``position_ids`` to it (they no longer get ``cache_position``), and
``Cache`` taking a ``layers`` list.

The one difference inside that range: up to 5.23 a model and ``generate`` take the cache as
``past_key_values``; from 5.24 as ``cache`` (the old name still works there, with a
FutureWarning), and the attention layers call ``cache.update(key, value, layer_idx,
kwargs=...)``. armkv passes the cache under :data:`CACHE_ARG` (``model(...,
**cache_arg(cache))``), so neither version warns.
"""

from __future__ import annotations

from armkv.errors import ArmkvError

SUPPORTED = ((5, 20), (5, 25))  # [low, high)


def _parse(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def check_transformers():
    """Import transformers and check its version; returns the module.

    Raises
    ------
    ArmkvError if transformers is missing or outside the tested range.
    """
    try:
        import transformers
    except ModuleNotFoundError:
        raise ArmkvError("needs the 'hf' extra (No module named 'transformers'): pip install 'armkv[hf]'") from None
    version = _parse(transformers.__version__)
    if not SUPPORTED[0] <= version < SUPPORTED[1]:
        low, high = (".".join(map(str, v)) for v in SUPPORTED)
        raise ArmkvError(
            f"armkv is tested with transformers >={low},<{high} but found {transformers.__version__}: "
            f'pip install "transformers>={low},<{high}"'
        )
    return transformers


transformers = check_transformers()
VERSION = _parse(transformers.__version__)
# the keyword a model's forward and ``generate`` take the cache under
CACHE_ARG = "cache" if VERSION >= (5, 24) else "past_key_values"


def cache_arg(cache) -> dict:
    """``{CACHE_ARG: cache}``: ``model(input_ids=..., **cache_arg(cache))`` on every supported
    version, without the deprecation warning of the other name."""
    return {CACHE_ARG: cache}


from transformers import AttentionInterface  # noqa: E402
from transformers.cache_utils import Cache  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: E402

__all__ = [
    "AttentionInterface",
    "AttentionMaskInterface",
    "CACHE_ARG",
    "Cache",
    "cache_arg",
    "check_transformers",
    "sdpa_attention_forward",
    "sdpa_mask",
    "transformers",
    "VERSION",
]
