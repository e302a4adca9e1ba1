"""docs/events.md is generated from the code and must match it."""

from __future__ import annotations

import inspect
from pathlib import Path

from eventbus import Event, events
from eventbus._catalogue import catalogue, render_markdown

DOC = Path(__file__).resolve().parents[1] / "docs" / "events.md"


def test_docs_event_catalogue_matches_the_code() -> None:
    assert DOC.read_text() == render_markdown(), (
        "docs/events.md is stale: run `.venv/bin/python -m eventbus._catalogue > docs/events.md`"
    )


def test_every_event_class_is_in_the_catalogue() -> None:
    defined = {
        obj
        for _, obj in inspect.getmembers(events, inspect.isclass)
        if issubclass(obj, Event)
        and obj.__module__ == events.__name__
        and obj not in (Event, events.UnknownEvent)
    }
    assert defined == set(catalogue())
    assert all(cls.__name__ in events.__all__ for cls in defined)
