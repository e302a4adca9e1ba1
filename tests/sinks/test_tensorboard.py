"""TensorBoardSink, read back with tensorboard's own EventAccumulator."""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("tensorboard")

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from eventbus import Event, EventBus
from eventbus.events import (
    BusCost,
    CheckpointLoaded,
    DivergenceDetected,
    EvalEnded,
    Loss,
    MemorySample,
    OptimizerStepped,
    RunEnded,
    RunStarted,
    Scalars,
    StepEnded,
    TensorStats,
)
from eventbus.sinks import TensorBoardSink


def _read(d: Path) -> EventAccumulator:
    acc = EventAccumulator(str(d), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    return acc


def _scalars(acc: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def _run(d: Path, events: list[Event], **kw: Any) -> TensorBoardSink:
    sink = TensorBoardSink(d, **kw)
    bus = EventBus(drain_interval=0.002, close_timeout=30)
    bus.subscribe(sink, placement="thread")
    with bus:
        for ev in events:
            bus.publish(ev)
    st = bus.stats()["tensorboard"]
    assert st.failed == 0
    assert st.dropped == 0
    return sink


def test_every_loss_scalar_with_its_step_zeros_included_on_disk_after_close(
    tmp_path: Path,
) -> None:
    # flush_secs far longer than the run: only close() can have put these on disk
    _run(
        tmp_path,
        [Loss(step=s, value=v) for s, v in ((1, 2.5), (2, 0.0), (3, 1.25))],
        flush_secs=3600,
    )
    acc = _read(tmp_path)
    assert _scalars(acc, "train/loss") == [(1, 2.5), (2, 0.0), (3, 1.25)]


def test_catalogue_scalars_and_tags(tmp_path: Path) -> None:
    _run(
        tmp_path,
        [
            RunStarted(config={"lr": 0.1, "layers": 2}, total_steps=2),
            Loss(step=1, value=1.0, split="eval"),
            Scalars(step=1, values={"acc": 0.5, "zero": 0}),
            OptimizerStepped(step=1, lr=0.1, grad_norm=0.0),
            EvalEnded(step=1, metrics={"loss": 0.75}),
            MemorySample(step=1, rss_mb=123.0, allocated_mb=0.0),
            StepEnded(step=1, duration_s=0.5, samples=64, tokens=1000),
        ],
    )
    acc = _read(tmp_path)
    assert _scalars(acc, "eval/loss") == [(1, 1.0), (1, 0.75)]
    assert _scalars(acc, "acc") == [(1, 0.5)]
    assert _scalars(acc, "zero") == [(1, 0.0)]
    assert _scalars(acc, "train/lr") == [(1, pytest.approx(0.1))]
    assert _scalars(acc, "train/grad_norm") == [(1, 0.0)]
    assert _scalars(acc, "memory/rss_mb") == [(1, 123.0)]
    assert _scalars(acc, "memory/allocated_mb") == [(1, 0.0)]
    assert _scalars(acc, "perf/step_time_s") == [(1, 0.5)]
    assert _scalars(acc, "perf/samples_per_s") == [(1, 128.0)]
    assert _scalars(acc, "perf/tokens_per_s") == [(1, 2000.0)]
    text = acc.Tensors("run/config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert '"lr": 0.1' in text
    assert '"layers": 2' in text


def test_bus_cost_as_eventbus_scalars(tmp_path: Path) -> None:
    """The cost report's figures (and each subscriber's CPU) as `eventbus/...` scalars."""
    _run(
        tmp_path,
        [
            BusCost(
                step=1000,
                steps=1001,
                share=0.004,
                publish_ms_p50=0.003,
                bus_cpu_s=1.5,
                subscriber_cpu_s={"jsonl": 0.25},
            )
        ],
    )
    acc = _read(tmp_path)
    assert _scalars(acc, "eventbus/share") == [(1000, pytest.approx(0.004))]
    assert _scalars(acc, "eventbus/publish_ms_p50") == [(1000, pytest.approx(0.003))]
    assert _scalars(acc, "eventbus/bus_cpu_s") == [(1000, 1.5)]
    assert _scalars(acc, "eventbus/cpu_s/jsonl") == [(1000, 0.25)]
    assert "eventbus/publish_ms_p99" not in acc.Tags()["scalars"]  # unknown: not written


def test_tensor_stats_histograms(tmp_path: Path) -> None:
    import torch

    _run(
        tmp_path,
        [
            TensorStats(
                step=1,
                name="fc.weight",
                kind="weights",
                norm=2.0,
                histogram={"counts": [1, 2, 3], "edges": [0.0, 1.0, 2.0, 3.0]},
            ),
            TensorStats(step=2, name="fc.bias", kind="grads", histogram=torch.arange(10.0)),
            TensorStats(step=3, name="no.hist", kind="weights", norm=1.0),
        ],
    )
    acc = _read(tmp_path)
    h = acc.Histograms("weights/fc.weight")[0]
    assert h.step == 1
    assert list(h.histogram_value.bucket) == [1.0, 2.0, 3.0]
    assert h.histogram_value.num == 6
    raw = acc.Histograms("grads/fc.bias")[0].histogram_value
    assert raw.num == 10
    assert raw.max == 9.0
    assert "weights/no.hist" not in acc.Tags()["histograms"]
    assert _scalars(acc, "weights/fc.weight/norm") == [(1, 2.0)]


def test_watched_model_histograms_read_back_with_their_counts_and_limits(tmp_path: Path) -> None:
    """watch(histogram=True) end to end: its {min, max, counts} become TensorBoard histograms
    whose buckets are the watched tensor's torch.histc bins (issue 15, item 5)."""
    import torch

    import eventbus.torch as et

    torch.manual_seed(0)
    first, last = torch.nn.Linear(6, 5), torch.nn.Linear(5, 2)
    model = torch.nn.Sequential(first, torch.nn.Tanh(), last)
    sink = TensorBoardSink(tmp_path)
    bus = EventBus(drain_interval=0.002, close_timeout=30)
    bus.subscribe(sink, placement="thread")
    with bus, et.watch(model, bus, every=1, histogram=True, bins=8):
        weight = first.weight.detach().clone()
        model(torch.randn(4, 6)).sum().backward()
        assert last.weight.grad is not None
        grad = last.weight.grad.detach().clone()
    assert bus.stats()["tensorboard"].failed == 0
    acc = _read(tmp_path)
    tags = acc.Tags()["histograms"]
    names = [n for n, _ in model.named_parameters()]
    assert {f"weights/{n}" for n in names} | {f"grads/{n}" for n in names} <= set(tags)
    assert "activations/1" in tags
    st = sink.stats()
    assert st.histograms == len(tags) > 0
    assert st.histograms_unusable == 0
    for tag, t in (("weights/0.weight", weight), ("grads/2.weight", grad)):
        (h,) = acc.Histograms(tag)
        v = h.histogram_value
        lo, hi = t.min().item(), t.max().item()
        assert (v.min, v.max) == (pytest.approx(lo), pytest.approx(hi))
        assert v.num == t.numel()
        expected = torch.histc((t - lo) / (hi - lo), bins=8, min=0, max=1)
        assert list(v.bucket) == expected.tolist()
        edges = torch.linspace(lo, hi, 9, dtype=torch.float64)[1:].tolist()
        assert list(v.bucket_limit) == pytest.approx(edges)


def test_histogram_shapes_and_unusable_ones_counted_and_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def stats(name: str, h: Any) -> TensorStats:
        return TensorStats(step=1, name=name, kind="weights", histogram=h)

    with caplog.at_level(logging.WARNING, logger="eventbus"):
        sink = _run(
            tmp_path,
            [
                stats("range", {"min": -1.0, "max": 1.0, "counts": [1, 0, 3, 4]}),
                stats("same", {"min": 2.0, "max": 2.0, "counts": [5, 0, 0]}),
                stats("all_nan", {"min": math.inf, "max": -math.inf, "counts": [0, 0]}),
                stats("pair", ([2, 2], [0.0, 0.5, 1.0])),
                stats("values", [1.0, 2.0, 2.0]),
                stats("bad_keys", {"hist": [1, 2]}),
                stats("bad_edges", {"counts": [1, 2], "edges": [0.0, 1.0]}),
                stats("bad_type", "0.5"),
            ],
        )
    acc = _read(tmp_path)
    v = acc.Histograms("weights/range")[0].histogram_value
    assert list(v.bucket) == [1.0, 0.0, 3.0, 4.0]
    assert list(v.bucket_limit) == [-0.5, 0.0, 0.5, 1.0]
    same = acc.Histograms("weights/same")[0].histogram_value
    assert (same.min, same.max, same.num) == (2.0, 2.0, 5.0)
    assert acc.Histograms("weights/pair")[0].histogram_value.num == 4
    assert acc.Histograms("weights/values")[0].histogram_value.num == 3
    written = {t.removeprefix("weights/") for t in acc.Tags()["histograms"]}
    assert written == {"range", "same", "pair", "values"}
    assert (sink.stats().histograms, sink.stats().histograms_unusable) == (4, 3)
    warnings = [r for r in caplog.records if "TensorStats.histogram not written" in r.getMessage()]
    assert len(warnings) == 1  # rate-limited: the first says why, later ones are counted
    assert "counts with min and max" in warnings[0].getMessage()


def test_run_config_reaches_the_hparams_plugin_with_final_metrics(tmp_path: Path) -> None:
    from tensorboard.plugins.hparams import api_pb2, metadata

    sink = _run(
        tmp_path,
        [
            RunStarted(config={"lr": 0.1, "model": {"layers": 2, "act": "gelu"}, "ids": [1, 2]}),
            *(Loss(step=s, value=1.0 / s) for s in (1, 2, 4)),
            EvalEnded(step=4, metrics={"accuracy": 0.75}),
            RunEnded(status="stopped", reason="early stop"),
        ],
    )
    assert sink.stats().hparams_runs == 1
    acc = _read(tmp_path)
    content = acc.PluginTagToContent(metadata.PLUGIN_NAME)
    start = metadata.parse_session_start_info_plugin_data(content[metadata.SESSION_START_INFO_TAG])
    hp = {k: start.hparams[k].WhichOneof("kind") for k in start.hparams}
    assert hp == {
        "lr": "number_value",
        "model.layers": "number_value",
        "model.act": "string_value",
        "ids": "string_value",
    }
    assert start.hparams["lr"].number_value == 0.1
    assert start.hparams["model.act"].string_value == "gelu"
    assert start.hparams["ids"].string_value == "[1,2]"
    exp = metadata.parse_experiment_plugin_data(content[metadata.EXPERIMENT_TAG])
    metrics = [m.name.tag for m in exp.metric_infos]
    assert metrics == ["train/loss", "eval/accuracy"]
    # the plugin shows each metric tag's last value: the run's final loss and accuracy
    assert _scalars(acc, "train/loss")[-1] == (4, 0.25)
    assert _scalars(acc, "eval/accuracy")[-1] == (4, 0.75)
    end = metadata.parse_session_end_info_plugin_data(content[metadata.SESSION_END_INFO_TAG])
    assert end.status == api_pb2.Status.Value("STATUS_SUCCESS")


def test_tensorboards_hparams_plugin_compares_two_runs_by_config_and_final_metrics(
    tmp_path: Path,
) -> None:
    """The plugin's own session-group listing (what its HParams tab shows) over two runs."""
    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
    from tensorboard.plugins import base_plugin
    from tensorboard.plugins.hparams import api_pb2, backend_context, list_session_groups

    for name, lr in (("a", 0.1), ("b", 0.3)):
        _run(
            tmp_path / name,
            [
                RunStarted(config={"lr": lr, "opt": {"name": "adam"}}),
                *(Loss(step=s, value=lr * 10 / s) for s in range(1, 6)),
                EvalEnded(step=5, metrics={"acc": 0.5 + lr}),
                RunEnded(status="completed"),
            ],
        )
    mux = plugin_event_multiplexer.EventMultiplexer()
    mux.AddRunsFromDirectory(str(tmp_path))
    mux.Reload()
    provider = data_provider.MultiplexerDataProvider(mux, str(tmp_path))
    tb = base_plugin.TBContext(logdir=str(tmp_path), multiplexer=mux, data_provider=provider)
    request = api_pb2.ListSessionGroupsRequest(
        start_index=0, slice_size=10, allowed_statuses=[api_pb2.STATUS_SUCCESS]
    )
    handler = list_session_groups.Handler(
        context.RequestContext(), backend_context.Context(tb), "", request
    )
    got = {
        group.name: (
            group.hparams["lr"].number_value,
            group.hparams["opt.name"].string_value,
            {m.name.tag: (round(m.value, 6), m.training_step) for m in group.metric_values},
        )
        for group in handler.run().session_groups
    }
    assert got == {
        "a": (0.1, "adam", {"train/loss": (0.2, 5), "eval/acc": (0.6, 5)}),
        "b": (0.3, "adam", {"train/loss": (0.6, 5), "eval/acc": (0.8, 5)}),
    }


def test_hparams_written_at_close_when_the_run_never_ended(tmp_path: Path) -> None:
    from tensorboard.plugins.hparams import api_pb2, metadata

    # a crashed run's log replayed: no RunEnded ever arrives (a live bus would publish one)
    sink = TensorBoardSink(tmp_path)
    sink.on_events([RunStarted(config={"seed": 3}), Loss(step=1, value=2.0)])
    assert sink.stats().hparams_runs == 0
    sink.on_close()
    assert sink.stats().hparams_runs == 1
    content = _read(tmp_path).PluginTagToContent(metadata.PLUGIN_NAME)
    end = metadata.parse_session_end_info_plugin_data(content[metadata.SESSION_END_INFO_TAG])
    assert end.status == api_pb2.Status.Value("STATUS_UNKNOWN")
    start = metadata.parse_session_start_info_plugin_data(content[metadata.SESSION_START_INFO_TAG])
    assert start.hparams["seed"].number_value == 3


@dataclass(slots=True, kw_only=True)
class TbTokenLoss(Loss):
    """A user's refinement of a catalogue event."""

    tokens: int = 0


@dataclass(slots=True, kw_only=True)
class TbRunStarted(RunStarted):
    seed: int = 0


def test_subclasses_of_catalogue_events_are_written_like_their_base(tmp_path: Path) -> None:
    """Dispatch is by isinstance: subscribing to a base class receives its subclasses."""
    _run(tmp_path, [TbRunStarted(config={"seed": 3}), TbTokenLoss(step=1, value=2.0, tokens=9)])
    acc = _read(tmp_path)
    assert _scalars(acc, "train/loss") == [(1, 2.0)]
    assert "run/config/text_summary" in acc.Tags()["tensors"]


def test_divergence_as_text_and_marker_scalar(tmp_path: Path) -> None:
    _run(
        tmp_path,
        [
            Loss(step=7, value=1.0),
            DivergenceDetected(step=7, metric="loss", value=50.0, baseline=1.0, reason="spike"),
        ],
    )
    acc = _read(tmp_path)
    assert _scalars(acc, "divergence/marker") == [(7, 1.0)]
    ev = acc.Tensors("divergence/detected/text_summary")[0]
    assert ev.step == 7
    assert "spike" in ev.tensor_proto.string_val[0].decode()


def test_purge_step_on_resume_hides_steps_after_the_checkpoint(tmp_path: Path) -> None:
    _run(tmp_path, [Loss(step=s, value=1.0) for s in range(1, 11)])
    _run(tmp_path, [Loss(step=s, value=2.0) for s in range(6, 9)], resume_from_step=5)
    got = _scalars(_read(tmp_path), "train/loss")
    assert got == [(s, 1.0) for s in range(1, 6)] + [(s, 2.0) for s in range(6, 9)]


def test_checkpoint_loaded_and_load_state_dict_purge_too(tmp_path: Path) -> None:
    _run(
        tmp_path / "a",
        [
            *(Loss(step=s, value=1.0) for s in range(1, 6)),
            CheckpointLoaded(step=2, path="c.pt"),
            *(Loss(step=s, value=3.0) for s in range(3, 5)),
        ],
    )
    got = _scalars(_read(tmp_path / "a"), "train/loss")
    assert got == [(1, 1.0), (2, 1.0), (3, 3.0), (4, 3.0)]

    _run(tmp_path / "b", [Loss(step=s, value=1.0) for s in range(1, 6)])
    # TensorBoard reads a directory's event files in name order, and a name carries the
    # second it was created in: a resumed run is a later second (here: wait for one).
    time.sleep(1.1)
    sink = TensorBoardSink(tmp_path / "b")
    bus = EventBus(drain_interval=0.002)
    bus.subscribe(sink, placement="thread")
    bus.load_state_dict({"tensorboard": {"step": 3}})
    with bus:
        bus.publish(Loss(step=4, value=9.0))
    assert _scalars(_read(tmp_path / "b"), "train/loss") == [(1, 1.0), (2, 1.0), (3, 1.0), (4, 9.0)]


def test_a_resume_purges_whatever_tensorboards_file_counter_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resume within the second the run began: were it a new event file, its name would
    end in ".10" after the first's ".9" and be read first, purging nothing."""
    from tensorboard.summary.writer import event_file_writer

    monkeypatch.setattr(event_file_writer, "_global_uid", event_file_writer.AtomicCounter(9))
    _run(
        tmp_path,
        [
            *(Loss(step=s, value=1.0) for s in range(1, 6)),
            CheckpointLoaded(step=2, path="c.pt"),
            *(Loss(step=s, value=3.0) for s in range(3, 5)),
        ],
    )
    assert _scalars(_read(tmp_path), "train/loss") == [(1, 1.0), (2, 1.0), (3, 3.0), (4, 3.0)]


def test_one_rank_writes_by_default(tmp_path: Path) -> None:
    assert TensorBoardSink.ranks == (0,)
    sink = TensorBoardSink(tmp_path)
    bus = EventBus(rank=1, world_size=2, drain_interval=0.002)
    handle = bus.subscribe(sink, placement="thread")
    assert not handle.active
    with bus:
        bus.publish(Loss(step=1, value=1.0))
    assert not list(tmp_path.rglob("events.out.tfevents.*"))


def test_all_ranks_write_to_their_own_subdirectory(tmp_path: Path) -> None:
    for rank in (0, 1):
        sink = TensorBoardSink(tmp_path, ranks=None)
        bus = EventBus(rank=rank, world_size=2, drain_interval=0.002)
        bus.subscribe(sink, placement="thread")
        with bus:
            bus.publish(Loss(step=1, value=float(rank)))
    for rank in (0, 1):
        assert _scalars(_read(tmp_path / f"rank{rank}"), "train/loss") == [(1, float(rank))]


def test_writer_runs_off_the_training_thread(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torch.utils.tensorboard.writer import FileWriter

    threads: set[str] = set()
    real = FileWriter.add_summary

    def spy(self: Any, *a: Any, **kw: Any) -> Any:
        threads.add(threading.current_thread().name)
        return real(self, *a, **kw)

    monkeypatch.setattr(FileWriter, "add_summary", spy)
    _run(tmp_path, [Loss(step=1, value=1.0)])
    assert threads
    assert threading.current_thread().name not in threads
    assert all(t.startswith("eventbus-") for t in threads)


def test_unwritable_directory_and_bad_options_fail_at_construction(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OSError, match="TensorBoardSink cannot write"):
        TensorBoardSink(blocker / "tb")
    with pytest.raises(ValueError, match="flush_secs"):
        TensorBoardSink(tmp_path, flush_secs=0)
    with pytest.raises(ValueError, match="ranks"):
        TensorBoardSink(tmp_path, ranks=())
