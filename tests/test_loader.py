"""Import paths to objects: short names, absolute paths, and errors that say what to fix."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import eventbus.loader
from eventbus.loader import SHORT_NAMES, LoadError, load_object, split_path
from eventbus.monitors import DivergenceDetector


def test_short_names_and_paths() -> None:
    assert load_object("divergence") is DivergenceDetector
    assert (
        load_object("eventbus.monitors:DivergenceDetector.load_state_dict")
        is DivergenceDetector.load_state_dict
    )
    assert all(split_path(n) for n in SHORT_NAMES)


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("nonsense", "neither a built-in .*jsonl.* nor an import path"),
        (".relative:x", "not an absolute module name \\(relative imports are not supported\\)"),
        ("a..b:x", "'a..b' is not an absolute module name; write 'package.module:factory'"),
        ("os:path-join", "'path-join' is not an attribute name"),
        ("no_such_module_xyz:thing", "cannot import 'no_such_module_xyz'"),
        ("eventbus.loader:Missing", "module 'eventbus.loader' has no attribute 'Missing'"),
    ],
)
def test_bad_paths(path: str, message: str) -> None:
    with pytest.raises(LoadError, match=message):
        load_object(path)
    with pytest.raises(ValueError, match=f"^ProcessSubscriber: .*{message}"):
        load_object(path, where="ProcessSubscriber")


def test_anything_raised_at_import_is_a_load_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "loader_exits.py").write_text("raise SystemExit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(LoadError, match=r"importing 'loader_exits' .* failed: SystemExit: 3"):
        load_object("loader_exits:make")


def test_imports_nothing_of_eventbus() -> None:
    """The lowest layer: process placement and config both use it without a cycle."""
    tree = ast.parse(Path(eventbus.loader.__file__).read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert [m for m in names if m.split(".")[0] == "eventbus"] == []
