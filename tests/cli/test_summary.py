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
from eventbus.events import (
    DivergenceDetected,
    Loss,
    RankUnresponsive,
    RunEnded,
    RunStarted,
    StallDetected,
    StallEnded,
    StepEnded,
    StopRequested,
    StragglerDetected,
    TimeEstimate,
)
from eventbus.logformat import SKIPPED_TYPE, STATS_TYPE, header, record, write_events
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
    assert "status:     no RunEnded: the loop published no RunStarted" in out


def test_summary_shows_stalls(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with EventBus(drain_interval=0.002) as bus:
        bus.subscribe(JsonlWriter(tmp_path))
        bus.publish(StallDetected(step=19, waited_s=75.5, bound_s=60.0, stacks="...", path="s.txt"))
        bus.publish(StallEnded(step=20, stalled_s=91.25))
    assert main(["summary", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "stall @19: no step for 75.5 s (bound 60.0 s); stacks in s.txt" in out
    assert "stall ended @20: no step had ended for 91.2 s" in out
    assert main(["summary", "--json", str(tmp_path)]) == 0
    got = orjson.loads(capsys.readouterr().out)["detections"]
    assert [(d["type"], d["step"]) for d in got] == [("StallDetected", 19), ("StallEnded", 20)]
    assert got[0]["waited_s"] == 75.5 and got[1]["stalled_s"] == 91.25


def test_summary_shows_stragglers_and_silent_ranks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with EventBus(drain_interval=0.002) as bus:
        bus.subscribe(JsonlWriter(tmp_path))
        bus.publish(
            StragglerDetected(
                step=30,
                straggler=3,
                phase="forward",
                relative=2.5,
                history=1.8,
                seconds=0.025,
                fastest_s=0.01,
                scores={"0": 1.0, "3": 2.5},
            )
        )
        bus.publish(RankUnresponsive(step=31, missing_rank=2, waited_s=300.0, source="stragglers"))
    assert main(["summary", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert (
        "straggler @30: rank 3 at 2.50 x the fastest rank (25 ms against 10 ms, most in "
        "forward; 1.80 x its own history)"
    ) in out
    assert "rank 2 unresponsive @31: sent nothing for 300.0 s (stragglers)" in out
    assert main(["summary", "--json", str(tmp_path)]) == 0
    got = orjson.loads(capsys.readouterr().out)["detections"]
    assert [(d["type"], d["step"]) for d in got] == [
        ("StragglerDetected", 30),
        ("RankUnresponsive", 31),
    ]
    assert (got[0]["straggler"], got[0]["relative"], got[1]["missing_rank"]) == (3, 2.5, 2)


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


# -- several runs side by side (issue 15, item 4) ----------------------------------------------


def _run_dir(d: Path, *, run_id: str | None, lr: float, losses: list[float], rank: int = 0) -> Path:
    """A run's directory: one rank's file with a RunStarted, losses and a RunEnded."""
    d.mkdir(parents=True, exist_ok=True)
    events: list[Event] = [RunStarted(config={"lr": lr, "seed": 1}, run_id=run_id, seq=0)]
    events += [Loss(step=s, value=v, seq=s) for s, v in enumerate(losses, 1)]
    events.append(RunEnded(status="completed", seq=len(losses) + 1))
    for ev in events:
        ev.rank = rank
    path = d / f"events.rank{rank}.jsonl"
    path.write_bytes(header(rank=rank, world_size=1) + b"".join(encode(e) for e in events))
    return path


def test_two_runs_side_by_side_one_column_each(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _run_dir(tmp_path / "a", run_id="baseline", lr=0.1, losses=[3.0, 2.0, 1.5])
    _run_dir(tmp_path / "b", run_id=None, lr=0.3, losses=[4.0, 2.5])
    assert main(["summary", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split("  ")[0]: line.split() for line in lines}
    head = lines[0].split()
    assert head == ["baseline", "b"]  # RunStarted.run_id, else the directory's name
    assert rows["status"][-2:] == ["completed", "completed"]
    assert rows["train loss last"][-4:] == ["1.5", "@3", "2.5", "@2"]
    assert rows["config lr"][-2:] == ["0.1", "0.3"]
    assert "config seed" not in rows  # the same in both: not a difference
    col = lines[0].rindex(" b") + 1  # the second column starts where its name does
    first = next(line for line in lines if line.startswith("train loss first"))
    assert first[col:] == "4 @1"
    assert first[:col].split()[-2:] == ["3", "@1"]


def test_a_directory_of_runs_is_found_recursively_and_json_is_a_list(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = tmp_path / "runs"
    _run_dir(runs / "sweep" / "lr0.1", run_id=None, lr=0.1, losses=[2.0])
    _run_dir(runs / "sweep" / "lr0.3", run_id=None, lr=0.3, losses=[4.0])
    _run_dir(runs / "base", run_id=None, lr=0.2, losses=[3.0])
    _run_dir(runs / ".hidden", run_id=None, lr=9.0, losses=[9.0])
    (runs / "notes").mkdir()
    assert main(["summary", "--json", str(runs)]) == 0
    got = orjson.loads(capsys.readouterr().out)
    assert [d["run"] for d in got] == ["base", "lr0.1", "lr0.3"]
    assert [d["loss"]["train"]["last"][1] for d in got] == [3.0, 2.0, 4.0]
    # one run under a directory: the single-run summary, as for the run's own directory
    assert main(["summary", str(runs / "sweep" / "lr0.1")]) == 0
    one = capsys.readouterr().out
    assert main(["summary", "--json", str(runs / "base")]) == 0
    assert isinstance(orjson.loads(capsys.readouterr().out), dict)
    assert one.startswith("run:        ") and "steps:      1 (1 to 1)" in one


def test_rank_files_of_one_run_stay_one_run_other_files_are_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ddp = tmp_path / "ddp"
    r0 = _run_dir(ddp, run_id=None, lr=0.1, losses=[2.0], rank=0)
    r1 = _run_dir(ddp, run_id=None, lr=0.1, losses=[2.0], rank=1)
    assert main(["summary", str(r0), str(r1)]) == 0  # a shell glob of events.rank*.jsonl
    out = capsys.readouterr().out
    assert out.startswith("run:        ")
    assert "ranks 0, 1" in out
    # two files of the same rank in one directory are two runs; --merge reads them as one
    other = tmp_path / "other"
    a = _run_dir(other / "x", run_id=None, lr=0.1, losses=[2.0])
    b = (other / "again.jsonl").resolve()
    b.write_bytes(a.read_bytes())
    c = other / "first.jsonl"
    c.write_bytes(a.read_bytes())
    assert main(["summary", "--json", str(b), str(c)]) == 0
    assert [d["run"] for d in orjson.loads(capsys.readouterr().out)] == [
        "again.jsonl",
        "first.jsonl",
    ]
    assert main(["summary", "--json", "--merge", str(b), str(c)]) == 0
    merged = orjson.loads(capsys.readouterr().out)
    assert merged["files"] == [str(b), str(c)]


def test_a_run_without_events_among_several_is_left_out_saying_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _run_dir(tmp_path / "a", run_id=None, lr=0.1, losses=[2.0])
    _run_dir(tmp_path / "b", run_id=None, lr=0.1, losses=[3.0])
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "events.jsonl").write_bytes(header(rank=0))
    assert main(["summary", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines()[0].split() == ["a", "b"]
    assert "events.jsonl: no events, left out" in captured.err
    assert main(["summary", str(tmp_path / "c")]) == 2  # alone: an error, as before
    assert "no events" in capsys.readouterr().err


def test_a_later_run_written_beside_the_first_is_a_run_of_its_own(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """JsonlWriter("exp/log.jsonl") run twice: the second run is `log.run-2.jsonl`."""
    first = _run_dir(tmp_path / "exp", run_id=None, lr=0.1, losses=[2.0])
    first.rename(tmp_path / "exp" / "log.jsonl")
    second = _run_dir(tmp_path / "tmp", run_id=None, lr=0.2, losses=[5.0, 4.0])
    second.rename(tmp_path / "exp" / "log.run-2.jsonl")
    assert main(["summary", "--json", str(tmp_path / "exp")]) == 0
    got = orjson.loads(capsys.readouterr().out)
    assert [(d["run"], d["steps"]["count"]) for d in got] == [("exp", 1), ("run-2", 2)]


# -- drops by design apart from losses; stops without a step (issue 15, item 7) ----------------


def test_latest_policy_drops_are_by_design_not_losses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    subs = {
        "jsonl": {"policy": "block", "dropped": 0, "failed": 0},
        "progress": {"policy": "latest", "dropped": 2698, "failed": 0},
        "user": {"policy": "drop_oldest", "dropped": 3, "failed": 1},
        "old": {"dropped": 2, "failed": 0},  # a record from before `policy`: a loss
    }
    log = tmp_path / "events.jsonl"
    log.write_bytes(encode(Loss(step=1, value=1.0)) + record(STATS_TYPE, bus={"subscribers": subs}))
    assert main(["summary", str(log)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("losses:"))
    assert line == (
        "losses:     5 dropped, 1 failed, (user: 3 dropped, 1 failed; old: 2 dropped, 0 failed)"
        "; by design: 2,698 superseded by newer events (progress: policy latest)"
    )
    assert main(["summary", "--json", str(log)]) == 0
    losses = orjson.loads(capsys.readouterr().out)["losses"]
    assert (losses["dropped"], losses["superseded"], losses["failed"]) == (5, 2698, 1)
    assert losses["subscribers"]["progress"]["policy"] == "latest"


def test_a_stop_without_a_step_is_named_with_its_rank(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    why = "loss diverged at step 5"
    rank0: list[Event] = [Loss(step=s, value=1.0) for s in range(1, 6)]
    rank0 += [StopRequested(step=5, reason=why, source="DivergenceDetector")]
    rank1: list[Event] = [Loss(step=s, value=1.0) for s in range(1, 7)]
    rank1 += [StopRequested(step=None, reason="stop requested on rank 0", source="rank 0")]
    for rank, events in enumerate((rank0, rank1)):
        for ev in events:
            ev.rank = rank
        write_events(tmp_path / f"events.rank{rank}.jsonl", events, rank=rank)
    assert main(["summary", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "@None" not in out
    assert f"  stop @5 on rank 0 by DivergenceDetector: {why}" in out
    assert "  stop (no step) on rank 1 by rank 0: stop requested on rank 0" in out


def test_a_file_holding_two_runs_is_said_to(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A log from before runs were kept apart (two runs appended): summary and plot warn;
    a resumed run in the same file does not count as a second."""
    lines = [header(rank=0, world_size=1)]
    seq = 0
    for resumed in (None, None, 3):
        lines.append(encode(RunStarted(resumed_from_step=resumed, seq=seq, ts=1 + seq, rank=0)))
        seq += 1
        for s in range(1, 4):
            lines.append(encode(Loss(step=s, value=float(s), seq=seq, ts=1 + seq, rank=0)))
            seq += 1
    path = tmp_path / "events.jsonl"
    path.write_bytes(b"".join(lines))
    assert main(["summary", str(path)]) == 0
    out = capsys.readouterr().out
    assert "warning:    events.jsonl holds 2 runs, one after the other" in out
    assert main(["summary", "--json", str(path)]) == 0
    assert "holds 2 runs" in orjson.loads(capsys.readouterr().out)["several_runs"]
    pytest.importorskip("matplotlib")
    assert main(["plot", str(path), "-o", str(tmp_path / "p.png")]) == 0
    assert "holds 2 runs" in capsys.readouterr().err


def _eta_run(tmp_path: Path, ended: RunEnded | None) -> Path:
    events: list[Event] = [RunStarted(step=0, total_steps=1000)]
    for s in range(1, 41):
        events.append(StepEnded(step=s, ts=1_700_000_000_000_000_000 + s * 10**9))
    events.append(TimeEstimate(step=40, eta_s=3725.0, total_steps=1000, steps_per_s=0.26))
    events += [ended] if ended is not None else []
    return write_events(tmp_path / "events.jsonl", events)


def test_summary_shows_the_last_eta_of_a_run_that_did_not_finish(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = _eta_run(tmp_path, None)
    assert main(["summary", str(log)]) == 0
    out = capsys.readouterr().out
    assert "eta:        1:02:05.0 left at step 40 of 1,000 (the last estimate)" in out
    assert main(["summary", "--json", str(log)]) == 0
    d = orjson.loads(capsys.readouterr().out)
    assert d["eta"] == {"step": 40, "eta_s": 3725.0, "total_steps": 1000, "steps_per_s": 0.26}


def test_summary_shows_no_eta_for_a_completed_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = _eta_run(tmp_path, RunEnded(step=1000, status="completed"))
    assert main(["summary", str(log)]) == 0
    assert "eta:" not in capsys.readouterr().out


@pytest.mark.parametrize("total", [0, -1])
def test_summary_reads_a_placeholder_total_as_no_total(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], total: int
) -> None:
    # 0 or -1 is "unknown" (as ConsoleProgress and SpeedMonitor read it): not "of -1"
    events: list[Event] = [RunStarted(step=0, total_steps=total)]
    events += [StepEnded(step=s, ts=1_700_000_000_000_000_000 + s * 10**9) for s in (1, 2)]
    logs = [write_events(tmp_path / run / "events.jsonl", events) for run in ("a", "b")]
    assert main(["summary", str(logs[0])]) == 0
    assert "steps:      2 (1 to 2)\n" in capsys.readouterr().out
    assert main(["summary", *map(str, logs)]) == 0  # side by side: the same rule
    assert f"of {total}" not in capsys.readouterr().out
