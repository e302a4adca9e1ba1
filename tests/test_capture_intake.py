"""The generated intake: the same bytes, captures and field values as the general walk."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from eventbus import Event
from eventbus._capture_intake import INTAKE, intake_for
from eventbus._capture_pending import Pending
from eventbus.capture import capture_event
from eventbus.core.sizing import checked_fields, sizeof_event
from eventbus.events import Loss, OptimizerStepped, Scalars, StepEnded


@dataclasses.dataclass(slots=True, kw_only=True)
class _Mixed(Event):
    """Every kind of field the intake tells apart."""

    t: Any = None
    count: int = 0  # declared int: sized, never captured, even when it holds a tensor
    note: str = ""
    nested: Any = None
    other: Any = None


def _cases() -> dict[str, Callable[[], Event]]:
    grad = torch.ones(3, requires_grad=True)
    return {
        "loss tensor": lambda: Loss(step=1, value=(grad * 2).sum()),
        "loss float": lambda: Loss(step=1, value=0.5, split="eval"),
        "grad norm": lambda: OptimizerStepped(step=1, lr=0.1, grad_norm=torch.tensor(2.0)),
        "scalars": lambda: Scalars(step=1, values={"a": torch.tensor(1.5), "b": 2}),
        "long text": lambda: _Mixed(step=1, note="x" * 5000),
        "big tensor": lambda: Loss(step=1, value=torch.arange(4096.0)),
        "parameter": lambda: Loss(step=1, value=torch.nn.Parameter(torch.tensor(3.0))),
        "mixed": lambda: _Mixed(
            step=1,
            t=torch.tensor([1, 2]),
            count=torch.tensor(7),  # type: ignore[arg-type]
            note="n" * 2000,
            nested={"k": [torch.tensor(1.0), (2, torch.tensor(3))]},
            other=np.arange(3.0),
        ),
        "already captured": lambda: Loss(step=1, value=Pending(torch.tensor(4.0))),
    }


def _shape(v: Any) -> Any:
    """What a field holds after capture, comparable across two captures of equal events."""
    if isinstance(v, Pending):
        return ("Pending", v.buf.dtype, tuple(v.buf.shape), v.buf.tolist())
    if isinstance(v, torch.Tensor):
        return ("tensor", v.tolist())
    if isinstance(v, np.ndarray):
        return ("array", v.tolist())
    if isinstance(v, dict):
        return {k: _shape(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return (type(v).__name__, [_shape(x) for x in v])
    return v


@pytest.mark.parametrize("name", list(_cases()))
def test_intake_equals_sizing_then_capture(name: str) -> None:
    make = _cases()[name]
    walked, generated = make(), make()
    nbytes = sizeof_event(walked, checked_fields(type(walked)))
    captured = capture_event(walked)
    assert intake_for(type(generated))(generated) == (nbytes, captured)
    for f in dataclasses.fields(walked):
        assert _shape(getattr(generated, f.name)) == _shape(getattr(walked, f.name)), f.name


def test_a_tensor_field_is_a_snapshot_detached_from_the_graph() -> None:
    x = torch.ones(2, requires_grad=True)
    loss = (x * 3).sum()
    ev = Loss(step=1, value=loss)
    intake_for(Loss)(ev)
    p = ev.value
    assert isinstance(p, Pending) and not p.buf.requires_grad and p.buf.grad_fn is None
    loss.detach().add_(1)  # the caller changes its tensor in place afterwards
    assert p.value() == 6.0


def test_the_hot_path_reads_the_made_function_back() -> None:
    fn = intake_for(StepEnded)
    assert INTAKE[StepEnded] is fn and intake_for(StepEnded) is fn
    ev = StepEnded(step=1, samples=torch.tensor(8))  # type: ignore[arg-type]
    assert fn(ev)[1] is True and isinstance(ev.samples, Pending)


@dataclasses.dataclass(slots=True, kw_only=True)
class _BeforeTorch(Event):
    x: Any = None


def test_a_function_made_before_torch_is_kept_then_made_again_once_torch_is_there(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not kept, it was made again for every event (a compile each): 100k events took 28 s
    instead of 3, in the sidecar, which never imports torch."""
    import eventbus._capture_intake as intake

    real = intake._tensor_type
    torch_there = False
    monkeypatch.setattr(intake, "_tensor_type", lambda: real() if torch_there else None)
    INTAKE.pop(_BeforeTorch, None)
    fn = intake.intake_for(_BeforeTorch)
    assert fn(_BeforeTorch(step=1, x=[1.0])) == (64 + 56 + 8, False)
    assert intake.intake_for(_BeforeTorch) is fn and INTAKE[_BeforeTorch] is fn  # kept
    torch_there = True
    ev = _BeforeTorch(step=2, x=torch.tensor(2.0))
    assert fn(ev)[1] is True and isinstance(ev.x, Pending)
    assert INTAKE[_BeforeTorch] is not fn  # made again, with the plain-tensor branch
