"""Flags that several entry points take alike (the app, `cpchat rank`, `cpchat bench`): argparse only."""

from __future__ import annotations

import argparse

from cpchat.format import parse_size


def add_threads_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=positive_int, default=None, metavar="N",
                   help="BLAS threads per rank (default: the cores shared out between the ranks of a "
                        "machine, at least one each)")


def byte_size(text: str) -> int:
    """'8G', '512M', '1000000' (bytes), for a flag."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text}")
    return value


def whole_number(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text}")
    return value
