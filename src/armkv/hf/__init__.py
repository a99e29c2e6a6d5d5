"""The transformers boundary: the ``armkv`` attention, ``ArmkvCache``, attach/detach, the
default model and the generation engine used by every tool."""

from armkv.hf.attach import attach, attached, detach, is_attached, make_cache, model_info, model_rotary
from armkv.hf.cache import ArmkvCache
from armkv.hf.compat import cache_arg

__all__ = [
    "ArmkvCache",
    "attach",
    "attached",
    "cache_arg",
    "detach",
    "is_attached",
    "make_cache",
    "model_info",
    "model_rotary",
]
