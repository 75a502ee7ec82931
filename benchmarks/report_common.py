"""What every part of the report uses: ratios, medians, number formats, the recorded JSON files."""

from __future__ import annotations

import json
import os
import statistics


def ratio_of(a, b):
    return round(a / b, 3) if a is not None and b else None


def get_in(d, *keys):
    for k in keys:
        if d is None:
            return None
        d = d.get(k)
    return d


def median_of(values):
    """The median of the values that are there (None: a round that failed), or None."""
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def mean_of(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def fmt(v, digits=2):
    return "—" if v is None else f"{v:.{digits}f}"


def read_record(name: str) -> dict | None:
    """A benchmark's record kept beside this file (a script run apart from run.py), if there is
    one."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)
