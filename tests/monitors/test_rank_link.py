"""`Gathering` (rank 0's table of parts by key) and `RankLink` (the thread that fills it)."""

from __future__ import annotations

import datetime
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed as dist

from eventbus.monitors._rank_link import Gathering, Key, RankLink, decode_float, encode_float


def test_a_key_is_ready_once_every_rank_sent_its_part() -> None:
    g = Gathering(3, timeout_s=10)
    g.add(0, ("loss", 1), 1.0, now=0)
    g.add(2, ("loss", 1), 3.0, now=0)
    assert g.ready(now=1) == []
    g.add(1, ("loss", 1), 2.0, now=1)
    assert g.ready(now=1) == [(("loss", 1), {0: 1.0, 2: 3.0, 1: 2.0}, ())]
    assert g.pending == 0
    g.add(1, ("loss", 1), 9.0, now=2)  # once more, after it went out: late, not a new key
    assert g.late == 1
    assert g.ready(now=2) == []


def test_a_rank_that_went_past_a_key_is_not_waited_for_there() -> None:
    g = Gathering(2, timeout_s=10)
    g.add(0, ("loss", 1), 1.0, now=0)
    g.add(0, ("loss", 2), 1.0, now=0)
    g.add(1, ("loss", 2), 2.0, now=0)  # rank 1 skipped step 1 (a dropped event)
    out = g.ready(now=0)
    assert [(k, m) for k, _, m in out] == [(("loss", 1), (1,)), (("loss", 2), ())]
    assert g.take_lost() == []


def test_a_silent_rank_is_reported_lost_once_then_back() -> None:
    g = Gathering(2, timeout_s=5)
    g.add(0, ("loss", 1), 1.0, now=0)
    assert g.ready(now=5) == []  # not yet past the timeout
    out = g.ready(now=6)
    assert out == [(("loss", 1), {0: 1.0}, (1,))]
    assert g.take_lost() == [(1, 6)]
    assert g.take_lost() == []
    g.add(0, ("loss", 2), 1.0, now=7)
    assert g.ready(now=7) == [(("loss", 2), {0: 1.0}, (1,))]  # lost: not waited for
    assert g.add(1, ("loss", 3), 2.0, now=8)  # it sends again: back
    assert g.lost == set()
    assert g.ready(now=8) == []  # step 3 waits for rank 0 again
    g.add(1, ("loss", 1), 2.0, now=8)
    assert g.late == 1


def test_an_ended_rank_is_not_waited_for_and_final_takes_everything() -> None:
    g = Gathering(3, timeout_s=100)
    g.add(0, ("a", 1), 1.0, now=0)
    g.add(1, ("a", 1), 1.0, now=0)
    g.end(2)
    assert [m for _, _, m in g.ready(now=0)] == [(2,)]
    g.add(0, ("a", 2), 1.0, now=0)
    assert g.ready(now=0) == []
    assert [m for _, _, m in g.ready(now=0, final=True)] == [(1, 2)]
    assert g.take_lost() == []  # the end of a run is not a lost rank


def test_too_many_pending_keys_complete_the_oldest_counted() -> None:
    g = Gathering(2, timeout_s=100, max_pending=2)
    for s in range(3):
        g.add(0, ("a", s), 1.0, now=0)
    assert [k for k, _, _ in g.ready(now=0)] == [("a", 0)]
    assert g.overflow == 1


def test_non_finite_values_survive_json() -> None:
    for x in (1.5, float("inf"), float("-inf")):
        assert decode_float(encode_float(x)) == x
    assert decode_float(encode_float(float("nan"))) != decode_float(encode_float(float("nan")))


# -- the thread, two ranks in one process -------------------------------------------------------


@pytest.fixture
def rendezvous(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    server = dist.TCPStore(
        "127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False
    )
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    yield
    del server


class Seen:
    def __init__(self) -> None:
        self.ready: list[tuple[Key, dict[int, Any], tuple[int, ...]]] = []
        self.lost: list[int] = []
        self.changed = threading.Condition()

    def on_ready(self, key: Key, parts: dict[int, Any], missing: tuple[int, ...]) -> None:
        with self.changed:
            self.ready.append((key, parts, missing))
            self.changed.notify_all()

    def on_lost(self, rank: int, waited: float) -> None:
        with self.changed:
            self.lost.append(rank)
            self.changed.notify_all()


def _link(name: str, seen: Seen, **kw: Any) -> RankLink:
    opts = {"tick_s": 0.01, "timeout_s": 30.0, "close_wait_s": 10.0, **kw}
    return RankLink(name, on_ready=seen.on_ready, on_lost=seen.on_lost, **opts)


@pytest.mark.usefixtures("rendezvous")
def test_two_links_carry_parts_to_rank_0_and_close_cleanly() -> None:
    seen = Seen()
    zero, one = _link("t/two", seen), _link("t/two", Seen())
    zero.start(0, 2)
    one.start(1, 2)
    for s in (1, 2):
        zero.put(("loss", s), float(s))
        one.put(("loss", s), float(10 * s))
    with seen.changed:
        assert seen.changed.wait_for(lambda: len(seen.ready) == 2, timeout=30)
    assert seen.ready == [
        (("loss", 1), {0: 1.0, 1: 10.0}, ()),
        (("loss", 2), {0: 2.0, 1: 20.0}, ()),
    ]
    one.put(("loss", 3), 30.0)  # sent at close, before its end mark
    one.close()
    zero.put(("loss", 3), 3.0)
    zero.close()  # waits for rank 1's end mark: it is already there
    assert seen.ready[-1] == (("loss", 3), {0: 3.0, 1: 30.0}, ())
    assert one.stats()["sent"] >= 2
    assert zero.stats()["lost"] == []
    assert seen.lost == []


@pytest.mark.usefixtures("rendezvous")
def test_a_rank_that_never_sends_is_reported_not_waited_for_forever() -> None:
    seen = Seen()
    zero = _link("t/dead", seen, timeout_s=0.2, close_wait_s=0.2)
    zero.start(0, 2)
    zero.put(("loss", 1), 1.0)
    with seen.changed:
        assert seen.changed.wait_for(lambda: seen.lost and seen.ready, timeout=30)
    assert seen.lost == [1]
    assert seen.ready == [(("loss", 1), {0: 1.0}, (1,))]
    zero.close()
    assert zero.stats()["lost"] == [1]


def test_a_link_without_a_rendezvous_counts_what_it_drops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    link = _link("t/none", Seen())
    link.start(1, 2)
    link.close()  # the thread ended at once: no channel
    link.put(("loss", 1), 1.0)
    st = link.stats()
    assert st["error"] is not None and "MASTER_ADDR" in st["error"]
    assert st["dropped"] == 1
