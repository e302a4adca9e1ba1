"""Sinks: subscribers that put events somewhere a person or a tool can read them."""

from eventbus.sinks.console import ConsoleProgress
from eventbus.sinks.jsonl import JsonlWriteError, JsonlWriter, JsonlWriterStats
from eventbus.sinks.mlflow import MLflowSink, MLflowStats
from eventbus.sinks.prometheus import PrometheusExporter
from eventbus.sinks.tensorboard import TensorBoardSink
from eventbus.sinks.wandb import WandbSink, WandbStats

__all__ = [
    "ConsoleProgress",
    "JsonlWriteError",
    "JsonlWriter",
    "JsonlWriterStats",
    "MLflowSink",
    "MLflowStats",
    "PrometheusExporter",
    "TensorBoardSink",
    "WandbSink",
    "WandbStats",
]
