"""Where ``armkv generate`` writes its results, so that nothing is ever lost.

* standard output (``-``) and special files (a device such as ``/dev/null``, a FIFO): written
  to directly, never read back, replaced or renamed;
* a regular file ``OUTPUT``: locked for this run (``OUTPUT.lock`` beside it, so a second run
  into the same output is refused before its model loads), read strictly (a line that is
  not a result stops the run with its file and line; nothing is replaced), resumed (results
  whose request and settings are unchanged are kept; a changed request is answered again),
  written to ``OUTPUT.partial`` line by line and renamed over ``OUTPUT`` when the run ends.
  ``--overwrite`` replaces the output with exactly this run's results once the run has gone
  through its requests; an interrupted one leaves the output as it was (its own results
  stay in ``OUTPUT.partial``, resumed by the same command).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import sys
from pathlib import Path

from armkv.errors import ArmkvError
from armkv.tools.results import compare_settings

TOOL = "armkv generate"


class OutputClosed(Exception):
    """The reader of standard output went away (``| head``): no result can be written any more."""


def id_key(request_id) -> str:
    """A request id as a hashable, type-exact key (1 and "1" differ)."""
    return json.dumps(request_id, sort_keys=True)


REQUEST_FIELDS = ("id", "context", "question", "answer_prefix", "prompt")


def request_hash(request: dict, settings: dict) -> str:
    """The hash a result carries of what it answers: the request's text and the settings it was
    made under. A rerun keeps a result only where both are unchanged."""
    what = {"request": {k: request[k] for k in REQUEST_FIELDS if k in request}, "settings": settings}
    text = json.dumps(what, sort_keys=True, ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def dumps(record: dict) -> str:
    """One result as a line of strict JSON (no NaN or Infinity)."""
    return json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n"


def is_special(path: Path) -> bool:
    """Whether ``path`` is a device, a FIFO or a socket (after symlinks), or names a file
    descriptor (``/dev/stdout`` redirected to a file): written to, never replaced."""
    if str(path) in ("/dev/stdout", "/dev/stderr") or str(path).startswith(("/dev/fd/", "/proc/")):
        return True
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not stat.S_ISREG(mode) and not stat.S_ISDIR(mode)


def check_output_path(output: Path, input_path: str) -> None:
    """One-line errors for an output that is a folder, lies under a file, or is the input, or
    whose partial or lock file is the input (a run would write over its own requests)."""
    if output.is_dir():
        raise ArmkvError(f"--output {output} is a folder; name a file in it, e.g. {output / 'results.jsonl'}")
    for parent in output.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ArmkvError(f"--output {output}: {parent} is a file, not a folder")
            break
    if input_path == "-":
        return
    given = Path(input_path)
    for written, what in (
        (output, "is the --input file"),
        (partial_of(output), "is where this run writes its partial results"),
        (lock_of(output), "is this run's lock file"),
    ):
        same = given.resolve() == written.resolve() or (
            written.exists() and given.exists() and os.path.samefile(given, written)
        )
        if same and written == output:
            raise ArmkvError(f"--output {output} is the --input file: name another file (the requests would be lost)")
        if same:
            raise ArmkvError(
                f"--input {input_path} {what} for --output {output}: copy it to another name and give that as "
                "--input (the requests would be lost)"
            )


def partial_of(path: Path) -> Path:
    return path.with_name(path.name + ".partial")


def lock_of(path: Path) -> Path:
    return path.with_name(path.name + ".lock")


class OutputLock:
    """An exclusive lock on an output: ``OUTPUT.lock`` beside it, held (``flock``) while the run
    lasts and removed when it ends. The kernel drops the lock of a process that dies, however
    it dies, so a lock file left by a killed run is taken over (and said so)."""

    def __init__(self, output: Path):
        import fcntl

        self.path = lock_of(output)
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise ArmkvError(f"--output {output}: cannot write there ({e.strerror})") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = _read_pid(fd)
                os.close(fd)
                who = f"pid {holder}" if holder else "another process"
                raise ArmkvError(
                    f"--output {output} is being written by another armkv run ({who}, lock {self.path}): wait for it "
                    "to end, or name another --output"
                ) from None
            try:  # a run that was ending may have removed the file we opened: lock the one there now
                if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        previous = _read_pid(fd)
        if previous and previous != os.getpid():
            print(
                f"{TOOL}: warning: {self.path} was left by a run that ended without removing it (pid {previous}, "
                "no longer running); taken over",
                file=sys.stderr,
            )
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(self.fd)  # closing drops the flock
        self.fd = None


def _read_pid(fd: int) -> int | None:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        return int(os.read(fd, 32).decode().strip() or 0) or None
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def read_results(path: Path, partial: bool) -> list[tuple[int, dict]]:
    """``(line number, result)`` of every line of an output file, read strictly: a line that is not
    an armkv generate result is a one-line error naming the file and the line. In a partial
    file (``partial``) a last line without its newline, cut short by a killed run, is dropped."""
    if not path.exists():
        return []
    data = path.read_bytes()
    lines = data.split(b"\n")
    tail = lines.pop()  # after the last newline: empty where the file ends with one
    if tail.strip() and not partial:
        lines.append(tail)
    if partial:
        remedy = (
            "it is not one this tool wrote: move it away (or delete it) and run again; the output itself is untouched"
        )
    else:
        remedy = "name another --output, or pass --overwrite to replace the file"
    records = []
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        why = None
        try:
            record = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant)
        except UnicodeDecodeError:
            why = "not UTF-8 text"
        except (ValueError, RecursionError):
            why = "not JSON"
        else:
            if not isinstance(record, dict) or "id" not in record or not isinstance(record.get("output"), str):
                why = "not a result: a JSON object with 'id' and 'output'"
        if why:
            raise ArmkvError(f"{path}:{number} is not an armkv generate result ({why}); {remedy}")
        records.append((number, record))
    return records


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON")


class Output:
    """Where results go (see the module's docstring), opened before the model loads.

    Parameters
    ----------
    path : the --output path, or "-"
    settings : what every result is produced under (stored on each line)
    overwrite : replace the results the output holds (an interrupted --overwrite's own results,
        left in the .partial, are still resumed)
    input_path : the --input path (never written over)
    requests : this run's requests: a kept result whose request changed is answered again
    """

    def __init__(self, path: str, settings: dict, overwrite: bool, input_path: str, requests: list[dict]):
        self.settings = settings
        self.overwrite = overwrite
        self.stdout = path == "-"
        self.direct = False  # written to as it is: standard output or a special file
        self.kept: list[dict] = []
        self.before = 0  # results the output held when the run started
        self.added = 0
        self.file = None
        self.lock = None
        self.changed: list = []  # ids whose request changed since their result was made
        self.as_output = False  # whether the results kept are exactly the output's
        if self.stdout:
            self.direct = True
            return
        self.path = Path(path)
        check_output_path(self.path, input_path)
        if self.path.is_symlink():  # written through the link: the file it names is the output, not the link
            self.path = Path(os.path.realpath(self.path))
            check_output_path(self.path, input_path)
        self.partial = partial_of(self.path)
        if is_special(self.path):
            self.direct = True
            try:
                self.file = self.path.open("a", encoding="utf-8")
            except OSError as e:
                raise ArmkvError(f"--output {self.path}: cannot write there ({e.strerror})") from None
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ArmkvError(f"--output {self.path}: cannot make its folder ({e.strerror})") from None
        self.lock = OutputLock(self.path)
        try:
            self._resume(requests)
            try:
                self.file = self.partial.open("w", encoding="utf-8")  # before the model loads: fails now
            except OSError as e:
                raise ArmkvError(f"--output {self.path}: cannot write there ({e.strerror})") from None
            for record in self.kept:
                self.file.write(dumps(record))
            self.file.flush()
        except BaseException:
            self.lock.release()
            raise

    def _resume(self, requests: list[dict]) -> None:
        """The results to keep: the output's (unless --overwrite) and the partial file's, under
        these settings, less those whose request changed."""
        previous = read_results(self.path, partial=False)
        self.before = len(previous)
        current = {id_key(r["id"]): request_hash(r, self.settings) for r in requests}
        by_id = {}
        for source in (self.path, self.partial):
            records = previous if source == self.path else read_results(source, partial=True)
            if self.overwrite and (
                source == self.path or not all(r.get("settings") == self.settings for _, r in records)
            ):
                continue
            remedy = (
                "pass another --output, or --overwrite to replace them"
                if source == self.path
                else f"they are an interrupted run's: rerun its command to finish it, or delete {source} to drop them"
            )
            for number, record in records:
                if isinstance(record.get("settings"), dict):
                    compare_settings(record["settings"], self.settings, str(source), remedy)
                if "settings" not in record or "hash" not in record:
                    raise ArmkvError(
                        f"{source}:{number} holds a result without the settings and request hash it was made under "
                        f"(an older armkv): {remedy}"
                    )
                key = id_key(record["id"])
                if key in current and record["hash"] != current[key]:
                    by_id.pop(key, None)
                    self.changed.append(record["id"])
                    continue
                by_id[key] = record
        self.kept = list(by_id.values())
        # nothing beyond what the output holds: a run that adds nothing leaves the file as it is
        self.as_output = not self.overwrite and [id(r) for r in self.kept] == [id(r) for _, r in previous]
        if self.changed:
            shown = ", ".join(repr(i) for i in self.changed[:3]) + (", ..." if len(self.changed) > 3 else "")
            print(
                f"{TOOL}: warning: {len(self.changed)} request(s) changed since their results in {self.path} were made "
                f"({shown}): answered again, their old results replaced",
                file=sys.stderr,
            )

    @property
    def done(self) -> set[str]:
        return {id_key(r["id"]) for r in self.kept}

    def write(self, result: dict, request: dict) -> None:
        line = dumps({**result, "settings": self.settings, "hash": request_hash(request, self.settings)})
        try:
            if self.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
            else:
                self.file.write(line)
                self.file.flush()
        except BrokenPipeError:
            _silence_stdout()
            raise OutputClosed from None
        except OSError as e:
            if self.stdout:
                raise ArmkvError(f"cannot write to standard output ({e.strerror})") from None
            where = self.path if self.direct else self.partial
            raise ArmkvError(f"--output {self.path}: cannot write to {where} ({e.strerror})") from None
        self.added += 1

    def close(self, complete: bool) -> str | None:
        """Finish the output; ``complete``: the run went through all its requests. Renames the
        partial file over the output, except where an --overwrite was cut short or produced
        nothing (the output is kept as it was). Returns a note for the user, or None."""
        note = None
        if self.file is not None:
            try:
                self.file.close()
            except OSError:
                pass
            self.file = None
            if not self.direct:
                if self.overwrite and (not complete or not (self.kept or self.added)) and self.path.exists():
                    note = (
                        f"{self.path} keeps its {self.before} earlier results; the {self.added} new ones are in "
                        f"{self.partial} (run the same command again to finish replacing them)"
                    )
                elif not self.added and (self.as_output or not (self.kept or self.path.exists())):
                    self.partial.unlink()  # nothing was produced: the output stays as it was (or absent)
                else:
                    os.replace(self.partial, self.path)
        if self.lock is not None:
            self.lock.release()
            self.lock = None
        return note


def _silence_stdout() -> None:
    """Point standard output at /dev/null, so that Python's own flush at exit does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass
