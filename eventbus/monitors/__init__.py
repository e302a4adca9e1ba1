"""Analysis consumers that run on the bus side: divergence, memory, speed."""

from eventbus.monitors.divergence import DivergenceDetector
from eventbus.monitors.memory import MemoryProfiler
from eventbus.monitors.speed import SpeedMonitor

__all__ = ["DivergenceDetector", "MemoryProfiler", "SpeedMonitor"]
