"""The transformers boundary: the ``armkv`` attention, ``ArmkvCache``, attach/detach, the
default model and the generation engine used by every tool.

The names below load transformers on first use, so that ``armkv.hf.runner.check_request`` and
``armkv.hf.model``'s paths also serve vLLM's environment, whose transformers armkv.hf does not
support (docs/serving.md)."""

import importlib

_EXPORTS = {
    "ArmkvCache": "armkv.hf.cache",
    "attach": "armkv.hf.attach",
    "attached": "armkv.hf.attach",
    "detach": "armkv.hf.attach",
    "is_attached": "armkv.hf.attach",
    "make_cache": "armkv.hf.attach",
    "model_info": "armkv.hf.attach",
    "model_rotary": "armkv.hf.attach",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'armkv.hf' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
