"""Shared by the command's tests: a recorded demo run and the one-line error check."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.demo_run import record_demo_run


@pytest.fixture(scope="package")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 60-step run whose loss diverges at step 40, recorded by JsonlWriter."""
    return record_demo_run(tmp_path_factory.mktemp("demo"), steps=60, blow_up_at=40)


def one_line_error(capsys: pytest.CaptureFixture[str], *words: str) -> str:
    """The single `eventbus: error: ...` line on stderr, holding each of `words`."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("eventbus: error: ")
    assert "Traceback" not in err
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]
