"""armkv: ARM, a fixed-size tree-routed KV memory, and the tools to compare it.

The core (``armkv.memory``, ``armkv.config``) is plain PyTorch. The transformers
boundary lives in ``armkv.hf``; training, evaluation and benchmarks are tools
around the library and are imported only when used.
"""

from armkv.config import ARMConfig

__all__ = ["ARMConfig"]
__version__ = "0.1.0"
