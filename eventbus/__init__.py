"""eventbus: typed events from PyTorch training loops onto a non-blocking bus.

Publishing costs about a microsecond, never synchronises the device, never waits for a slow
subscriber, and loses nothing a lossless subscriber was promised.
"""

from eventbus._globals import get_bus, register_global, set_bus
from eventbus.bus import EventBus, Subscription
from eventbus.codec import EventDecodeError, EventEncodeError
from eventbus.config import ConfigError, bus_from_config, subscribe_from_config
from eventbus.control import AbortRequested, Control
from eventbus.core.strict import SubscriberFailed
from eventbus.events import Event
from eventbus.load import load
from eventbus.replay import replay
from eventbus.stats import BusStats, SubscriberStats
from eventbus.subscriber import Subscriber
from eventbus.version import __version__ as __version__

__all__ = [
    "AbortRequested",
    "BusStats",
    "ConfigError",
    "Control",
    "Event",
    "EventBus",
    "EventDecodeError",
    "EventEncodeError",
    "Subscriber",
    "SubscriberFailed",
    "SubscriberStats",
    "Subscription",
    "bus_from_config",
    "get_bus",
    "load",
    "register_global",
    "replay",
    "set_bus",
    "subscribe_from_config",
]
