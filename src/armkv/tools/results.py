"""Results a tool writes, kept safe across reruns: the settings they were made under,
compared key by key before a rerun adds to them. ``armkv generate`` (``tools/output.py``) and
the output folders of ``armkv eval`` share this.
"""

from __future__ import annotations

import json

from armkv.errors import ArmkvError


def compare_settings(old: dict, new: dict, where: str, remedy: str = "pass another --output to keep both") -> None:
    """Raise ArmkvError naming the first key (in sorted order) on which ``old`` and ``new`` differ:
    results made under other settings are never mixed with new ones."""
    old, new = json.loads(json.dumps(old)), json.loads(json.dumps(new))  # tuples and paths as JSON sees them
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            raise ArmkvError(f"{where} holds results for {key}={old.get(key)!r}, not {new.get(key)!r}: {remedy}")
