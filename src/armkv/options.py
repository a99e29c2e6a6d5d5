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
