"""`RankChannel`: messages from every rank to rank 0 through the job's rendezvous store.

    rank r (a thread of the bus's)          the rendezvous TCPStore           rank 0 (a thread)
    send(payload) -> queue_push ---------->  eventbus/<attempt>/<name>  ---->  receive(): queue_pop
                                             (a queue per channel)             until empty, no wait

Cross-rank work of the bus (stragglers, reduced metrics) never touches the training's process
groups and never runs a collective: a collective pairs calls by their order on every rank, so
a bus thread joining one would have to agree on that order with the training thread of every
rank (`dist.new_group` too is called by all ranks in one order), and a rank that falls behind
would hold up all the others' bus threads. A queue in the store has no order to agree on: a
rank pushes when it has something, rank 0 pops what has arrived, and a rank that is late or
dead only leaves rank 0 waiting for its part, which rank 0 times out on its own terms.

The store is the one torchrun's workers already meet at (`MASTER_ADDR`/`MASTER_PORT`): a client
connection of our own, so no lock is shared with the training's store client. Without those
variables, `torch.distributed`'s default store (when initialised) is cloned: a connection per
thread, as `Store.clone` is meant for. Keys live under `eventbus/<restart count>/<name>`.
Needs a store with queues (TCPStore; not FileStore). Never imports torch at import time.
"""

from __future__ import annotations

import datetime
import os
import sys
from typing import Any

__all__ = ["ChannelError", "RankChannel"]


class ChannelError(RuntimeError):
    """The channel cannot reach the rendezvous store; the message says why and what to do."""


def _store(timeout_s: float) -> tuple[Any, str]:
    """A store client of our own (and where it came from); ChannelError if there is none."""
    import torch.distributed  # the caller's thread: never the training thread

    dist: Any = torch.distributed  # typed loosely: the stubs lack TCPStore and Store.clone

    timeout = datetime.timedelta(seconds=timeout_s)
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if host and port:
        try:
            store = dist.TCPStore(
                host, int(port), is_master=False, timeout=timeout, wait_for_workers=False
            )
        except (RuntimeError, ValueError, OSError) as e:
            raise ChannelError(
                f"cannot reach the rendezvous store at {host}:{port} (MASTER_ADDR/MASTER_PORT) "
                f"within {timeout_s:g} s: {e}"
            ) from e
        return store, f"{host}:{port}"
    if dist.is_available() and dist.is_initialized():
        default = dist.distributed_c10d._get_default_store()
        store = default.clone()  # its own connection: the training's client is never shared
        store.set_timeout(timeout)
        return store, f"torch.distributed's default store ({type(default).__name__})"
    raise ChannelError(
        "no rendezvous store: set MASTER_ADDR/MASTER_PORT (torchrun does) or call "
        "torch.distributed.init_process_group before the bus starts its cross-rank work"
    )


class RankChannel:
    """A mailbox to rank 0 named `name` (the same on every rank); `connect()` on the thread
    that will use it, then `send` from any rank, `receive` on rank 0."""

    def __init__(self, name: str, *, rank: int, world_size: int, timeout_s: float = 60.0) -> None:
        if not name or not all(name.split("/")):
            raise ValueError(f"a channel name is words joined by '/'; got {name!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size; got rank {rank}, world {world_size}")
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.key = f"eventbus/{attempt}/{name}"  # a restarted job starts on an empty queue
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.where = ""  # which store, once connected
        self._store: Any = None
        self._empty: type[BaseException] = LookupError

    def connect(self) -> None:
        """Open the store connection; ChannelError if it cannot (a FileStore has no queues)."""
        store, where = _store(self.timeout_s)
        dist = sys.modules["torch.distributed"]
        self._empty = getattr(dist, "QueueEmptyError", LookupError)
        try:
            store.queue_len(self.key)
        except RuntimeError as e:
            raise ChannelError(f"the rendezvous store ({where}) cannot hold queues: {e}") from e
        self._store, self.where = store, where

    @property
    def connected(self) -> bool:
        return self._store is not None

    def send(self, payload: bytes) -> None:
        """Push one message (one round trip to the store; raises what the store raises)."""
        if self._store is None:
            raise ChannelError("send() before connect()")
        self._store.queue_push(self.key, payload)

    def receive(self, limit: int = 10_000) -> list[bytes]:
        """Rank 0: the messages waiting, oldest first, at most `limit`; never waits for more."""
        if self._store is None:
            raise ChannelError("receive() before connect()")
        if self.rank != 0:
            raise ChannelError(f"only rank 0 receives; this is rank {self.rank}")
        got: list[bytes] = []
        while len(got) < limit:
            try:
                got.append(bytes(self._store.queue_pop(self.key, block=False)))
            except self._empty:
                break
        return got

    def close(self) -> None:
        """Drop the connection (the store itself belongs to the job)."""
        self._store = None
