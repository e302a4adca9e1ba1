"""Sinks: subscribers that put events somewhere a person or a tool can read them."""

from eventbus.sinks.console import ConsoleProgress
from eventbus.sinks.jsonl import JsonlWriteError, JsonlWriter, JsonlWriterStats
from eventbus.sinks.tensorboard import TensorBoardSink

__all__ = [
    "ConsoleProgress",
    "JsonlWriteError",
    "JsonlWriter",
    "JsonlWriterStats",
    "TensorBoardSink",
]
