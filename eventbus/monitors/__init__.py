"""Analysis consumers that run on the bus side: divergence, memory, speed, stopping, jobs,
the hang watchdog, and the cross-rank ones (stragglers, metrics reduced over ranks)."""

from eventbus.monitors.checkpoint_jobs import CheckpointJobError, CheckpointJobs
from eventbus.monitors.divergence import DivergenceDetector
from eventbus.monitors.memory import MemoryProfiler
from eventbus.monitors.reducer import RankReducer
from eventbus.monitors.speed import SpeedMonitor
from eventbus.monitors.stoppers import EarlyStopper, ThresholdStopper
from eventbus.monitors.stragglers import StragglerDetector
from eventbus.monitors.watchdog import HangWatchdog

__all__ = [
    "CheckpointJobError",
    "CheckpointJobs",
    "DivergenceDetector",
    "EarlyStopper",
    "HangWatchdog",
    "MemoryProfiler",
    "RankReducer",
    "SpeedMonitor",
    "StragglerDetector",
    "ThresholdStopper",
]
