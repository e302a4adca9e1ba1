"""Analysis consumers that run on the bus side: divergence, memory, speed, stopping, jobs."""

from eventbus.monitors.checkpoint_jobs import CheckpointJobError, CheckpointJobs
from eventbus.monitors.divergence import DivergenceDetector
from eventbus.monitors.memory import MemoryProfiler
from eventbus.monitors.speed import SpeedMonitor
from eventbus.monitors.stoppers import EarlyStopper, ThresholdStopper

__all__ = [
    "CheckpointJobError",
    "CheckpointJobs",
    "DivergenceDetector",
    "EarlyStopper",
    "MemoryProfiler",
    "SpeedMonitor",
    "ThresholdStopper",
]
