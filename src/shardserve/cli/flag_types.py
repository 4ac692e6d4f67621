"""The command line's parser and flag types, shared by every subcommand.

`Parser` prints one-line errors and shows defaults in --help. Every numeric flag is checked by its
type when the command line is parsed, before anything starts, and a bad value is one line naming
the flag (`Parser.error`).
"""

from __future__ import annotations

import argparse
import math
import sys


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (no usage dump) and whose help shows defaults."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


class DefaultsFormatter(argparse.HelpFormatter):
    """Append "(default: X)" to every flag that has a default, with or without help text, unless
    the help already says its default in its own words ("(default: $SHARDSERVE_API_KEY)")."""

    def add_argument(self, action: argparse.Action) -> None:
        if action.help is None and self._shows_default(action):
            action.help = "(default: %(default)s)"  # argparse prints no help line for a flag without help
        super().add_argument(action)

    @staticmethod
    def _shows_default(action: argparse.Action) -> bool:
        d = action.default  # identity, not ==: a default of 0 is shown, one of False (a switch) is not
        return bool(action.option_strings) and not (d is None or d is False or d is argparse.SUPPRESS)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default" in text or "%(default)" in text or not self._shows_default(action):
            return text
        return f"{text} (default: %(default)s)".strip()


def ranged(kind: type, low: float | None = None, high: float | None = None, low_open: bool = False):
    """An argparse type: `kind` (int or float) within [low, high] ((low, high] with low_open)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, "
                                             f"got {text!r}") from None
        if kind is float and math.isnan(value):
            raise argparse.ArgumentTypeError("must be a number, got nan")
        too_low = low is not None and (value <= low if low_open else value < low)
        if too_low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {_range_text(low, high, low_open)}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in some messages
    return parse


def _range_text(low, high, low_open: bool) -> str:
    if high is None:
        return f"{'>' if low_open else '>='} {low}"
    if low is None:
        return f"<= {high}"
    return f"in {'(' if low_open else '['}{low}, {high}]"


positive_int = ranged(int, 1)
non_negative_int = ranged(int, 0)
positive_float = ranged(float, 0, low_open=True)
non_negative_float = ranged(float, 0)
port_number = ranged(int, 1, 65535)
seed_int = ranged(int, -(2**63), 2**63 - 1)


def positive_ints(text: str) -> tuple[int, ...]:
    """Comma-separated integers >= 1, e.g. layer counts per pipeline stage or sizes to benchmark."""
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 10,10,10, got {text!r}") from None
    if any(n < 1 for n in values):
        raise argparse.ArgumentTypeError(f"every value must be >= 1, got {text}")
    return values


def memory_amount(text: str) -> float:
    """A fraction of free memory (0 < x <= 1) or a byte count (> 1; suffixes K, M, G allowed)."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    scale = units.get(text[-1:].upper(), 1)
    try:
        value = float(text[:-1] if scale > 1 else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction or a byte count, got {text!r}") from None
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value
