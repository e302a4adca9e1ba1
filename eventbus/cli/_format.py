"""How the commands write numbers: durations as h:mm:ss.s, values to four significant digits."""

from __future__ import annotations

import math

__all__ = ["g", "hms"]


def hms(s: float) -> str:
    """`s` seconds as h:mm:ss.s (negative as zero)."""
    s = max(0.0, s)
    return f"{int(s // 3600)}:{int(s // 60 % 60):02d}:{s % 60:04.1f}"


def g(v: float) -> str:
    """Four significant digits; nan and inf as Python spells them."""
    return f"{v:.4g}" if math.isfinite(v) else str(v)
