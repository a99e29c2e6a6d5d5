"""Errors that mean "the input is wrong": tools print them as one line and exit non-zero."""

from __future__ import annotations

import sys
from pathlib import Path


class ArmkvError(ValueError):
    """Bad input (config, adapter, checkpoint, prompt, method name). The message says what to change."""


def read_text(path: str | Path, what: str) -> str:
    """A user's text file as a string, or an ArmkvError that names it and says what is wrong
    (missing, a folder, not UTF-8). ``what`` names where the path came from, e.g. "--input".
    ``-`` reads standard input. A UTF-8 byte-order mark is dropped."""
    if str(path) == "-":
        data, name = sys.stdin.buffer.read(), "<stdin>"
    else:
        path = Path(path)
        if not path.exists():
            raise ArmkvError(f"{what} {path}: no such file")
        if not path.is_file():
            raise ArmkvError(f"{what} {path}: not a file")
        data, name = path.read_bytes(), str(path)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ArmkvError(
            f"{what} {name}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); save it as UTF-8"
        ) from None
    return text.replace("\r\n", "\n").replace("\r", "\n")  # newlines as Path.read_text reads them
