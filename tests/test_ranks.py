"""`RankChannel`: messages to rank 0 through a store queue, found from torchrun's variables."""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from eventbus.ranks import ChannelError, RankChannel
from tests.core.helpers import until


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> dist.TCPStore:
    """A rendezvous store in this process, named by MASTER_ADDR/MASTER_PORT as torchrun does."""
    server = dist.TCPStore(
        "127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False
    )
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    return server


def test_every_rank_reaches_rank_0_in_order(store: dist.TCPStore) -> None:
    zero = RankChannel("t/a", rank=0, world_size=3)
    ones = [RankChannel("t/a", rank=r, world_size=3) for r in (1, 2)]
    for ch in (zero, *ones):
        ch.connect()
    assert zero.receive() == []  # nothing yet: no wait
    ones[0].send(b"a1")
    ones[1].send(b"b1")
    ones[0].send(b"a2")
    zero.send(b"z")  # rank 0 may send to itself too
    got: list[bytes] = []

    def all_four() -> bool:
        got.extend(zero.receive())
        return len(got) >= 4

    assert until(all_four)
    # Each rank's messages in its order; across ranks (one connection each) the store
    # serves whichever arrives first.
    assert sorted(got) == [b"a1", b"a2", b"b1", b"z"]
    assert got.index(b"a1") < got.index(b"a2")
    assert zero.receive() == []
    assert "127.0.0.1" in zero.where
    assert store.queue_len("eventbus/0/t/a") == 0  # under the bus's own prefix, drained


def test_channels_with_other_names_do_not_mix(store: dist.TCPStore) -> None:
    a, b = RankChannel("x", rank=0, world_size=2), RankChannel("y", rank=0, world_size=2)
    a.connect()
    b.connect()
    one = RankChannel("y", rank=1, world_size=2)
    one.connect()
    one.send(b"for y")
    assert a.receive() == []
    assert b.receive() == [b"for y"]


def test_only_rank_0_receives_and_nothing_works_unconnected(store: dist.TCPStore) -> None:
    one = RankChannel("t", rank=1, world_size=2)
    with pytest.raises(ChannelError, match="before connect"):
        one.send(b"x")
    one.connect()
    with pytest.raises(ChannelError, match="only rank 0 receives"):
        one.receive()


def test_without_a_rendezvous_it_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ChannelError, match="set MASTER_ADDR/MASTER_PORT"):
        RankChannel("t", rank=0, world_size=2).connect()


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="words joined by"):
        RankChannel("a//b", rank=0, world_size=2)
    with pytest.raises(ValueError, match="0 <= rank < world_size"):
        RankChannel("a", rank=2, world_size=2)


def test_torch_distributed_default_store_is_cloned_and_a_filestore_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pytest.TempPathFactory
) -> None:
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        with pytest.raises(ChannelError, match="cannot hold queues"):
            RankChannel("t", rank=0, world_size=2).connect()
    finally:
        dist.destroy_process_group()
