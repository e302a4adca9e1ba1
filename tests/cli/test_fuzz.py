"""Every log, however broken, gives exit 0 or exit 2 with one `file...:` line: never a traceback.

A seeded generator mutates a small valid log (fields retyped, lines truncated or cut short,
garbage bytes, malformed records, reordered lines) and runs the reader and each command on it.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import orjson
import pytest

from eventbus.cli import main
from eventbus.codec import encode
from eventbus.events import (
    DivergenceDetected,
    EvalEnded,
    Loss,
    MemoryLeakSuspected,
    MemorySample,
    OptimizerStepped,
    RunEnded,
    RunStarted,
    Scalars,
    StepEnded,
    StopRequested,
)
from eventbus.logformat import SKIPPED_TYPE, STATS_TYPE, LogReadError, header, read_log, record

CASES = 300
VALUES: list[Any] = [
    "abc",
    "",
    "NaN",
    "Infinity",
    [1],
    [],
    {"a": 1},
    {},
    None,
    True,
    False,
    -1,
    0,
    2**63 - 1,
    -(2**63),
    1.5,
    -0.0,
    1e308,
    [[[]]],
    {"x": [1, {"y": "z"}]},
    "\u2603",
    "a\nb",
]
TYPES = [
    "Loss",
    "StepEnded",
    "EvalEnded",
    "Scalars",
    "MemorySample",
    "OptimizerStepped",
    "RunStarted",
    "RunEnded",
    "DivergenceDetected",
    "MemoryLeakSuspected",
    "StopRequested",
    "CheckpointSaved",
    "NoSuchType",
    "eventbus.header",
    STATS_TYPE,
    SKIPPED_TYPE,
    "eventbus.future",
    "",
    7,
]


def _valid_lines(rng: random.Random) -> list[bytes]:
    lines = [
        header(rank=0, world_size=1),
        encode(RunStarted(step=None, total_steps=5, config={"lr": 0.1}, seq=0, rank=0)),
    ]
    seq = 1
    for step in range(1, rng.randint(2, 6)):
        for ev in (
            Loss(step=step, value=rng.random()),
            OptimizerStepped(step=step, lr=0.1, grad_norm=1.0),
            MemorySample(step=step, rss_mb=100.0),
            EvalEnded(step=step, metrics={"acc": 0.5}),
            Scalars(step=step, values={"a": 1}),
            StepEnded(step=step, duration_s=0.01, samples=8),
        ):
            ev.seq, ev.rank, ev.ts = seq, 0, 1_000_000 * seq
            seq += 1
            lines.append(encode(ev))
    for ev in (
        DivergenceDetected(step=3, value=9.0, baseline=1.0, reason="r"),
        MemoryLeakSuspected(step=3, rate_mb_per_step=1.0, window=5),
        StopRequested(step=3, reason="r"),
        RunEnded(status="completed"),
    ):
        ev.seq, ev.rank = seq, 0
        seq += 1
        lines.append(encode(ev))
    lines.append(record(SKIPPED_TYPE, reason="oversize", event_type="Loss", step=2, seq=seq))
    lines.append(
        record(
            STATS_TYPE,
            rank=0,
            step=5,
            bus={
                "published": seq,
                "rejected": 0,
                "hung": [],
                "subscribers": {"jsonl": {"dropped": 0, "failed": 0}},
            },
            writer={"lines_lost": 0},
        )
    )
    return lines


def _retype(rng: random.Random, line: bytes) -> bytes:
    try:
        d = orjson.loads(line)
    except orjson.JSONDecodeError:
        return line  # already garbage
    if not isinstance(d, dict):
        return line
    if rng.random() < 0.15:
        d["type"] = rng.choice(TYPES)
    key = rng.choice([*d, "step", "ts", "seq", "rank", "bus", "writer", "version", "metrics"])
    if rng.random() < 0.1:
        d.pop(key, None)
    else:
        d[key] = rng.choice(VALUES)
    if isinstance(d.get("bus"), dict) and rng.random() < 0.5:
        sub = d["bus"].setdefault("subscribers", {})
        if isinstance(sub, dict):
            sub[rng.choice(["jsonl", "x"])] = rng.choice(
                [{"dropped": rng.choice(VALUES)}, rng.choice(VALUES)]
            )
    return orjson.dumps(d) + b"\n"


def _mutate(rng: random.Random, lines: list[bytes]) -> bytes:
    lines = list(lines)
    for _ in range(rng.randint(1, 3)):
        i = rng.randrange(len(lines))
        kind = rng.randrange(9)
        if kind <= 2:
            lines[i] = _retype(rng, lines[i])
        elif kind == 3:  # cut short, here or as the last line
            lines[i] = lines[i][: rng.randrange(len(lines[i]))]
            if rng.random() < 0.5:
                lines = lines[: i + 1]
                break
            lines[i] += b"\n"
        elif kind == 4:
            lines[i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 40)))
        elif kind == 5:
            lines.insert(
                i,
                rng.choice(
                    [
                        b"\n",
                        b"   \n",
                        b"[1,2]\n",
                        b'"x"\n',
                        b"{}\n",
                        b'{"type":null}\n',
                        b"{\n",
                        b"\xef\xbb\xbf{}\n",
                        b"\x1f\x8b\x08\x00",
                        b"\x00" * 8,
                    ]
                ),
            )
        elif kind == 6:
            rng.shuffle(lines)
        elif kind == 7:
            lines[i] = orjson.dumps(rng.choice(VALUES)) + b"\n"
        else:  # deep nesting, past orjson's and Python's recursion limits
            n = rng.choice([10, 600, 2000])
            field = rng.choice([b"value", b"metrics", b"step", b"data"])
            lines[i] = (
                b'{"type":"%s","step":1,"%s":' % (rng.choice([b"Loss", b"EvalEnded", b"X"]), field)
                + b"[" * n
                + b"1"
                + b"]" * n
                + b"}\n"
            )
    return b"".join(lines)


def _cases() -> list[tuple[int, bytes]]:
    rng = random.Random(20261124)
    return [(i, _mutate(rng, _valid_lines(rng))) for i in range(CASES)]


def _commands(log: Path, tmp_path: Path, i: int) -> list[list[str]]:
    out = [
        ["summary", str(log)],
        ["summary", "--json", str(log)],
        ["tail", str(log), "--no-follow", "-n", "3"],
        ["replay", str(log), "-s", "tests.cli.test_replay:count_losses"],
    ]
    if i % 15 == 0:  # matplotlib is slow: a sample of the cases
        out.append(["plot", str(log), "-o", str(tmp_path / "x.png")])
    return out


def test_the_reader_raises_only_log_read_errors_naming_the_file(tmp_path: Path) -> None:
    log = tmp_path / "fuzz.jsonl"
    outcomes = {"read": 0, "refused": 0}
    for _, data in _cases():
        log.write_bytes(data)
        try:
            list(read_log(log, records=True))
        except LogReadError as e:
            message = str(e)
        else:
            outcomes["read"] += 1
            continue
        assert message.startswith(f"{log}"), message
        outcomes["refused"] += 1
    assert min(outcomes.values()) > CASES // 10, outcomes  # the generator tries both kinds


def test_every_command_exits_0_or_2_with_one_line(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    has_matplotlib = _has("matplotlib")
    log = tmp_path / "fuzz.jsonl"
    for i, data in _cases():
        log.write_bytes(data)
        for argv in _commands(log, tmp_path, i):
            if argv[0] == "plot" and not has_matplotlib:
                continue
            code = main(argv)
            err = capsys.readouterr().err
            where = f"case {i}, {' '.join(argv[:2])}: {data[:300]!r}\n{err}"
            assert code in (0, 2), where
            assert "Traceback" not in err, where
            assert "error: unexpected" not in err, where
            if code == 2:
                errors = [x for x in err.splitlines() if x.startswith("eventbus: error: ")]
                assert len(errors) == 1, where
                assert errors[0].startswith(f"eventbus: error: {log}"), where


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None
