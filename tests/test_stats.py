"""eventbus.stats: the counters a user trusts, their sums, and the report at close."""

from __future__ import annotations

import json
import logging

import pytest

from eventbus.stats import BusStats, SubscriberStats, log_close


def _sub(name: str, policy: str = "block", **kw: int | str) -> SubscriberStats:
    base: dict[str, object] = dict(
        name=name,
        policy=policy,
        state="closed",
        published=10,
        delivered=10,
        dropped=0,
        failed=0,
        queued=0,
        queue_high_water=3,
        latency_p50_ms=None,
        latency_p99_ms=None,
        latency_max_ms=None,
    )
    base.update(kw)
    return SubscriberStats(**base)  # type: ignore[arg-type]


def _bus(*subs: SubscriberStats, **kw: object) -> BusStats:
    base: dict[str, object] = dict(
        published=10,
        rejected=0,
        inbox_size=0,
        inbox_high_water=5,
        blocked_s=0.0,
        wakeups=0,
        subscribers={s.name: s for s in subs},
    )
    base.update(kw)
    return BusStats(**base)  # type: ignore[arg-type]


def test_sums_and_lookup_by_name() -> None:
    st = _bus(_sub("a", delivered=7, dropped=2, failed=1), _sub("b", dropped=3, delivered=7))
    assert st.dropped == 5 and st.failed == 1 and st["a"].delivered == 7
    with pytest.raises(KeyError):
        st["missing"]


def test_as_dict_is_plain_json() -> None:
    st = _bus(_sub("a"), hung=("x",), error="RuntimeError: boom")
    d = json.loads(json.dumps(st.as_dict()))
    assert d["subscribers"]["a"]["published"] == 10 and d["hung"] == ["x"]
    assert d["error"] == "RuntimeError: boom" and d["feedback_dropped"] == 0


@pytest.mark.parametrize(
    ("stats", "level"),
    [
        (_bus(_sub("a")), None),  # nothing to say
        (_bus(_sub("a", policy="latest", dropped=4, delivered=6)), logging.INFO),  # by design
        (_bus(_sub("a", dropped=1, delivered=9)), logging.WARNING),
        (_bus(_sub("a", failed=1, delivered=9)), logging.WARNING),
        (_bus(_sub("a", state="hung"), hung=("a",)), logging.WARNING),
        (_bus(_sub("a"), rejected=2), logging.WARNING),
        (_bus(_sub("a"), feedback_dropped=3), logging.WARNING),
        (_bus(_sub("a"), error="RuntimeError: boom"), logging.WARNING),
    ],
)
def test_the_close_report_warns_on_every_loss(
    stats: BusStats, level: int | None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG, logger="eventbus"):
        log_close(stats)
    levels = [r.levelno for r in caplog.records if r.name == "eventbus"]
    assert levels == ([] if level is None else [level])
