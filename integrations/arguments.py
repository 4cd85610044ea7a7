"""Argument types the command line's commands share (`cli`, `doctor`)."""

from __future__ import annotations

import argparse
import math


def positive_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds above zero."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds, got {text}")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return value
