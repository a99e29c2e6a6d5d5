"""Results a tool writes as JSONL, kept safe across reruns: the settings they were made
under, compared key by key before a rerun adds to them, and the records of a file read back
with a line cut short by an interrupted write dropped. ``armkv generate`` and the output
folders of ``armkv eval`` share this.
"""

from __future__ import annotations

import json
from pathlib import Path

from armkv.errors import ArmkvError


def compare_settings(old: dict, new: dict, where: str, remedy: str = "pass another --output to keep both") -> None:
    """Raise ArmkvError naming the first key (in sorted order) on which ``old`` and ``new`` differ:
    results made under other settings are never mixed with new ones."""
    old, new = json.loads(json.dumps(old)), json.loads(json.dumps(new))  # tuples and paths as JSON sees them
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            raise ArmkvError(f"{where} holds results for {key}={old.get(key)!r}, not {new.get(key)!r}: {remedy}")


def read_records(path: Path) -> list[dict]:
    """The JSON objects of a results file, one a line; a last line cut short (an interrupted
    write) is dropped, any other line that is not a JSON object is an error."""
    path = Path(path)
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise ArmkvError(
                f"{path}:{i + 1} is not JSON; remove the file (or that line) to produce it again"
            ) from None
        if not isinstance(record, dict):
            raise ArmkvError(f"{path}:{i + 1} is not a JSON object; remove the file (or that line) to produce it again")
        records.append(record)
    return records
