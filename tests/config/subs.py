"""Subscribers and factories the configuration tests name by import path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from eventbus import Event


class Collector:
    """A configurable test subscriber (module level: importable by path)."""

    policy = "drop_newest"

    def __init__(self, tag: str = "", n: int = 0) -> None:
        self.tag, self.n = tag, n
        self.got: list[Event] = []

    async def on_events(self, batch: list[Event]) -> None:
        self.got.extend(batch)


class RankZeroOnly(Collector):
    ranks = (0,)


def make_collector(**kw: Any) -> Collector:
    return Collector(**kw)


def on_loss(ev: Event) -> None:
    """A plain function subscriber, named by path."""


READY = Collector(tag="ready")


def write_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, body: str) -> str:
    """A module `name` on sys.path whose import runs `body`."""
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def write_toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "eventbus.toml"
    path.write_text(text)
    return path
