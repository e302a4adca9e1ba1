"""eventbus.control: stop and abort flags, one StopRequested per request, agreed when asked."""

from __future__ import annotations

import threading

import pytest

from eventbus.control import AbortRequested, Control
from eventbus.events import Event, SaveRequested, StopRequested


def test_a_stop_is_published_once_with_its_reason_source_and_step() -> None:
    out: list[Event] = []
    c = Control(out.append)
    c.request_stop("loss diverged", source="DivergenceDetector", step=12)
    c.request_stop("again", source="other")
    assert c.should_stop and not c.should_abort
    assert (c.reason, c.source) == ("loss diverged", "DivergenceDetector")
    assert len(out) == 1 and isinstance(out[0], StopRequested)
    assert (out[0].step, out[0].reason, out[0].abort) == (12, "loss diverged", False)


def test_an_abort_implies_a_stop_takes_the_reason_and_check_raises() -> None:
    out: list[Event] = []
    c = Control(out.append)
    c.request_stop("first")
    c.request_abort("out of memory", source="MemoryProfiler")
    assert c.should_stop and c.should_abort and c.reason == "out of memory"
    assert [e.abort for e in out if isinstance(e, StopRequested)] == [False, True]
    with pytest.raises(AbortRequested, match="out of memory"):
        c.check()


def test_reset_clears_the_flags_for_a_new_run() -> None:
    c = Control(lambda ev: None)
    c.request_abort("x")
    c.reset()
    assert not c.should_stop and not c.should_abort and c.reason is None
    c.check()  # no abort: returns


def test_an_agreement_decides_what_the_loop_reads() -> None:
    c = Control(lambda ev: None)
    seen: list[tuple[bool, bool]] = []

    def agree(stop: bool, abort: bool) -> tuple[bool, bool]:
        seen.append((stop, abort))
        return True, False  # another rank asked to stop

    c.agree = agree
    assert c.should_stop and not c.should_abort
    assert seen[-1] == (False, False)  # this rank's own flags go to the agreement


def test_requests_from_many_threads_publish_exactly_one_stop() -> None:
    out: list[Event] = []
    c = Control(out.append)
    threads = [threading.Thread(target=c.request_stop, args=(f"t{i}",)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(out) == 1


# -- save requests (issue 17) --------------------------------------------------------------


def test_a_save_is_seen_at_once_in_one_process_and_cleared_by_save_done() -> None:
    out: list[Event] = []
    c = Control(out.append)
    assert not c.save_requested
    assert c.request_save("eval looks good", source="eventbus ctl", step=7)
    assert c.save_requested and c.save_requested  # a level: reading it changes nothing
    assert not c.request_save("again")  # coalesced while one is pending
    c.save_done()
    assert not c.save_requested and not c.save_pending
    assert c.request_save("later")  # a new request asks again
    saves = [e for e in out if isinstance(e, SaveRequested)]
    assert [(e.step, e.reason, e.source) for e in saves] == [
        (7, "eval looks good", "eventbus ctl"),
        (None, "later", None),
    ]


def test_with_an_agreement_a_save_waits_for_it_and_other_ranks_record_why() -> None:
    out: list[Event] = []
    c = Control(out.append)
    c.agree = lambda stop, abort: (stop, abort)
    c.request_save("asked here")
    assert c.save_pending and not c.save_requested  # not agreed yet
    c.save_agreed(asked_on=0)
    assert c.save_requested and not c.save_pending
    c.save_done()
    assert not c.save_requested
    c.save_agreed(asked_on=1)  # asked on rank 1 only: this rank records it too
    assert c.save_requested
    saves = [e for e in out if isinstance(e, SaveRequested)]
    assert [(e.reason, e.source) for e in saves] == [
        ("asked here", None),
        ("save requested on rank 1", "rank 1"),
    ]


def test_reset_clears_a_save_too() -> None:
    c = Control(lambda ev: None)
    c.request_save("x")
    c.reset()
    assert not c.save_requested and not c.save_pending


def test_a_relay_forwards_every_save_and_the_control_it_reaches_coalesces() -> None:
    loop = Control(lambda ev: None)  # the training process's: its loop calls save_done()
    relayed: list[Event] = []

    def replay(ev: Event) -> None:  # what the parent does with a sidecar's requests
        relayed.append(ev)
        if isinstance(ev, SaveRequested):
            loop.request_save(ev.reason, source=ev.source, step=ev.step)

    side = Control(replay, relay=True)  # a sidecar subscriber's
    assert side.request_save("first", step=1) and loop.save_requested
    assert side.request_save("while pending", step=2)  # forwarded; coalesced over there
    assert not side.save_pending and not side.save_requested  # the relay holds nothing
    loop.save_done()
    assert side.request_save("after the save", step=3)  # not stuck: asks again
    assert loop.save_requested
    assert [e.step for e in relayed] == [1, 2, 3]
