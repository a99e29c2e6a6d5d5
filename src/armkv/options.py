"""Method options as the command line gives them, ``--option METHOD.KEY=VALUE`` (generate, the
evals and ``armkv bench decode`` read them alike). No torch, no tool imports.

:data:`OPTIONS` is the one table of every option a method takes, with its type and range:
a value is checked here, where the command line is read, before any model loads. Presets
(:data:`PRESETS`) name a set of options: ``arm.read=sparse`` stands for the six options of the
measured sparse read, and an option given beside a preset overrides the preset's value.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Iterable

from armkv.config import CHOICES
from armkv.errors import ArmkvError


@dataclass(frozen=True)
class Option:
    """One option's type and range.

    kind : "int", "float", "bool", "choice", "text", "buckets" (a number of buckets, >= 1, or a
        share of them in (0, 1] such as "1/8"), "formats" (comma-separated slot formats,
        possibly none), "weights" (a rule name or a list of positive numbers)
    low, high : bounds of a number (None: unbounded); ``open_low`` / ``open_high`` exclude them
    choices : the values a "choice" takes
    """

    kind: str
    low: float | None = None
    high: float | None = None
    open_low: bool = False
    open_high: bool = False
    choices: tuple = ()
    null: bool = False  # whether null (JSON) is allowed: the method's own default

    def expect(self) -> str:
        """What a value must be, as a phrase: "an integer >= 0", "true or false", ..."""
        if self.kind == "bool":
            return "true or false"
        if self.kind == "choice":
            return "one of " + ", ".join(str(c) for c in self.choices)
        if self.kind == "text":
            return "a text"
        if self.kind == "buckets":
            return "a number of buckets >= 1 (8) or a share of them in (0, 1] (1/8)"
        if self.kind == "formats":
            return "comma-separated slot formats (" + ", ".join(CHOICES["slot_format"]) + "), or nothing"
        if self.kind == "weights":
            return "a rule (even, lift-late) or a list of positive numbers, one a layer ([1, 2, 1])"
        noun = "an integer" if self.kind == "int" else "a number"
        if self.low is not None and self.high is not None:
            return (
                f"{noun} in {'(' if self.open_low else '['}{_num(self.low)}, {_num(self.high)}"
                f"{')' if self.open_high else ']'}"
            )
        if self.low is not None:
            return f"{noun} {'>' if self.open_low else '>='} {_num(self.low)}"
        return noun

    def check(self, value) -> bool:
        """Whether ``value`` (as :func:`option_value` read it) is of this type and in range."""
        if value is None:
            return self.null
        if self.kind == "bool":
            return isinstance(value, bool)
        if self.kind == "choice":
            return not isinstance(value, bool) and value in self.choices
        if self.kind == "text":
            return isinstance(value, str) and bool(value.strip())
        if self.kind == "formats":
            return isinstance(value, str) and all(
                f.strip() in CHOICES["slot_format"] for f in value.split(",") if f.strip()
            )
        if self.kind == "weights":
            if isinstance(value, str):
                return value in ("even", "lift-late")
            return (
                isinstance(value, list)
                and bool(value)
                and all(_is_number(v) and math.isfinite(v) and v > 0 for v in value)
            )
        if self.kind == "buckets":
            if isinstance(value, str):
                try:
                    share = Fraction(value.strip())
                except (ValueError, ZeroDivisionError):
                    return False
                return share >= 1 if share.denominator == 1 else 0 < share <= 1
            return isinstance(value, int) and not isinstance(value, bool) and value >= 1
        if self.kind == "int":
            if not isinstance(value, int) or isinstance(value, bool):
                return False
        elif not _is_number(value) or not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.open_low else value < self.low):
            return False
        if self.high is not None and (value >= self.high if self.open_high else value > self.high):
            return False
        return True


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _choice(field: str) -> Option:
    return Option("choice", choices=CHOICES[field])


INT0, INT1 = Option("int", low=0), Option("int", low=1)
BOOL = Option("bool")
ADAPTER = Option("text")

# Every option each method takes: {method: {key: Option}}. The methods' factories take exactly
# these keys (a test keeps them equal); arm's are the run-time fields of ARMConfig
# (config.py says what each does) besides the adapter and the per-layer budget shares.
OPTIONS: dict[str, dict[str, Option]] = {
    "full": {},
    "offload": {},
    "swa": {},
    "sink": {"sinks": INT0},
    "kivi": {
        "bits": Option("choice", choices=(2, 4)),
        "group": INT1,
        "value_group": Option("int", low=1, null=True),
        "residual": Option("int", low=0, null=True),
        "sinks": INT0,
    },
    "arm": {
        "adapter": ADAPTER,
        "layer_weights": Option("weights", null=True),
        "sinks": INT0,
        "window": INT1,
        "sync": INT1,
        "slots": INT1,
        "pool": _choice("pool"),
        "position_mode": _choice("position_mode"),
        "write": _choice("write"),
        "empty_slot_rule": BOOL,
        "log_count_bias": BOOL,
        "demote_scope": _choice("demote_scope"),
        "protect_recent": Option("float", low=0.0, high=1.0, open_high=True),
        "lazy_merge": BOOL,
        "slot_format": _choice("slot_format"),
        "slot_ladder": Option("formats"),
        "slot_mixing": BOOL,
        "tau": Option("float", low=0.0, open_low=True),
        "top_m": _choice("top_m"),
        "m_fixed": Option("buckets", null=True),
        "read_rank": _choice("read_rank"),
        "partial_share": Option("float", low=0.0, high=1.0, open_low=True),
        "read_pages": BOOL,
        "page_split": INT1,
        "read_summaries": BOOL,
        "epsilon": Option("float", low=0.0, high=1.0),
    },
    "fifo": {"adapter": ADAPTER},
}

# Options given elsewhere on the command line: the key, and where it goes instead.
ELSEWHERE = {"chunk": "--chunk", "budget": "--budget"}

# Named sets of options: {method: {key: {value: {option: value}}}}. ``arm.read=sparse`` is the
# sparse read as measured (docs/evaluation.md): slots unmixed, a fixed M of an eighth of the
# buckets ranked from partial logits, pages and summaries; ``arm.read=dense`` reads every
# bucket (the default). An option given beside a preset overrides the preset's value.
PRESETS: dict[str, dict[str, dict[str, dict]]] = {
    "arm": {
        "read": {
            "dense": {},
            "sparse": {
                "slot_mixing": False,
                "top_m": "fixed",
                "m_fixed": "1/8",
                "read_rank": "partial",
                "read_pages": True,
                "read_summaries": True,
            },
        }
    }
}


def option_keys(method: str) -> list[str]:
    """The option keys ``--option METHOD.KEY=VALUE`` takes for ``method`` (presets included)."""
    return sorted(set(OPTIONS.get(method, {})) | set(PRESETS.get(method, {})))


def check_options(method: str, options: dict) -> dict:
    """``options`` of ``method`` with its presets expanded (an option given beside a preset wins),
    or a one-line ArmkvError for a key the method does not take (the message lists those it
    does) or a value of the wrong type or out of range. A method not in :data:`OPTIONS` (an
    unknown one) is returned as it is: the method's name is checked where it is resolved."""
    if method not in OPTIONS:
        return dict(options)
    table, presets = OPTIONS[method], PRESETS.get(method, {})
    expanded: dict = {}
    for key, value in options.items():
        if key in presets:
            if not isinstance(value, str) or value not in presets[key]:
                raise ArmkvError(f"--option {method}.{key}={_shown(value)}: expected one of {', '.join(presets[key])}")
            expanded.update(presets[key][value])
    for key, value in options.items():
        if key in presets:
            continue
        if key not in table:
            if key in ELSEWHERE:
                raise ArmkvError(f"--option {method}.{key}=...: give it as {ELSEWHERE[key]} {_shown(value)}")
            listed = ", ".join(option_keys(method)) or "none"
            raise ArmkvError(f"method {method!r} has no option {key}; its options: {listed}")
        if not table[key].check(value):
            raise ArmkvError(f"--option {method}.{key}={_shown(value)}: expected {table[key].expect()}")
        expanded[key] = value
    return expanded


