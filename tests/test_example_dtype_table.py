"""examples/dtype_table.py: the per-layer dtype table of a bf16 autocast run, from watch()."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "dtype_table.py"


@pytest.fixture(scope="module")
def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dtype_table_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_table_has_the_mixed_precision_rows(example: ModuleType) -> None:
    rows = example.run(steps=2).rows
    assert rows["emb"].input == "int64"  # token ids: module inputs are watched too
    assert rows["emb"].output == "float32"
    assert (rows["proj"].input, rows["proj"].output) == ("float32", "bfloat16")  # autocast
    assert rows["(model)"].output == "float32"  # the loss
    assert rows["(model)"].input == "int64"
    for name in ("emb", "norm", "proj", "head"):
        assert rows[name].weight == {"float32"}
        assert rows[name].grad == {"float32"}


def test_rendered_table_names_each_layer(example: ModuleType) -> None:
    text = example.run(steps=1).render()
    lines = text.splitlines()
    assert lines[0].split() == ["layer", "input", "output", "weights", "grads"]
    proj = next(line for line in lines if line.startswith("proj "))
    assert proj.split() == ["proj", "float32", "bfloat16", "float32", "float32"]
    assert any(line.split()[:3] == ["(model)", "->", "loss"] for line in lines)
