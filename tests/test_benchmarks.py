"""Smoke tests: tiny runs of every benchmark, so the code cannot rot (no timing targets here)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from benchmarks import __main__ as bench_main
from benchmarks import overhead, real_loop, stall, throughput, wakeups
from benchmarks._gpt import GPT
from benchmarks._util import (
    blockwise_inflation,
    interleave_blocks,
    interleave_calls,
    machine,
    peak_rss_mb,
    percentile,
    summarize,
    versions,
)


def _positive_numbers(d: dict[str, Any], keys: list[str]) -> None:
    for k in keys:
        v = d[k]
        assert isinstance(v, int | float), f"{k} = {v!r}"
        assert math.isfinite(v), f"{k} = {v!r}"
        assert v > 0, f"{k} = {v!r}"


def test_percentiles_and_summary() -> None:
    s = summarize(float(x) for x in range(1, 101))
    assert s["p50"] in (50.0, 51.0)
    assert s["p99"] in (99.0, 100.0)
    assert s["mean"] == pytest.approx(50.5)
    assert s["n"] == 100
    assert percentile([7.0], 99) == 7.0


def test_percentile_of_nothing_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="no samples"):
        percentile([], 50)


def test_interleaving_rotates_the_order() -> None:
    order: list[str] = []

    def variant(name: str) -> Any:
        def fn(block: int) -> list[float]:
            order.append(name)
            return [1.0]

        return fn

    out = interleave_blocks({"a": variant("a"), "b": variant("b")}, blocks=2)
    assert order == ["a", "b", "b", "a"]
    assert out == {"a": [[1.0], [1.0]], "b": [[1.0], [1.0]]}
    assert blockwise_inflation([[2.0], [2.0]], [[1.0], [1.0]]) == pytest.approx(1.0)

    calls = interleave_calls({"x": (lambda n: list(range(n)), lambda a: None)}, rounds=2, calls=10)
    assert len(calls["x"]) == 20
    assert all(v >= 0 for v in calls["x"])


def test_machine_and_versions_describe_this_run() -> None:
    m = machine()
    assert m["cpus"] >= 1
    assert m["python"]
    v = versions()
    assert v["torch"]
    assert v["eventbus"]
    assert peak_rss_mb() > 10


def test_overhead_tiny_run_has_every_contender() -> None:
    out = overhead.run(rounds=1, calls=50)
    for key in (
        "eventbus_publish",
        "eventbus_publish_1sub",
        "eventbus_publish_tensor",
        "sync_list_4",
        "blinker_4",
        "hf_callbackhandler_4",
        "lightning_hooks_4",
    ):
        assert out[f"overhead.{key}_p50_ns"] <= out[f"overhead.{key}_p99_ns"]
    _positive_numbers(
        out,
        [
            f"overhead.{k}_p50_ns"
            for k in (
                "eventbus_publish",
                "hf_callbackhandler_4",
                "lightning_hooks_4",
                "blinker_4",
                "sync_list_4",
            )
        ],
    )
    assert out["overhead.eventbus_published"] == 150  # 3 publishing contenders x 50 on bus4
    assert out["overhead.eventbus_fast_delivered"] == 3 * 150  # nothing lost to fast ones


def test_stall_tiny_run_loses_nothing_lossless(tmp_path: Path) -> None:
    out, samples = stall.measure(blocks=1, steps=stall.WARMUP_STEPS + 3)
    for v in stall.VARIANTS:
        assert len(samples[v]) == 3, v
        _positive_numbers(out, [f"stall.{v}_p50_ms", f"stall.{v}_p99_ms"])
    # The inline variant sleeps 50 ms in every step; the bus variant must not.
    assert out["stall.inline_p50_ms"] >= 50
    assert out["stall.eventbus_jsonl_lost"] == 0
    assert 0 < out["stall.eventbus_publish_us_in_place_p50"] < 1e6  # three publishes, timed
    assert out["stall.eventbus_others_failed"] == 0
    png = tmp_path / "steps.png"
    stall.plot(samples, png)
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_throughput_tiny_run_counts_every_line() -> None:
    out = throughput.run(events=3000)
    assert out["throughput.events"] == 3000
    assert out["throughput.lines_on_disk"] == 3000
    assert out["throughput.lost"] == 0
    _positive_numbers(out, ["throughput.events_per_s", "throughput.rss_peak_mb"])


def test_wakeups_tiny_run() -> None:
    out = wakeups.run(blocks=2, steps=wakeups.WARMUP_STEPS + 10)
    assert out["wakeups.steps_per_variant"] == 20
    _positive_numbers(out, ["wakeups.none_p50_ms", "wakeups.bus_p50_ms"])
    assert out["wakeups.forced_wakeups"] >= 0


def test_main_writes_the_required_keys_and_keeps_other_doc_sections(
    tmp_path: Path, monkeypatch: Any
) -> None:
    monkeypatch.setattr(throughput, "run", lambda quick=False: throughput.measure(2000))
    doc = tmp_path / "performance.md"
    doc.write_text(
        f"# Performance\n\n{bench_main.START}\nold\n{bench_main.END}\n\n## Tensor capture\n\nkept\n"
    )
    out = tmp_path / "r.json"
    assert bench_main.main(["--only", "throughput", "--json", str(out), "--doc", str(doc)]) == 0
    r = json.loads(out.read_text())
    for k in (
        "throughput.events",
        "throughput.events_per_s",
        "throughput.lost",
        "throughput.rss_peak_mb",
        "gil.none_p50_ms",
        "gil.in_thread_p50_ms",
        "gil.process_p50_ms",
        "machine",
        "versions",
    ):
        assert k in r, k
    assert r["throughput.lost"] == 0
    assert r["targets.throughput_lost_eq_0.met"] is True
    text = doc.read_text()
    assert "old" not in text
    assert "## Tensor capture\n\nkept" in text
    assert "sustained events/s" in text


def test_main_rejects_an_unknown_part(capsys: Any) -> None:
    with pytest.raises(SystemExit) as e:
        bench_main.main(["--only", "overhead,bogus"])
    assert e.value.code == 2
    assert "unknown part(s) bogus" in capsys.readouterr().err


def test_table_shows_misses_and_missing_values() -> None:
    r = {"overhead.eventbus_publish_p50_ns": 1500.0, "overhead.eventbus_publish_p99_ns": 4000.0}
    r.update(bench_main._derived(r))
    assert r["targets.publish_p50_le_1us.met"] is False
    assert r["targets.publish_p99_le_5us.met"] is True
    assert r["targets.throughput_ge_400k_per_s.met"] is None
    t = bench_main.table(r)
    assert "| publish_p50_le_1us (<= 1000 ns) | 1,500 | **no** |" in t
    assert "n/a" in t


def test_subscriber_costs_names_every_subscriber_of_b() -> None:
    out = stall.subscriber_costs(steps=3)
    names = {k.rsplit(".", 1)[1] for k in out}
    assert names == {
        "bare_bus",
        "jsonl",
        "tensorboard",
        "divergence",
        "memory",
        "speed",
        "sleeper_50ms",
    }
    assert all(v >= 0 for v in out.values())


def _real_loop_rows_are_sane(out: dict[str, Any], names: list[str]) -> None:
    for v in names:
        _positive_numbers(out, [f"real_loop.{v}_{k}" for k in ("mean_ms", "p50_ms", "p99_ms")])
        assert out[f"real_loop.{v}_p50_ms"] <= out[f"real_loop.{v}_p99_ms"]
        if v not in ("none", "compiled_none"):
            assert math.isfinite(out[f"real_loop.{v}_overhead"]), v
    for v in names:
        if "eventbus" in v:
            assert out[f"real_loop.{v}_published"] > 0, v
            assert out[f"real_loop.{v}_jsonl_lost"] == 0, v
            assert out[f"real_loop.{v}_failed"] == 0, v


def test_real_loop_tiny_cpu_run_has_every_eager_variant() -> None:
    out, per_block = real_loop.measure(device="cpu", compile=False, blocks=2, steps=3, warmup=1)
    names = [v for v in real_loop.EAGER if v != "wandb" or real_loop.wandb_missing() is None]
    assert out["real_loop.variants"] == names
    assert list(per_block) == names
    for v in names:
        assert [len(b) for b in per_block[v]] == [3, 3], v
    _real_loop_rows_are_sane(out, names)
    assert out["real_loop.device"] == "cpu"
    assert out["real_loop.torch"]
    assert out["real_loop.torch_threads"] == 1
    assert "compiled rows not run" in out["real_loop.note"]
    if real_loop.wandb_missing() is not None:
        assert "wandb" in out["real_loop.note"]
    # Every watched step publishes TensorStats on top of the 4 events of a plain step.
    assert out["real_loop.eventbus_watch1_published"] > out["real_loop.eventbus_published"]
    params = len(list(GPT(real_loop.CPU_TINY).parameters()))
    for v in ("eventbus_watch50", "eventbus_watch1"):
        assert out[f"real_loop.{v}_tensorstats_weights_per_watched_step"] == params
        assert out[f"real_loop.{v}_tensorstats_grads_per_watched_step"] == params
        assert out[f"real_loop.{v}_tensorstats_activations_per_watched_step"] > 0
    table = bench_main.table(out)
    assert "**A real training loop**" in table
    assert "| eventbus_watch1 |" in table


def test_real_loop_main_prints_and_writes_json(
    tmp_path: Path, monkeypatch: Any, capsys: Any
) -> None:
    tiny = real_loop.setup_for("cpu", quick=True)
    monkeypatch.setattr(
        real_loop,
        "setup_for",
        lambda device, quick: real_loop.Setup(
            device="cpu",
            cfg=tiny.cfg,
            batch=tiny.batch,
            bf16=False,
            fused_adamw=False,
            blocks=1,
            steps=2,
            warmup=0,
        ),
    )
    path = tmp_path / "r.json"
    argv = ["--device", "cpu", "--variants", "eventbus", "--json", str(path)]
    assert real_loop.main(argv) == 0
    r = json.loads(path.read_text())
    assert r == json.loads(capsys.readouterr().out)
    assert r["real_loop.variants"] == ["none", "eventbus"]
    assert r["real_loop.command"] == "python -m benchmarks.real_loop " + " ".join(argv)
    assert r["machine"]["cpus"] >= 1
    assert r["versions"]["torch"]


@pytest.mark.slow
def test_real_loop_tracker_rows_run_and_lose_nothing(monkeypatch: Any) -> None:
    # Issue 16's rows: W&B offline and MLflow on sqlite, inline and behind the bus (~30 s:
    # wandb-core's start and MLflow's tables, per block).
    pytest.importorskip("wandb")
    if real_loop.mlflow_missing() is not None:
        pytest.skip(real_loop.mlflow_missing())
    monkeypatch.setenv("WANDB_SILENT", "true")
    names = ["none", "mlflow_inline", "eventbus_wandb", "eventbus_mlflow"]
    out, per_block = real_loop.measure(
        device="cpu", variants=tuple(names[1:]), blocks=1, steps=3, warmup=1
    )
    assert out["real_loop.variants"] == names
    assert [len(b) for b in per_block["eventbus_mlflow"]] == [3]
    _real_loop_rows_are_sane(out, names)
    for sink in ("wandb", "mlflow"):
        assert out[f"real_loop.eventbus_{sink}_{sink}_dropped"] == 0, sink
        assert out[f"real_loop.eventbus_{sink}_{sink}_failed"] == 0, sink
    assert out["real_loop.mlflow_inline_mlflow_version"]


@pytest.mark.slow
def test_real_loop_compiled_rows_run_on_cpu() -> None:
    # One compiled model (shared by both rows): ~15 s with inductor's cache warm, ~30 s cold.
    out, _ = real_loop.measure(
        device="cpu",
        variants=("compiled_none", "compiled_eventbus"),
        blocks=1,
        steps=2,
        warmup=0,
    )
    assert out["real_loop.variants"] == ["compiled_none", "compiled_eventbus"]
    _real_loop_rows_are_sane(out, ["compiled_none", "compiled_eventbus"])
    assert out["real_loop.compiled_none_warmup_dynamo_unique_graphs"] >= 1
    assert out["real_loop.compiled_none_first_step_s"] > 0


def test_watchdog_cost_tiny_run() -> None:
    from benchmarks import watchdog_cost

    out = watchdog_cost.run(blocks=1, steps=10)
    assert out["watchdog_cost.steps_per_variant"] == 10
    _positive_numbers(out, ["watchdog_cost.bus_p50_ms", "watchdog_cost.watchdog_p50_ms"])
    assert out["watchdog_cost.stalls"] == 0


def test_ctl_cost_tiny_run() -> None:
    from benchmarks import ctl_cost

    out = ctl_cost.run(blocks=1, steps=ctl_cost.WARMUP_STEPS + 10)
    assert out["ctl_cost.steps_per_variant"] == 10
    _positive_numbers(
        out, ["ctl_cost.bus_p50_ms", "ctl_cost.ctl_p50_ms", "ctl_cost.ctl_polled_p50_ms"]
    )
    assert out["ctl_cost.status_requests"] >= 1  # the poller was answered while it ran


@pytest.mark.timeout(180)
def test_ranks_cost_tiny_run() -> None:
    from benchmarks import ranks_cost

    out = ranks_cost.run(blocks=1, steps=10)
    assert out["ranks_cost.steps_per_variant"] == 10
    _positive_numbers(out, ["ranks_cost.bus_p50_ms", "ranks_cost.ranks_p50_ms"])
    assert out["ranks_cost.reduced"] == out["ranks_cost.reduced_expected"] == 30


def test_monitor_cost_runs_what_it_times() -> None:
    """`profiler_step_us` timed the coroutine `on_events` returns, never run: a constant."""
    from benchmarks import monitor_cost

    ran: list[int] = []

    async def handler() -> None:
        ran.append(1)

    monitor_cost._ran(handler())
    assert ran == [1]
    out = monitor_cost.run(20)["results"]
    for key in ("profiler_step_us", "speed_update_us", "divergence_step_us"):
        assert out[key]["p50"] > 0, key


def test_publish_in_place_times_both_paths_and_restores_the_intake() -> None:
    from benchmarks import publish_in_place
    from eventbus.core.inbox import Inbox

    intake = Inbox.put_sized
    out = publish_in_place.run(steps=20)
    assert Inbox.put_sized is intake
    for path in ("walk", "intake"):
        assert 0 < out[f"publish_in_place.{path}_p50_us"] < 1e6
