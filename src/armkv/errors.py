"""Errors that mean "the input is wrong": tools print them as one line and exit non-zero."""

from __future__ import annotations

from pathlib import Path


class ArmkvError(ValueError):
    """Bad input (config, adapter, checkpoint, prompt, method name). The message says what to change."""


def read_text(path: str | Path, what: str) -> str:
    """A user's text file as a string, or an ArmkvError that names it and says what is wrong
    (missing, a folder, not UTF-8). ``what`` names where the path came from, e.g. "--input"."""
    path = Path(path)
    if not path.exists():
        raise ArmkvError(f"{what} {path}: no such file")
    if not path.is_file():
        raise ArmkvError(f"{what} {path}: not a file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ArmkvError(
            f"{what} {path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); save it as UTF-8"
        ) from None
