"""core.sizing: what publish measures for the byte bound, and the per-class quick check."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from eventbus import Event
from eventbus.core.sizing import checked_fields, quick_check, sizeof_event
from eventbus.events import Loss


@dataclass(slots=True, kw_only=True)
class Notes(Event):
    """Several texts and a container."""

    a: str = ""
    b: str = ""
    extra: Any = None


def test_quick_check_says_slow_for_tensors_and_containers_else_text_length() -> None:
    assert quick_check(Loss)(Loss(step=1, value=1.0)) == len("train")
    assert quick_check(Loss)(Loss(step=1, value=torch.tensor(1.0))) == -1
    check = quick_check(Notes)
    assert check(Notes(a="x" * 600, b="y" * 600)) == 1200  # together over 1 KiB
    assert check(Notes(extra={"k": 1})) == -1
    assert check(Notes()) == 0


def test_sizes_count_texts_tensors_and_containers() -> None:
    names = checked_fields(Notes)
    small = sizeof_event(Notes(), names)
    assert sizeof_event(Notes(a="x" * 4096), names) - small >= 4096
    t = torch.zeros(1024)  # 4 KiB: host metadata read, no copy
    assert sizeof_event(Notes(extra=t), names) >= 4096 + small - 8  # the None it replaces
    nested = {"rows": [{"text": "z" * 100} for _ in range(1000)]}  # ~100 KB, walked in part
    assert sizeof_event(Notes(extra=nested), names) > 100_000


def test_a_cyclic_container_is_sized_without_recursion_error() -> None:
    loop: list[Any] = []
    loop.append(loop)
    names = checked_fields(Notes)
    assert sizeof_event(Notes(extra=loop), names) > 0


def test_a_dict_of_numbers_by_name_is_sized_as_the_general_walk_sizes_it() -> None:
    """The fast path (str keys, numbers: a Scalars' values) gives the walk's own figure; a
    value that is not a number sends the dict back to the walk."""
    names = checked_fields(Notes)
    base = sizeof_event(Notes(), names) - 8  # the None the dict replaces
    values = {"loss": 1.0, "lr": 3, "ok": True, "none": None}
    walked = 64 + sum(49 + len(k) + 8 for k in values)  # each key's text, each number
    assert sizeof_event(Notes(extra=values), names) - base == walked
    mixed = {**values, "text": "x" * 1000}
    assert sizeof_event(Notes(extra=mixed), names) - base == walked + 49 + 4 + 49 + 1000
