"""The plugin's one setting: ``ARMKV_VLLM``, a JSON object.

Keys (all optional but ``method``), as ``armkv generate`` takes them:

- ``method``: ``arm``, ``fifo`` or ``full`` (``full``: every token kept, through the plugin's
  path: the reference the others are checked against)
- ``budget``: token-equivalents of KV memory per layer and request (bounded methods; default
  ``armkv generate``'s)
- ``adapter``: arm and fifo: ``calibrated``, ``random`` or an adapter folder
- ``chunk``: P, the prefill chunk (the sync point of the budgeted chunked prefill; 256): vLLM
  schedules prompts in whole chunks, so a step's token budget (``--max-num-batched-tokens``)
  must hold one
- ``options``: method options, ``["arm.slot_format=int8", ...]`` as ``--option`` takes them

Example: ``ARMKV_VLLM='{"method": "arm", "budget": 1024, "options": ["arm.slot_format=int8"]}'``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from armkv.errors import ArmkvError

ENV = "ARMKV_VLLM"
METHODS = ("arm", "fifo", "full")
KEYS = ("method", "budget", "adapter", "chunk", "options")


@dataclass(frozen=True)
class Settings:
    """What every ARM layer of a served model runs with."""

    method: str = "arm"
    budget: int | None = None
    chunk: int = 256
    options: dict = field(default_factory=dict)  # the method's options (adapter included)

    def to_env(self) -> str:
        """The ``ARMKV_VLLM`` value that gives these settings."""
        options = {k: v for k, v in self.options.items() if k != "adapter"}
        data = {"method": self.method, "budget": self.budget, "chunk": self.chunk}
        if "adapter" in self.options:
            data["adapter"] = self.options["adapter"]
        data["options"] = [
            f"{self.method}.{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in options.items()
        ]
        return json.dumps(data)


def parse_settings(text: str) -> Settings:
    """Settings from the ``ARMKV_VLLM`` JSON; a one-line ArmkvError says what to change."""
    from armkv.options import options_for
    from armkv.tools.preflight import resolve_budget

    try:
        data = json.loads(text)
    except ValueError as e:
        raise ArmkvError(f'{ENV} is not JSON ({e}); e.g. {ENV}=\'{{"method": "arm", "budget": 1024}}\'') from None
    if not isinstance(data, dict):
        raise ArmkvError(f'{ENV} must be a JSON object, e.g. {{"method": "arm", "budget": 1024}}')
    unknown = sorted(set(data) - set(KEYS))
    if unknown:
        raise ArmkvError(f"{ENV}: unknown key(s) {', '.join(unknown)}; the keys: {', '.join(KEYS)}")
    method = data.get("method", "arm")
    if method not in METHODS:
        raise ArmkvError(f"{ENV}: method {method!r} does not serve in vLLM; choose one of {', '.join(METHODS)}")
    chunk = data.get("chunk", 256)
    if not isinstance(chunk, int) or chunk < 1:
        raise ArmkvError(f"{ENV}: chunk must be a positive integer, not {chunk!r}")
    budget = data.get("budget")
    if budget is not None and not isinstance(budget, int):
        raise ArmkvError(f"{ENV}: budget must be an integer (token-equivalents per layer), not {budget!r}")
    pairs = data.get("options") or []
    if not isinstance(pairs, list) or not all(isinstance(p, str) for p in pairs):
        raise ArmkvError(f'{ENV}: options must be a list of "METHOD.KEY=VALUE" strings')
    options = options_for(method, pairs, data.get("adapter"))
    return Settings(method=method, budget=resolve_budget(method, budget), chunk=chunk, options=options)


def settings_from_env() -> Settings | None:
    """The settings in ``ARMKV_VLLM``, None where it is unset or empty."""
    text = os.environ.get(ENV, "").strip()
    return parse_settings(text) if text else None
