"""`eventbus summary`: the numbers of a run, losses counted from seq numbers, not file order."""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path

import orjson
import pytest

from eventbus import Event, EventBus
from eventbus.cli import main
from eventbus.codec import encode
from eventbus.events import DivergenceDetected, Loss, StepEnded
from eventbus.logformat import SKIPPED_TYPE, STATS_TYPE, header, record
from eventbus.sinks import JsonlWriter


def test_summary_of_a_recorded_run(demo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["summary", str(demo)]) == 0
    out = capsys.readouterr().out
    assert "status:     completed" in out
    assert "steps:      60 of 60 (1 to 60)" in out
    assert "wall time:" in out
    assert "loss train: first" in out
    assert "non-finite" in out  # the blow-up is not hidden
    assert "steps/s" in out
    assert "samples/s" in out
    assert "losses:     0 dropped, 0 failed" in out
    assert "peak memory: rss 160 MB" in out


def test_summary_json_has_the_numbers(demo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["summary", "--json", str(demo)]) == 0
    d = orjson.loads(capsys.readouterr().out)
    assert d["steps"] == {"count": 60, "first": 1, "last": 60}
    loss = d["loss"]["train"]
    assert loss["first"][0] == 1
    assert loss["min"][1] <= loss["first"][1]
    assert loss["non_finite"] > 0
    assert d["throughput"]["steps_per_s"] > 0
    assert d["losses"]["dropped"] == 0
    assert d["losses"]["stats_records"] == 1
    assert d["peak_memory_mb"]["rss_mb"] == 160.0


def test_summary_reports_failures_and_detections(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def broken(ev: Event) -> None:
        raise RuntimeError("nope")

    w = JsonlWriter(tmp_path)
    bus = EventBus(drain_interval=0.002)
    bus.subscribe(w)  # first subscribed, closed last: its stats record sees the others closed
    bus.subscribe(broken, events=[Loss], policy="block")
    with bus:
        for s in range(1, 4):
            bus.publish(Loss(step=s, value=1.0))
        bus.publish(DivergenceDetected(step=3, value=9.0, baseline=1.0, reason="spike"))
    assert main(["summary", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "3 failed" in out
    assert "broken" in out
    assert "divergence @3" in out
    assert "status:     no RunEnded" in out


def test_summary_of_a_crashed_run_says_losses_are_unknown(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    log = tmp_path / "events.jsonl"
    log.write_bytes(b"".join(encode(Loss(step=s, value=1.0, seq=s)) for s in (1, 2, 5)))
    assert main(["summary", str(log)]) == 0
    out = capsys.readouterr().out
    assert "unknown (no stats record" in out
    assert "2 events missing from the log (seq gaps)" in out


# -- losses are seq numbers never seen, not seq numbers out of file order (issue 14, item 11) --


def _losses(log: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, int]:
    assert main(["summary", "--json", str(log)]) == 0
    d = orjson.loads(capsys.readouterr().out)["losses"]
    return {"seq_gaps": d["seq_gaps"], "seq_duplicates": d["seq_duplicates"]}


def _shuffled_locally(seqs: list[int], seed: int) -> list[int]:
    """The order several publishing threads give: each seq a few places from its own."""
    rng = random.Random(seed)
    out = list(seqs)
    for i in range(len(out)):
        j = min(len(out) - 1, i + rng.randint(0, 7))
        out[i], out[j] = out[j], out[i]
    return out


def _log(path: Path, seqs: list[int], *, rank: int = 0) -> Path:
    path.write_bytes(
        header(rank=rank, world_size=1)
        + b"".join(encode(Loss(step=s + 1, value=1.0, seq=s, rank=rank)) for s in seqs)
    )
    return path


def test_seqs_out_of_file_order_are_no_loss(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    seqs = _shuffled_locally(list(range(500)), seed=1)
    assert seqs != sorted(seqs)
    log = _log(tmp_path / "events.jsonl", seqs)
    assert _losses(log, capsys) == {"seq_gaps": 0, "seq_duplicates": 0}
    assert main(["summary", str(log)]) == 0
    assert "missing" not in capsys.readouterr().out


def test_real_gaps_are_counted_exactly_in_any_order(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    lost = {3, 4, 100, 250, 251, 252, 499}
    seqs = _shuffled_locally([s for s in range(501) if s not in lost], seed=2)
    log = _log(tmp_path / "events.jsonl", seqs)
    assert _losses(log, capsys)["seq_gaps"] == len(lost)
    assert main(["summary", str(log)]) == 0
    assert "7 events missing from the log (seq gaps)" in capsys.readouterr().out


def test_a_gap_wider_than_the_window_and_late_arrivals_are_exact(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # 10 arrives after 9,000 later numbers (past SeqCounter's window): it is no loss.
    seqs = [s for s in range(10_000) if s not in (10, 20)]
    seqs.append(10)
    log = _log(tmp_path / "events.jsonl", seqs)
    assert _losses(log, capsys) == {"seq_gaps": 1, "seq_duplicates": 0}


def test_seqs_count_per_file_rank_and_session(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _log(tmp_path / "events.rank0.jsonl", list(range(100)), rank=0)
    _log(tmp_path / "events.rank1.jsonl", [s for s in range(100) if s != 50], rank=1)
    with open(tmp_path / "events.rank0.jsonl", "ab") as f:  # a resumed run: seq starts over
        f.write(header(rank=0, world_size=1))
        f.write(b"".join(encode(Loss(step=s, value=1.0, seq=s, rank=0)) for s in range(40)))
    assert _losses(tmp_path, capsys) == {"seq_gaps": 1, "seq_duplicates": 0}


def test_a_skipped_event_is_counted_once_not_as_a_gap_too(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    log = tmp_path / "events.jsonl"
    log.write_bytes(
        header(rank=0)
        + encode(Loss(step=1, value=1.0, seq=0))
        + record(SKIPPED_TYPE, reason="oversize", event_type="Loss", step=2, seq=1, rank=0)
        + encode(Loss(step=3, value=1.0, seq=2))
    )
    assert _losses(log, capsys)["seq_gaps"] == 0
    assert main(["summary", str(log)]) == 0
    out = capsys.readouterr().out
    assert "1 events skipped" in out
    assert "missing" not in out


def test_several_threads_publishing_report_no_loss(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    bus = EventBus(drain_interval=0.002)
    bus.subscribe(JsonlWriter(tmp_path))
    start = threading.Barrier(4)

    def publish(k: int) -> None:
        start.wait()
        for s in range(500):
            bus.publish(StepEnded(step=s, samples=k))

    with bus:
        threads = [threading.Thread(target=publish, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert _losses(tmp_path, capsys) == {"seq_gaps": 0, "seq_duplicates": 0}


def test_json_summary_of_sums_past_64_bits(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    log = tmp_path / "events.jsonl"
    big = record(STATS_TYPE, bus={"published": 2**64 - 1})
    log.write_bytes(encode(Loss(step=1, value=1.0)) + big + big)
    assert main(["summary", "--json", str(log)]) == 0
    assert json.loads(capsys.readouterr().out)["losses"]["bus"]["published"] == 2**65 - 2
