"""The bus core: inbox, router, subscriber queues, delivery and the loop, one owner each."""

from eventbus.core.handle import BusHandle

__all__ = ["BusHandle"]
