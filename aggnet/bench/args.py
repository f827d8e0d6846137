"""Argument types the benchmarks, the demo and the simulator share: a bad
value is refused by argparse in one line naming the option, before any
process starts (a zero count or an empty buffer used to fail deep in a
worker, or after every run, with a traceback)."""

from __future__ import annotations

import argparse

from aggnet.client.config import parse_size

__all__ = ["at_least_one", "count_list", "one_size", "positive_number", "positive_seconds", "size_list"]


def at_least_one(text: str) -> int:
    """A whole number of 1 or more (repetitions, steps, a width)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n}: give 1 or more")
    return n


def count_list(text: str) -> str:
    """Comma-separated whole numbers of 1 or more (worker counts), kept as
    the text the benchmark splits."""
    for part in text.split(","):
        try:
            at_least_one(part.strip())
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"{exc} (comma-separated counts, e.g. 2,4)") from None
    return text


def size_list(text: str) -> str:
    """Comma-separated buffer sizes of one float32 (4 bytes) or more, kept
    as the text the benchmark splits."""
    for part in text.split(","):
        try:
            n = parse_size(part.strip())
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if n < 4:
            raise argparse.ArgumentTypeError(f"{part.strip()!r} holds no float32 value: give 4 bytes or more "
                                             f"(e.g. 64KiB,1MiB)")
    return text


def one_size(text: str) -> str:
    """One buffer size of 4 bytes or more, kept as its text."""
    if "," in text:
        raise argparse.ArgumentTypeError(f"{text!r}: give one size (e.g. 64MiB)")
    return size_list(text)


def _above_zero(text: str, what: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a {what}") from None
    if not x > 0:
        raise argparse.ArgumentTypeError(f"{text}: give a {what} above 0")
    return x


def positive_seconds(text: str) -> float:
    """A duration above 0 seconds."""
    return _above_zero(text, "duration in seconds")


def positive_number(text: str) -> float:
    """A number above 0 (a learning rate)."""
    return _above_zero(text, "number")