def _shown(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def parse_options(pairs: Iterable[str] | None) -> dict[str, dict]:
    """``["arm.adapter=run/x", "kivi.bits=2"]`` -> ``{"arm": {"adapter": "run/x"}, "kivi": {"bits": 2}}``.

    Values are read as JSON where they parse (numbers, booleans), else kept as text; each is
    checked against :data:`OPTIONS` and presets are expanded (:func:`check_options`).
    """
    return {method: check_options(method, given) for method, given in _read_pairs(pairs).items()}


def _read_pairs(pairs: Iterable[str] | None) -> dict[str, dict]:
    """``--option`` pairs by method, values read (:func:`option_value`) but not yet checked."""
    options: dict[str, dict] = {}
    for pair in pairs or ():
        name, sep, value = pair.partition("=")
        method, dot, key = name.strip().partition(".")
        if not sep or not dot or not method or not key.strip():
            raise ArmkvError(f"--option {pair!r}: expected METHOD.KEY=VALUE, e.g. arm.adapter=PATH")
        options.setdefault(method, {})[key.strip()] = option_value(value)
    return options


def option_value(text: str):
    """An option's value: JSON where it parses (numbers, booleans, lists), else the text itself.
    NaN and infinities are kept as text (so refused where a number is expected)."""
    try:
        return json.loads(text, parse_constant=lambda name: text)
    except (json.JSONDecodeError, RecursionError):
        return text


ADAPTER_METHODS = ("arm", "fifo")  # the methods that take an adapter (``--adapter``)


def with_adapter(options: dict[str, dict], adapter: str | None, methods: Iterable[str]) -> dict[str, dict]:
    """``options`` with ``--adapter`` given to each of ``methods`` that takes one (arm, fifo),
    as ``--option METHOD.adapter=`` would give it; the two together are an error."""
    if adapter is None:
        return options
    if not adapter.strip():
        raise ArmkvError("--adapter is empty: give a folder, 'calibrated' or 'random'")
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
    options = _read_pairs(pairs)
    other = sorted(set(options) - {method})
    if other:
        key = next(iter(options[other[0]]))
        raise ArmkvError(f"--option {other[0]}.{key}=...: this run's method is {method!r}, not {other[0]!r}")
    options = {name: check_options(name, given) for name, given in options.items()}
    options = with_adapter(options, adapter, [method] if method in ADAPTER_METHODS else [])
    if adapter is not None and method not in ADAPTER_METHODS:
        raise ArmkvError(f"--adapter applies to the {' and '.join(ADAPTER_METHODS)} methods, not {method!r}")
    return dict(options.get(method, {}))
