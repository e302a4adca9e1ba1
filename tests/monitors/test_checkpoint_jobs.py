"""CheckpointJobs: a command or a function per CheckpointSaved, in a process of its own; its
metrics come back as EvalEnded; failures are counted; concurrency and the queue are bounded."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from eventbus import EventBus
from eventbus.config import subscriber_from_spec
from eventbus.events import CheckpointSaved, EvalEnded
from eventbus.monitors import CheckpointJobs
from tests.conftest import Recorder

PY = sys.executable


def evaluate(path: str) -> dict[str, float]:
    """A job function: runs in a spawned process (it imports this module by name)."""
    return {"path_len": float(len(path)), "pid": float(os.getpid())}


def explode(path: str) -> dict[str, float]:
    raise ValueError(f"no model at {path}")


def start_a_worker_and_wait(path: str) -> dict[str, float]:
    """A job function that starts a process of its own (its pid written to `path` as soon as
    it exists, not once its interpreter is up), then runs on past any timeout."""
    import subprocess
    import sys
    import time

    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with open(path, "w") as f:
        f.write(str(worker.pid))
    time.sleep(60)
    return {}


def start_a_multiprocessing_worker(path: str) -> dict[str, float]:
    """A job function whose work uses multiprocessing, as a DataLoader with workers does."""
    import multiprocessing

    worker = multiprocessing.get_context("fork").Process(target=int)
    worker.start()
    worker.join()
    return {"worker_exit": float(worker.exitcode or 0)}


def where_it_runs(path: str) -> dict[str, float]:
    """A job function that reports its environment and working directory."""
    return {
        "env": float(os.environ.get("EVAL_FLAG") == "on"),
        "cwd": float(os.getcwd() == os.environ.get("WANT_CWD")),
    }


def path_is_a_file(path: str) -> dict[str, float]:
    return {"found": float(os.path.isfile(path))}


def _bus() -> EventBus:
    return EventBus(drain_interval=0.002, close_timeout=30)


def _until(check: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _script(body: str) -> list[str]:
    return [PY, "-c", body, "{path}"]


def test_a_command_s_last_line_comes_back_as_eval_ended(tmp_path: Path) -> None:
    bus, rec = _bus(), Recorder(events=[EvalEnded])
    bus.subscribe(rec)
    jobs = CheckpointJobs(
        command=_script(
            "import json, os, sys; print('loading', sys.argv[1]); "
            "step = int(os.environ['EVENTBUS_CHECKPOINT_STEP']); "
            "print(json.dumps({'eval_loss': 0.5, 'step_env': step}))"
        )
    )
    bus.subscribe(jobs)
    with bus:
        bus.publish(CheckpointSaved(step=100, path=str(tmp_path / "ckpt-100.pt")))
    (ev,) = rec.got
    assert isinstance(ev, EvalEnded)
    assert ev.step == 100
    assert ev.metrics == {"eval_loss": 0.5, "step_env": 100}
    assert ev.duration_s is not None and ev.duration_s > 0
    st = bus.stats()["checkpoint_jobs"]
    assert (st.delivered, st.failed) == (1, 0)


def test_a_function_runs_in_another_process_and_its_dict_comes_back() -> None:
    bus, rec = _bus(), Recorder(events=[EvalEnded])
    bus.subscribe(rec)
    bus.subscribe(CheckpointJobs(fn=evaluate))
    bus.subscribe(subscriber_from_spec(f"checkpoint_jobs:fn={__name__}:evaluate"))
    with bus:
        bus.publish(CheckpointSaved(step=7, path="ckpt-7"))
    assert len(rec.got) == 2
    for ev in rec.got:
        assert isinstance(ev, EvalEnded) and ev.step == 7
        assert ev.metrics["path_len"] == len("ckpt-7")
        assert ev.metrics["pid"] != os.getpid()  # never on the training process


@pytest.mark.parametrize(
    ("jobs", "why"),
    [
        (
            CheckpointJobs(
                command=_script("import sys; print('oops', file=sys.stderr); sys.exit(3)")
            ),
            "exited with 3: oops",
        ),
        (CheckpointJobs(command=_script("print('done, no metrics here')")), "is not JSON"),
        (CheckpointJobs(command=_script("print('[1, 2]')")), "must be a dict"),
        (CheckpointJobs(fn=explode), "ValueError: no model at ckpt"),
    ],
    ids=["exit-code", "not-json", "not-a-dict", "exception"],
)
def test_failures_are_counted_like_any_subscriber_s(jobs: CheckpointJobs, why: str) -> None:
    bus, rec = _bus(), Recorder(events=[EvalEnded])
    bus.subscribe(rec)
    bus.subscribe(jobs)
    with bus:
        bus.publish(CheckpointSaved(step=1, path="ckpt-1"))
        bus.publish(CheckpointSaved(step=2, path="ckpt-2"))
    st = bus.stats()["checkpoint_jobs"]
    assert (st.delivered, st.failed) == (0, 2)  # each failed; the second still ran
    assert st.error is not None and why in st.error
    assert "checkpoint job for step 2" in jobs.failures[-1]
    assert rec.got == []


def test_in_a_batch_only_the_jobs_that_failed_count_failed(tmp_path: Path) -> None:
    body = (  # c1 waits for its go-file, so that c2 and c3 queue and run as one batch
        "import json, os, pathlib, sys, time\n"
        "p = pathlib.Path(sys.argv[1]); (p.parent / (p.name + '.started')).touch()\n"
        "while p.name == 'c1' and not os.path.exists(sys.argv[1] + '.go'): time.sleep(0.01)\n"
        "sys.exit(3) if p.name.endswith('bad') else print(json.dumps({'ok': 1}))"
    )
    jobs = CheckpointJobs(command=_script(body), max_concurrent=2)
    bus, rec = _bus(), Recorder(events=[EvalEnded])
    bus.subscribe(rec)
    bus.subscribe(jobs)
    with bus:
        bus.publish(CheckpointSaved(step=1, path=str(tmp_path / "c1")))
        _until((tmp_path / "c1.started").exists, "job 1 to start")
        bus.publish(CheckpointSaved(step=2, path=str(tmp_path / "c2")))
        bus.publish(CheckpointSaved(step=3, path=str(tmp_path / "c3-bad")))
        _until(lambda: bus.stats()["checkpoint_jobs"].published == 3, "jobs 2 and 3 to queue")
        (tmp_path / "c1.go").touch()
    st = bus.stats()["checkpoint_jobs"]
    assert (st.delivered, st.failed) == (2, 1)  # job 2 ran beside job 3 and succeeded
    assert sorted(e.step for e in rec.got if isinstance(e, EvalEnded)) == [1, 2]
    assert [f.split(" (")[0] for f in jobs.failures] == ["checkpoint job for step 3"]


def test_a_timeout_kills_the_job_and_counts_it(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    jobs = CheckpointJobs(
        command=_script(
            f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
        ),
        timeout=3.0,  # the job's interpreter writes its pid well before
    )
    bus = _bus()
    bus.subscribe(jobs)
    t0 = time.monotonic()
    with bus:
        bus.publish(CheckpointSaved(step=1, path="ckpt-1"))
    assert time.monotonic() - t0 < 20
    assert bus.stats()["checkpoint_jobs"].failed == 1
    assert "timed out after 3 s and was killed" in jobs.failures[0]
    with pytest.raises(ProcessLookupError):  # killed and reaped before the failure was counted
        os.kill(int(pid_file.read_text()), 0)


def _gone(pid: int) -> bool:
    """No such process, or a zombie waiting for whoever adopted it: it runs no more."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_timeout_kills_what_the_job_started_too(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    worker = "import time; time.sleep(60)"
    jobs = CheckpointJobs(  # a job that starts a worker of its own, as a shell or torchrun does
        command=_script(
            "import subprocess, sys, time; "
            f"w = subprocess.Popen([sys.executable, '-c', {worker!r}]); "
            f"open({str(pid_file)!r}, 'w').write(str(w.pid)); time.sleep(60)"
        ),
        # The job's interpreter must start and fork before this; the worker's need not (its
        # pid is written as soon as it exists). Loaded CI machines took more than 3 s.
        timeout=8.0,
    )
    _run_one_that_times_out(jobs, "ckpt-1")
    assert "timed out after 8 s and was killed" in jobs.failures[0]
    _assert_killed(pid_file, "the job's own child")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_timeout_kills_what_a_function_job_started_too(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    # The job's interpreter must start and import the function before this (seconds on a
    # loaded machine); its worker's need not.
    jobs = CheckpointJobs(fn=start_a_worker_and_wait, timeout=8.0)
    _run_one_that_times_out(jobs, str(pid_file))
    assert "timed out after 8 s and was killed" in jobs.failures[0]
    _assert_killed(pid_file, "the function's own child")


def _run_one_that_times_out(jobs: CheckpointJobs, path: str) -> None:
    bus = _bus()
    bus.subscribe(jobs)
    with bus:
        bus.publish(CheckpointSaved(step=1, path=path))


def _assert_killed(pid_file: Path, what: str) -> None:
    """The process whose pid the job's own child wrote is gone (killed with the job)."""
    pid = int(pid_file.read_text())
    try:
        _until(lambda: _gone(pid), f"{what} to be killed", timeout=10)
    finally:
        if not _gone(pid):
            os.kill(pid, 9)


def test_concurrency_is_bounded_and_the_queue_drops_the_oldest(tmp_path: Path) -> None:
    body = (  # each job says it started, then waits for its own go-file
        "import json, os, pathlib, sys, time\n"
        "p = pathlib.Path(sys.argv[1]); (p.parent / (p.name + '.started')).touch()\n"
        "while not os.path.exists(sys.argv[1] + '.go'): time.sleep(0.01)\n"
        "print(json.dumps({'ok': 1}))"
    )
    jobs = CheckpointJobs(command=_script(body), max_concurrent=2, max_queued=3)
    bus = _bus()
    bus.subscribe(jobs)

    def started() -> set[str]:
        return {p.name.removesuffix(".started") for p in tmp_path.glob("*.started")}

    def go(*names: str) -> None:
        for n in names:
            (tmp_path / f"{n}.go").touch()

    with bus:
        bus.publish(CheckpointSaved(step=1, path=str(tmp_path / "c1")))
        _until(lambda: started() == {"c1"}, "job 1 to start")
        for s in (2, 3, 4, 5):  # the queue holds 3: c2 is dropped
            bus.publish(CheckpointSaved(step=s, path=str(tmp_path / f"c{s}")))
        _until(lambda: bus.stats()["checkpoint_jobs"].dropped == 1, "the drop")
        go("c1")
        _until(lambda: started() == {"c1", "c3", "c4"}, "jobs 3 and 4 to run together")
        assert "c5" not in started()  # never more than max_concurrent at once
        go("c3", "c4")
        _until(lambda: "c5" in started(), "job 5 to start")
        go("c5")
    assert sorted(ev.step for ev in jobs.results if ev.step is not None) == [1, 3, 4, 5]
    st = bus.stats()["checkpoint_jobs"]
    assert (st.delivered, st.dropped, st.failed) == (4, 1, 0)


def test_close_waits_for_a_running_job() -> None:
    jobs = CheckpointJobs(command=_script("import json, time; time.sleep(1); print('{\"a\": 1}')"))
    bus = _bus()
    bus.subscribe(jobs)
    with bus:
        bus.publish(CheckpointSaved(step=3, path="ckpt-3"))
    assert [(ev.step, ev.metrics) for ev in jobs.results] == [(3, {"a": 1})]


def test_the_close_deadline_kills_a_job_that_runs_on(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    jobs = CheckpointJobs(
        command=_script(
            f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
        )
    )
    bus = _bus()
    bus.subscribe(jobs)
    bus.start()
    bus.publish(CheckpointSaved(step=1, path="ckpt-1"))
    _until(pid_file.exists, "the job to start")
    t0 = time.monotonic()
    bus.close(timeout=1.0)
    assert time.monotonic() - t0 < 10
    pid = int(pid_file.read_text())

    def gone() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False

    _until(gone, "the job's process to be killed")


def test_runs_in_the_sidecar_too() -> None:
    bus, rec = _bus(), Recorder(events=[EvalEnded])
    bus.subscribe(rec)
    bus.subscribe(
        CheckpointJobs(command=_script("import json; print(json.dumps({'x': 2.5}))")),
        placement="process",
    )
    with bus:
        bus.publish(CheckpointSaved(step=9, path="ckpt-9"))
        bus.flush()
        _until(lambda: len(rec.got) == 1, "the sidecar's EvalEnded")
    assert [(e.step, e.metrics) for e in rec.got if isinstance(e, EvalEnded)] == [(9, {"x": 2.5})]


def test_bad_arguments_are_clear() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        CheckpointJobs()
    with pytest.raises(ValueError, match="exactly one"):
        CheckpointJobs(command=["true"], fn=evaluate)
    with pytest.raises(ValueError, match="max_concurrent must be an int >= 1"):
        CheckpointJobs(command=["true"], max_concurrent=0)
    with pytest.raises(ValueError, match="timeout"):
        CheckpointJobs(command=["true"], timeout=-1)
    with pytest.raises(ValueError, match="not found"):
        CheckpointJobs(command=["no-such-program-here", "{path}"])
    with pytest.raises(TypeError, match="define it at module level"):
        CheckpointJobs(fn=lambda path: {"a": 1.0})
    with pytest.raises(ValueError, match="'module:function'"):
        CheckpointJobs(fn="evaluate")
    with pytest.raises(ValueError, match="no module 'no_such_eval_module' is importable"):
        CheckpointJobs(fn="no_such_eval_module:evaluate")


def test_a_path_that_names_step_is_passed_as_it_is(tmp_path: Path) -> None:
    """The fields are filled in one pass: a checkpoint path containing "{step}" is not
    rewritten by the step substitution that follows the path's."""
    bus, rec = _bus(), Recorder(events=[EvalEnded])
    bus.subscribe(rec)
    path = str(tmp_path / "run-{step}" / "ckpt.pt")
    body = (  # the expected path travels hex-encoded: no "{step}" in it to be filled
        "import json, sys; "
        f"print(json.dumps({{'same': float(sys.argv[1] == bytes.fromhex('{path.encode().hex()}')"
        ".decode() and sys.argv[2] == '7')}))"
    )
    bus.subscribe(CheckpointJobs(command=[PY, "-c", body, "{path}", "{step}"]))
    with bus:
        bus.publish(CheckpointSaved(step=7, path=path))
    (ev,) = rec.got
    assert isinstance(ev, EvalEnded)
    assert ev.metrics == {"same": 1.0}


def test_jobs_never_run_on_the_training_thread() -> None:
    seen: list[int] = []
    bus = _bus()
    jobs = CheckpointJobs(command=_script("print('{\"a\": 1}')"))
    bus.subscribe(jobs)
    bus.subscribe(lambda ev: seen.append(threading.get_ident()), events=[EvalEnded])
    with bus:
        bus.publish(CheckpointSaved(step=1, path="c"))
    assert seen and threading.get_ident() not in seen


def test_a_function_job_may_start_processes_of_its_own() -> None:
    """The job's process is not daemonic: a DataLoader's workers may start in it."""
    jobs = CheckpointJobs(fn=start_a_multiprocessing_worker)
    bus = _bus()
    bus.subscribe(jobs)
    with bus:
        bus.publish(CheckpointSaved(step=1, path="ckpt-1"))
    assert jobs.failures == []
    assert [ev.metrics for ev in jobs.results] == [{"worker_exit": 0.0}]


def test_env_and_cwd_reach_a_function_job(tmp_path: Path) -> None:
    env = {"EVAL_FLAG": "on", "WANT_CWD": str(tmp_path)}
    jobs = CheckpointJobs(fn=where_it_runs, env=env, cwd=tmp_path)
    bus = _bus()
    bus.subscribe(jobs)
    with bus:
        bus.publish(CheckpointSaved(step=1, path="ckpt-1"))
    assert jobs.failures == []
    assert [ev.metrics for ev in jobs.results] == [{"env": 1.0, "cwd": 1.0}]


@pytest.mark.parametrize("kind", ["command", "fn"])
def test_a_relative_path_names_the_same_file_in_a_job_with_its_own_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "evals").mkdir()
    (tmp_path / "run" / "ckpt-1.pt").write_text("weights")
    monkeypatch.chdir(tmp_path)
    if kind == "command":
        body = (
            "import json, os, sys; print(json.dumps({'found': float(os.path.isfile(sys.argv[1]))}))"
        )
        jobs = CheckpointJobs(command=_script(body), cwd="evals")
    else:
        jobs = CheckpointJobs(fn=path_is_a_file, cwd="evals")
    bus = _bus()
    bus.subscribe(jobs)
    with bus:
        bus.publish(CheckpointSaved(step=1, path=os.path.join("run", "ckpt-1.pt")))
    assert [ev.metrics for ev in jobs.results] == [{"found": 1.0}]


def test_a_path_no_process_can_take_fails_its_job_only(tmp_path: Path) -> None:
    """A NUL byte in the path (or env) made starting the process raise ValueError, which
    escaped the job and cancelled the others handed over with it."""
    bus, rec = _bus(), Recorder(events=[EvalEnded])
    bus.subscribe(rec)
    jobs = CheckpointJobs(command=_script("import json; print(json.dumps({'ok': 1}))"))
    bus.subscribe(jobs)
    with bus:
        bus.publish(CheckpointSaved(step=1, path="bad\x00path"))
        bus.publish(CheckpointSaved(step=2, path=str(tmp_path / "ckpt-2")))
    assert [ev.step for ev in rec.got] == [2]
    assert bus.stats()["checkpoint_jobs"].failed == 1
    assert "cannot run" in jobs.failures[0] and "null byte" in jobs.failures[0]


def test_a_blank_line_after_the_metrics_is_not_the_last_line() -> None:
    bus, rec = _bus(), Recorder(events=[EvalEnded])
    bus.subscribe(rec)
    body = "import json; print(json.dumps({'eval_loss': 0.25})); print('   '); print('\\t\\r')"
    bus.subscribe(CheckpointJobs(command=_script(body)))
    with bus:
        bus.publish(CheckpointSaved(step=3, path="ckpt-3"))
    assert [ev.metrics for ev in rec.got] == [{"eval_loss": 0.25}]
