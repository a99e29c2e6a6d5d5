"""Method options as the command line gives them, ``--option METHOD.KEY=VALUE`` (the evals and
``armkv bench decode`` read them alike). No torch, no tool imports."""

from __future__ import annotations

import json
from typing import Iterable

from armkv.errors import ArmkvError


def parse_options(pairs: Iterable[str] | None) -> dict[str, dict]:
    """``["arm.adapter=run/x", "kivi.bits=2"]`` -> ``{"arm": {"adapter": "run/x"}, "kivi": {"bits": 2}}``.

    Values are read as JSON where they parse (numbers, booleans), else kept as text.
    """
    options: dict[str, dict] = {}
    for pair in pairs or ():
        name, sep, value = pair.partition("=")
        method, dot, key = name.strip().partition(".")
        if not sep or not dot or not method or not key:
            raise ArmkvError(f"--option {pair!r}: expected METHOD.KEY=VALUE, e.g. arm.adapter=PATH")
        options.setdefault(method, {})[key] = option_value(value)
    return options


def option_value(text: str):
    """An option's value: JSON where it parses (numbers, booleans), else the text itself."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


ADAPTER_METHODS = ("arm", "fifo")  # the methods that take an adapter (``--adapter``)


def with_adapter(options: dict[str, dict], adapter: str | None, methods: Iterable[str]) -> dict[str, dict]:
    """``options`` with ``--adapter`` given to each of ``methods`` that takes one (arm, fifo),
    as ``--option METHOD.adapter=`` would give it; the two together are an error."""
    if adapter is None:
        return options
    options = {name: dict(opts) for name, opts in options.items()}
    for method in methods:
        if method in ADAPTER_METHODS:
            if "adapter" in options.get(method, {}):
                raise ArmkvError(f"give the adapter once: --adapter or --option {method}.adapter=, not both")
            options.setdefault(method, {})["adapter"] = adapter
    return options


def options_for(method: str, pairs: Iterable[str] | None, adapter: str | None = None) -> dict:
    """The options of a tool that runs one ``method``: its ``--option METHOD.KEY=VALUE`` (another
    method's is an error) and ``--adapter``."""
    options = parse_options(pairs)
    other = sorted(set(options) - {method})
    if other:
        key = next(iter(options[other[0]]))
        raise ArmkvError(f"--option {other[0]}.{key}=...: this run's method is {method!r}, not {other[0]!r}")
    options = with_adapter(options, adapter, [method] if method in ADAPTER_METHODS else [])
    if adapter is not None and method not in ADAPTER_METHODS:
        raise ArmkvError(f"--adapter applies to the {' and '.join(ADAPTER_METHODS)} methods, not {method!r}")
    return dict(options.get(method, {}))
