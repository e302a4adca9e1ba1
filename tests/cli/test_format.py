"""How the commands write durations and values: hms and g."""

from __future__ import annotations

import math

import pytest

from eventbus.cli._format import g, hms


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.04, "0:00:00.0"),
        (0.4, "0:00:00.4"),
        (59.96, "0:01:00.0"),  # rounded up into the next minute, never "0:00:60.0"
        (3599.97, "1:00:00.0"),
        (3725.0, "1:02:05.0"),
        (2 * 86400 + 61.25, "48:01:01.2"),  # days as hours
        (-3.0, "0:00:00.0"),
    ],
)
def test_hms_rounds_to_tenths_and_carries(seconds: float, text: str) -> None:
    assert hms(seconds) == text


def test_g_four_digits_and_non_finite_spelt() -> None:
    assert (g(1234567.0), g(math.nan), g(-math.inf)) == ("1.235e+06", "nan", "-inf")
