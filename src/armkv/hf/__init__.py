"""The transformers boundary: the ``armkv`` attention, ``ArmkvCache``, attach/detach, the
default model and the generation engine used by every tool.

Where transformers is missing or of a version armkv does not support (vLLM's environment,
docs/serving.md), the package still imports, so that ``armkv.hf.runner.check_request`` and
``armkv.hf.model``'s paths serve there; the names below then raise that one-line error."""

from armkv.errors import ArmkvError

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

try:
    from armkv.hf.attach import attach, attached, detach, is_attached, make_cache, model_info, model_rotary
    from armkv.hf.cache import ArmkvCache
    from armkv.hf.compat import cache_arg
except ArmkvError as _why:
    _unavailable = _why

    def __getattr__(name: str):
        if name in __all__:
            raise _unavailable
        raise AttributeError(f"module 'armkv.hf' has no attribute {name!r}")
