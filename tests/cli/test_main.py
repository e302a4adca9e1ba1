"""The `eventbus` command's contract: bad arguments or input are one line on stderr, exit 2."""

from __future__ import annotations

import gzip
import subprocess
import sys
from pathlib import Path

import pytest

import eventbus
from eventbus.cli import main
from eventbus.codec import encode
from eventbus.events import Loss
from eventbus.logformat import header
from tests.cli.conftest import one_line_error


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["frob"],
        ["summary"],
        ["replay", "x.jsonl"],
        ["plot", "x.jsonl"],
        ["tail", "x", "--max-lines", "zero"],
    ],
)
def test_bad_arguments_exit_2_with_one_line(
    argv: list[str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(argv) == 2
    one_line_error(capsys)


@pytest.mark.parametrize("command", ["summary", "plot", "tail", "replay"])
def test_unreadable_and_corrupt_files_exit_2_with_one_line(
    command: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    extra = {
        "plot": ["-o", str(tmp_path / "x.png")],
        "replay": ["-s", "tests.cli.test_replay:make_watcher"],
        "tail": ["--no-follow"],
        "summary": [],
    }[command]
    assert main([command, str(tmp_path / "missing.jsonl"), *extra]) == 2
    one_line_error(capsys, "missing.jsonl")
    corrupt = tmp_path / "corrupt.jsonl"
    corrupt.write_bytes(
        encode(Loss(step=1, value=1.0)) + b'{"type": 12}\n' + encode(Loss(step=2, value=1.0))
    )
    assert main([command, str(corrupt), *extra]) == 2
    one_line_error(capsys, "corrupt.jsonl")
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\x00\xff\xfe garbage\n" * 3)
    assert main([command, str(binary), *extra]) == 2
    one_line_error(capsys, "binary.jsonl")


def test_the_installed_command_prints_no_traceback(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "eventbus.cli", "summary", str(tmp_path / "nope.jsonl")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0
    assert "no such file" in r.stderr


# -- a log is input: every bad line is named as file:line (issue 14, item 9) -----------------

COMMANDS = ["summary", "tail", "replay", "plot"]
BAD_LINES = {
    "step": b'{"type":"Loss","step":"abc","value":1.0}',
    "ts": b'{"type":"Loss","step":2,"ts":"yesterday","value":1.0}',
    "rank": b'{"type":"Loss","step":2,"rank":[1],"value":1.0}',
    "seq": b'{"type":"Loss","step":2,"seq":-4,"value":1.0}',
    "samples": b'{"type":"StepEnded","step":2,"samples":"many"}',
    "metrics": b'{"type":"EvalEnded","step":2,"metrics":[1,2]}',
    "value": b'{"type":"Loss","step":2,"value":{"a":1}}',
    "bus": b'{"type":"eventbus.stats","bus":[1],"writer":{}}',
    "dropped": b'{"type":"eventbus.stats","bus":{"subscribers":{"x":{"dropped":"2"}}}}',
    "version": b'{"type":"eventbus.header","format":"eventbus.jsonl","version":"1"}',
}


def _args(command: str, log: Path, tmp_path: Path) -> list[str]:
    extra = {
        "plot": ["-o", str(tmp_path / "x.png")],
        "replay": ["-s", "tests.cli.test_replay:count_losses"],
        "tail": ["--no-follow"],
        "summary": [],
    }[command]
    return [command, str(log), *extra]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("field", BAD_LINES)
def test_a_wrongly_typed_field_is_exit_2_naming_file_line_and_field(
    command: str,
    field: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    if command == "plot":
        pytest.importorskip("matplotlib")
    log = tmp_path / "typed.jsonl"
    log.write_bytes(
        encode(Loss(step=1, value=1.0)) + BAD_LINES[field] + b"\n" + encode(Loss(step=3, value=1.0))
    )
    assert main(_args(command, log, tmp_path)) == 2
    line = one_line_error(capsys, f"{log}:2: ", field)
    assert "unexpected" not in line


@pytest.mark.parametrize("command", COMMANDS)
def test_what_is_not_a_log_is_refused_with_one_line(
    command: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    if command == "plot":
        pytest.importorskip("matplotlib")
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(bytes(range(256)) * 4)  # no newline anywhere
    assert main(_args(command, binary, tmp_path)) == 2
    one_line_error(capsys, f"{binary}:1: ", "not an eventbus log")
    text = tmp_path / "notes.txt"
    text.write_bytes(b"just some notes")
    assert main(_args(command, text, tmp_path)) == 2
    one_line_error(capsys, f"{text}:1: ")
    gz = tmp_path / "events.jsonl.gz"
    gz.write_bytes(gzip.compress(encode(Loss(step=1, value=1.0))))
    assert main(_args(command, gz, tmp_path)) == 2
    one_line_error(capsys, str(gz), "gzip", "gunzip")
    empty_dir = tmp_path / "nothing_here"
    empty_dir.mkdir()
    assert main(_args(command, empty_dir, tmp_path)) == 2
    one_line_error(capsys, str(empty_dir), "no *.jsonl files")


@pytest.mark.parametrize("command", ["summary", "replay", "plot"])
def test_a_log_without_events_is_exit_2_saying_why(
    command: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    if command == "plot":
        pytest.importorskip("matplotlib")
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    assert main(_args(command, empty, tmp_path)) == 2
    one_line_error(capsys, str(empty), "empty")
    only_header = tmp_path / "header.jsonl"
    only_header.write_bytes(header(rank=0, world_size=1))
    assert main(_args(command, only_header, tmp_path)) == 2
    one_line_error(capsys, str(only_header), "only header")


def test_tail_waits_on_an_empty_or_header_only_file(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A run that just started has written nothing yet, or only its header: not an error."""
    log = tmp_path / "events.jsonl"
    for content in (b"", header(rank=0), header(rank=0) + b'{"type":"Loss","st'):
        log.write_bytes(content)
        assert main(["tail", str(log), "--no-follow"]) == 0
        assert capsys.readouterr() == ("", "")


def test_version_is_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"eventbus {eventbus.__version__}\n"
