"""Analysis consumers that run on the bus side: divergence, memory, speed."""

from eventbus.monitors.divergence import DivergenceDetector

__all__ = ["DivergenceDetector"]
