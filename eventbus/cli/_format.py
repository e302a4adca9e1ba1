"""How the commands write numbers: durations as h:mm:ss.s, values to four significant digits."""

from __future__ import annotations

import math

__all__ = ["g", "hms"]


def hms(s: float) -> str:
    """`s` seconds as h:mm:ss.s (negative as zero)."""
    tenths = round(max(0.0, s) * 10)  # rounded once: 59.96 s is 0:01:00.0, not 0:00:60.0
    minutes, tenths = divmod(tenths, 600)
    return f"{minutes // 60}:{minutes % 60:02d}:{tenths // 10:02d}.{tenths % 10}"


def g(v: float) -> str:
    """Four significant digits; nan and inf as Python spells them."""
    return f"{v:.4g}" if math.isfinite(v) else str(v)
