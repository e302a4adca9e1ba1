"""Analysis consumers that run on the bus side: divergence, memory, speed, stopping, jobs,
and the hang watchdog."""

from eventbus.monitors.checkpoint_jobs import CheckpointJobError, CheckpointJobs
from eventbus.monitors.divergence import DivergenceDetector
from eventbus.monitors.memory import MemoryProfiler
from eventbus.monitors.speed import SpeedMonitor
from eventbus.monitors.stoppers import EarlyStopper, ThresholdStopper
from eventbus.monitors.watchdog import HangWatchdog

__all__ = [
    "CheckpointJobError",
    "CheckpointJobs",
    "DivergenceDetector",
    "EarlyStopper",
    "HangWatchdog",
    "MemoryProfiler",
    "SpeedMonitor",
    "ThresholdStopper",
]
