"""eventbus.torch.profile(): torch.profiler windows stepped by bus.step() scopes; trace and
table written off the training thread; ProfileSaved says where."""

from __future__ import annotations

import gc
import json
import threading
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from eventbus import EventBus
from eventbus._torch_profile_table import main as table_main
from eventbus._torch_profile_table import trace_table
from eventbus.events import ProfileSaved
from eventbus.torch import ProfileWindows, profile
from tests.conftest import Recorder

pytestmark = [  # torch's own notes on the schedules these tests use
    pytest.mark.filterwarnings("ignore:Warning. Profiler clears events:UserWarning"),
    pytest.mark.filterwarnings("ignore:Profiler won't be using warmup:UserWarning"),
]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _work(model: torch.nn.Module) -> None:
    model(torch.randn(8, 32)).sum().backward()


def _bus() -> EventBus:
    return EventBus(drain_interval=0.002, close_timeout=30)


def test_windows_follow_bus_step_scopes_and_say_where_they_are(tmp_path: Path) -> None:
    bus, rec, model = _bus(), Recorder(events=[ProfileSaved]), _model()
    bus.subscribe(rec)
    schedule = torch.profiler.schedule(wait=1, warmup=1, active=2, repeat=2)
    with bus, profile(bus, schedule=schedule, out_dir=tmp_path) as p:
        for step in range(1, 11):
            with bus.step(step):
                _work(model)
    assert [(e.first_step, e.step, e.steps) for e in p.saved] == [(3, 4, 2), (7, 8, 2)]
    assert [e.step for e in rec.got] == [4, 8]  # published on the bus
    first = p.saved[0]
    trace = json.loads(Path(first.path).read_text())
    steps = {e["name"] for e in trace["traceEvents"] if e.get("cat") == "user_annotation"}
    assert steps == {"ProfilerStep#2", "ProfilerStep#3"}  # torch counts from 0: steps 3 and 4
    table = Path(first.table_path).read_text()
    assert "aten::addmm" in table and "# of Calls" in table
    assert (p.dropped, p.failed) == (0, 0)


def test_the_export_runs_off_the_training_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    exporters: list[int] = []
    original = torch.autograd.profiler.profile.export_chrome_trace

    def spy(self: Any, path: str, *args: Any, **kwargs: Any) -> Any:
        exporters.append(threading.get_ident())
        return original(self, path, *args, **kwargs)

    monkeypatch.setattr(torch.autograd.profiler.profile, "export_chrome_trace", spy)
    bus, model = _bus(), _model()
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=1, repeat=2)
    with bus, profile(bus, schedule=schedule, out_dir=tmp_path, table=False) as p:
        for step in range(1, 5):
            with bus.step(step):
                _work(model)
    assert len(exporters) == 2
    assert threading.get_ident() not in exporters
    assert [e.table_path for e in p.saved] == ["", ""]


def test_a_window_still_recording_at_exit_is_saved(tmp_path: Path) -> None:
    bus, model = _bus(), _model()
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=5, repeat=1)
    with bus, profile(bus, schedule=schedule, out_dir=tmp_path, table=False) as p:
        for step in range(1, 4):  # warm-up 1, then two of the five active steps
            with bus.step(step):
                _work(model)
    assert [(e.first_step, e.step, e.steps) for e in p.saved] == [(2, 3, 2)]


def test_nested_scopes_step_once_and_a_loop_without_scopes_steps_by_hand(tmp_path: Path) -> None:
    bus, model = _bus(), _model()
    schedule = torch.profiler.schedule(wait=0, warmup=0, active=2, repeat=1)
    with bus, profile(bus, schedule=schedule, out_dir=tmp_path / "a", table=False) as p:
        for step in (1, 2):
            with bus.step(step), bus.step(step):  # micro-steps inside a step: one step
                _work(model)
    assert [(e.first_step, e.step) for e in p.saved] == [(1, 2)]
    with profile(bus, schedule=schedule, out_dir=tmp_path / "b", table=False) as q:
        for step in (10, 11):
            _work(model)
            q.step(step)
    assert [(e.first_step, e.step) for e in q.saved] == [(10, 11)]


def test_windows_beyond_what_the_writer_holds_are_dropped_and_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    writing = threading.Event()

    def slow(self: ProfileWindows, trace: Path, table: Path) -> None:
        writing.set()
        assert release.wait(30)

    monkeypatch.setattr(ProfileWindows, "_write_table", slow)
    bus, model = _bus(), _model()
    schedule = torch.profiler.schedule(wait=0, warmup=0, active=1, repeat=3)
    with bus, profile(bus, schedule=schedule, out_dir=tmp_path, max_pending=1) as p:
        with bus.step(1):
            _work(model)
        assert writing.wait(30)  # the writer holds window 1
        for step in (2, 3):  # window 2 waits; window 3 finds no room
            with bus.step(step):
                _work(model)
        assert p.dropped == 1
        release.set()
    assert [e.step for e in p.saved] == [1, 2]


