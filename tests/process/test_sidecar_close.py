"""The sidecar's subscribers ended at close and removed mid-run: each is counted for exactly
what was published to it (before its end or removal), never for what came after."""

from __future__ import annotations

from pathlib import Path

from eventbus import EventBus
from eventbus.events import Loss
from tests.core.helpers import identity
from tests.process.subs import Tally, WhereAmI


def test_what_an_older_one_publishes_at_close_is_not_charged_to_a_newer_one_ended_before(
    tmp_path: Path,
) -> None:
    """Newest first: the newer one is ended before the older one publishes from `on_close`.
    The sidecar's answer to END was always "not here" (the REMOVE posted just before had
    taken it), so the ended one was put back to running and charged the older one's summary
    as a loss: a healthy close logged "closed with losses"."""
    bus = EventBus(drain_interval=0.002, close_timeout=20)
    older = bus.subscribe(Tally(str(tmp_path / "t")), placement="process")  # a Scalars at close
    newer = bus.subscribe(WhereAmI(str(tmp_path / "w")), placement="process")  # every event
    with bus:
        for i in range(5):
            bus.publish(Loss(step=i, value=1.0))
    st = bus.stats()
    identity(st)
    n = st[newer.name]  # type: ignore[index]
    assert (n.state, n.published, n.delivered, n.dropped) == ("closed", 5, 5, 0)
    assert st[older.name].state == "closed"  # type: ignore[index]
    assert st.sidecar is not None and st.sidecar.lost == 0
