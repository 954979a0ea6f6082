"""argparse types: each parses one option's text or raises ArgumentTypeError (argparse names the option in the
error). Shared by the command line (cli.py) and the option dataclasses it is built from (converter/options.py)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

INT32_MAX = 2**31 - 1  # llama.cpp's counts (context, batch) are 32-bit
MAX_THREADS = 512  # GGML_MAX_N_THREADS: ggml aborts above it


def count(lo: int, hi: int = INT32_MAX) -> Callable[[str], int]:
    """An integer in [lo, hi]."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is not an integer") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{value} is out of range (from {lo} to {hi})")
        return value
    return parse


THREADS = count(1, MAX_THREADS)


def perplexity_budget(text: str) -> float | None:
    """--perplexity-budget: a percentage in [0, 100] -> a fraction, or 'none'."""
    if text.strip().lower() == "none":
        return None
    try:
        value = float(text.rstrip("%"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a percentage or 'none'") from None
    if not (math.isfinite(value) and 0.0 <= value <= 100.0):
        raise argparse.ArgumentTypeError(f"{text} is not a percentage from 0 to 100")
    return value / 100.0


def widths(text: str) -> list[int]:
    """--ranks: comma-separated predictor widths, each at least 2."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of integers") from None
    bad = [v for v in values if not 2 <= v <= INT32_MAX]
    if bad:
        raise argparse.ArgumentTypeError(f"'{text}': a predictor width must be at least 2, not {bad[0]}")
    return values