def test_the_table_built_from_the_trace_is_torch_s_own(tmp_path: Path) -> None:
    model = _model()
    with torch.profiler.profile() as prof:
        for _ in range(3):
            _work(model)
    prof.export_chrome_trace(str(tmp_path / "t.json"))

    def rows(text: str) -> set[tuple[str, str]]:  # (name, number of calls) of each row
        return {
            (parts[0], parts[-1])
            for line in text.splitlines()
            if (parts := line.split()) and parts[0].startswith(("aten::", "autograd::"))
        }

    mine = trace_table(
        json.loads((tmp_path / "t.json").read_text()), sort_by="cpu_time_total", row_limit=100
    )
    theirs = prof.key_averages().table(sort_by="cpu_time_total", row_limit=100)
    assert rows(mine) == rows(theirs)
    assert len(rows(mine)) > 5
    opts = ["--sort-by", "cpu_time_total", "--row-limit", "100"]
    assert table_main([str(tmp_path / "t.json"), str(tmp_path / "t.txt"), *opts]) == 0
    assert rows((tmp_path / "t.txt").read_text()) == rows(theirs)
    assert table_main([str(tmp_path / "missing.json"), str(tmp_path / "x.txt")]) == 2


def test_bad_arguments_are_clear(tmp_path: Path) -> None:
    bus = _bus()
    with pytest.raises(TypeError, match=r"schedule must be torch\.profiler\.schedule"):
        profile(bus, schedule=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="sets on_trace_ready itself"):
        profile(bus, on_trace_ready=print)
    with pytest.raises(ValueError, match="row_limit must be an int >= 1"):
        profile(bus, row_limit=0)
    with pytest.raises(ValueError, match="sort_by must be one of count, cpu_memory_usage"):
        profile(bus, sort_by="self_cpu_time")  # a typo: every window's table would fail
    assert profile(bus, sort_by="self_cuda_time_total").sort_by == "self_cuda_time_total"
    with pytest.raises(TypeError, match="ProfilerActivity"):
        profile(bus, activities=["cpu"])  # type: ignore[list-item]
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OSError, match="cannot create out_dir"), profile(bus, out_dir=blocker / "x"):
        pass
    bus.close()


@pytest.mark.slow
def test_the_cost_benchmark_runs() -> None:
    from benchmarks import profile_cost

    out = profile_cost.run(quick=True)
    assert out["ops"] > 1000 and out["window_end_ms"] > 0
    for name in ("trace", "table", "child"):
        assert out[name]["work_s"] > 0, name


def test_a_table_that_fails_leaves_the_trace_said_and_counted(tmp_path: Path) -> None:
    bus, rec = _bus(), Recorder(events=[ProfileSaved])
    bus.subscribe(rec)
    model = _model()
    (tmp_path / "rank0.window1.step2.table.txt").mkdir()  # the table cannot be written there
    sched = torch.profiler.schedule(wait=0, warmup=1, active=1, repeat=1)
    with bus, profile(bus, schedule=sched, out_dir=tmp_path) as p:
        for step in range(1, 4):
            with bus.step(step):
                _work(model)
    assert p.failed == 1
    (ev,) = rec.got
    assert isinstance(ev, ProfileSaved) and ev.table_path == ""
    assert ev.path == str(tmp_path / "rank0.window1.step2.pt.trace.json")
    assert Path(ev.path).stat().st_size > 0


def test_a_second_profile_while_one_runs_is_refused(tmp_path: Path) -> None:
    """torch runs one profiler at a time: a second one broke the first (a crash at export)."""
    bus, model = _bus(), _model()
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=2, repeat=1)
    with bus, profile(bus, schedule=schedule, out_dir=tmp_path / "a", table=False) as p:
        with pytest.raises(RuntimeError, match="already running"):
            p.__enter__()
        other = profile(bus, schedule=schedule, out_dir=tmp_path / "b", table=False)
        with pytest.raises(RuntimeError, match="already running"), other:
            pass
        for step in range(1, 5):
            with bus.step(step):
                _work(model)
    assert [(e.first_step, e.step) for e in p.saved] == [(2, 3)]
    assert not [t for t in threading.enumerate() if t.name == "eventbus-profile"]
    with profile(bus, schedule=schedule, out_dir=tmp_path / "c", table=False):
        pass  # one after the other is fine


def test_a_written_window_is_let_go_before_the_next_one_arrives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer keeps no window it wrote: a window's buffers may be large."""
    windows: list[weakref.ref[Any]] = []
    ready = ProfileWindows._ready

    def spy(self: ProfileWindows, prof: Any) -> None:
        windows.append(weakref.ref(prof.profiler))
        ready(self, prof)

    monkeypatch.setattr(ProfileWindows, "_ready", spy)
    bus, model, written = _bus(), _model(), threading.Event()
    bus.subscribe(lambda ev: written.set(), events=[ProfileSaved])
    schedule = torch.profiler.schedule(wait=0, warmup=0, active=1, repeat=2)
    with bus, profile(bus, schedule=schedule, out_dir=tmp_path, table=False):
        with bus.step(1):
            _work(model)
        assert written.wait(30)  # window 1 is written; window 2 records
        gc.collect()
        assert windows[0]() is None
