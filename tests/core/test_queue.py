"""core.queue: one subscriber's bounded queue; every event in is delivered or counted."""

from __future__ import annotations

import anyio
import pytest

from eventbus.core.queue import SubscriberQueue
from eventbus.events import Loss, Scalars


def _ev(i: int) -> Loss:
    return Loss(step=i, value=float(i))


@pytest.mark.parametrize(
    ("policy", "kept"),
    [("drop_oldest", [7, 8, 9]), ("drop_newest", [0, 1, 2]), ("block", [0, 1, 2])],
)
def test_overflow_policies(policy: str, kept: list[int]) -> None:
    async def main() -> None:
        q = SubscriberQueue(policy, 3)
        refused = [i for i in range(10) if not q.put_nowait(_ev(i))]
        assert [e.step for e in q.take(10)] == kept
        st = q.statistics()
        if policy == "block":
            assert refused == list(range(3, 10)) and st.dropped == 0
        else:
            assert refused == [] and st.dropped == 7
        assert st.high_water == 3

    anyio.run(main)


def test_latest_keeps_the_newest_per_key() -> None:
    async def main() -> None:
        q = SubscriberQueue("latest", 10)
        for i in range(5):
            q.put_nowait(Scalars(step=i, values={}))
            q.put_nowait(_ev(i))
        assert [(type(e).__name__, e.step) for e in q.take(10)] == [("Scalars", 4), ("Loss", 4)]
        assert q.statistics().dropped == 8

    anyio.run(main)


def test_put_waits_for_room_and_take_makes_it() -> None:
    async def main() -> None:
        q = SubscriberQueue("block", 1)
        q.put_nowait(_ev(0))
        order: list[str] = []

        async def producer() -> None:
            await q.put(_ev(1))
            order.append("put")

        async with anyio.create_task_group() as tg:
            tg.start_soon(producer)
            await anyio.sleep(0)
            order.append("take")
            assert [e.step for e in q.take(1)] == [0]
        assert order == ["take", "put"] and [e.step for e in q.take(1)] == [1]

    anyio.run(main)


def test_bytes_bound_a_queue_of_big_events() -> None:
    async def main() -> None:
        q = SubscriberQueue("block", 1000, max_bytes=100)
        assert q.put_nowait(_ev(0), 60)
        assert not q.put_nowait(_ev(1), 60)  # would pass 100 bytes: wait
        assert q.put_nowait(_ev(2), 0)  # small events count by number only
        assert q.statistics().queued_bytes == 60
        q.take(1)
        assert q.statistics().queued_bytes == 0 and q.put_nowait(_ev(1), 60)

    anyio.run(main)


def test_close_refuses_and_counts_discard_counts() -> None:
    async def main() -> None:
        q = SubscriberQueue("drop_oldest", 10)
        q.put_nowait(_ev(0))
        q.close()
        q.put_nowait(_ev(1))
        assert len(q) == 1 and q.statistics().dropped == 1 and q.closed
        assert len(q.discard()) == 1 and q.statistics().dropped == 2

    anyio.run(main)


@pytest.mark.parametrize("policy", ["block", "drop_oldest", "latest"])
def test_a_run_put_after_close_is_dropped_and_counted(policy: str) -> None:
    """The router checks `fits` and then may run user code (reading captures, key functions)
    before `put_all`; a queue the bus closed meanwhile counts the run dropped, as `put_nowait`
    would, never holds it queued for a subscriber given up on."""

    async def main() -> None:
        q = SubscriberQueue(policy, 10)
        assert q.fits(3)
        q.close()
        assert not q.fits(3)
        q.put_all([_ev(i) for i in range(3)])
        st = q.statistics()
        assert (st.queued, st.dropped) == (0, 3)

    anyio.run(main)


def test_an_unknown_policy_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="policy must be one of"):
        SubscriberQueue("fifo", 10)
