"""DivergenceRule on recorded real runs (tests/fixtures/divergence) and synthetic edge cases."""

from __future__ import annotations

import json
import math
import random
import statistics
from pathlib import Path
from typing import Any

import pytest

from eventbus.monitors._divergence_rule import Detection, DivergenceRule

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "divergence"
RUNS: list[dict[str, Any]] = [
    json.loads(p.read_text(encoding="utf-8")) for p in sorted(FIXTURES.glob("*.json"))
]
HEALTHY = [r for r in RUNS if not r["diverges"]]
DIVERGING = [r for r in RUNS if r["diverges"]]
# A 2-step corrupted-target spike under SGD+momentum: momentum carries the bad update on
# and the loss stays 4x up a third step (5.0x, 3.0x, 4.1x, then 0.95x). An LR jump in the
# tune set starts the same way (7.0x, 3.0x, 3.9x, and stays), so the rule cannot tell them
# apart on the third step. Held out (never tuned on); known false positive. The blind sets
# (made after issue #18's candidate was fixed, never tuned on) have two more, both there
# before issue #18: a 2.9x step, one quiet step, 2.4x, then a 2-step 4.75x corrupted
# batch (4 elevated of 5 values); and batch-size-1 noise of 108x, 79x, 182x (the fast path).
KNOWN_FP = {
    "holdout_reg_sgd_spikes_611": "momentum aftermath",
    "blind_reg_sgd_spikes_1161": "noisy steps before a spike",
    "blind2_reg_bs1_spikes_2411": "batch-size-1 noise",
}


def first_detection(values: list[float], rule: DivergenceRule | None = None) -> Detection | None:
    rule = rule or DivergenceRule()
    for step, value in enumerate(values, start=1):
        detection = rule.update(step, value)
        if detection is not None:
            return detection
    return None


def _ids(runs: list[dict[str, Any]]) -> list[str]:
    return [r["name"] for r in runs]


def test_fixtures_present() -> None:
    assert len(HEALTHY) >= 12
    assert len(DIVERGING) >= 12
    assert {r["scale"] for r in RUNS} == {"ce", "mse"}


@pytest.mark.parametrize(
    "run",
    [
        pytest.param(r, marks=pytest.mark.xfail(strict=True, reason=KNOWN_FP[r["name"]]))
        if r["name"] in KNOWN_FP
        else r
        for r in HEALTHY
    ],
    ids=_ids(HEALTHY),
)
def test_healthy_run_never_fires(run: dict[str, Any]) -> None:
    assert first_detection(run["loss"]) is None


# Made after the rule was tuned (new kinds of model), only scored: batch size 1 makes the
# loss swing 1000x step to step, so a 30x LR jump that leaves it at ~20x is not seen; the
# blind set's batch-size-1 slow creep (x1.04 per step) ends at its sustained departure.
KNOWN_FRESH_MISS = {"fresh_reg_bs1_lr_jump_977", "blind_reg_bs1_slow_1424"}


@pytest.mark.parametrize(
    "run",
    [
        pytest.param(r, marks=pytest.mark.xfail(strict=True, reason="batch-size-1 noise"))
        if r["name"] in KNOWN_FRESH_MISS
        else r
        for r in DIVERGING
    ],
    ids=_ids(DIVERGING),
)
def test_diverging_run_fires_after_onset_on_a_raised_value(run: dict[str, Any]) -> None:
    detection = first_detection(run["loss"])
    assert detection is not None
    assert detection.step >= run["onset"]
    if math.isfinite(detection.value):  # it fired on a loss that is really up, not on noise
        before = run["loss"][max(0, run["onset"] - 51) : run["onset"] - 1]
        assert detection.value > 1.2 * statistics.median(before)


# Departure definitions (fixture fields, computed by make_runs.py): "strict" is the first
# step beyond the pre-onset max or 1.5x median; "s15"/"s2" the first step from which 10
# values stay above 1.5x / 2x the pre-onset median. The acceptance budget: median delay
# <= 2 and max <= 3 steps after departure.
DEPARTURE_FIELDS = ["departure", "departure_s15", "departure_s2"]


def _delays(runs: list[dict[str, Any]], field: str) -> dict[str, int]:
    out = {}
    for run in runs:
        detection = first_detection(run["loss"])
        assert detection is not None, run["name"]
        if run[field] is not None:
            out[run["name"]] = detection.step - run[field]
    return out


def _within_budget(delays: dict[str, int]) -> None:
    assert statistics.median(delays.values()) <= 2, delays
    late = {name: d for name, d in delays.items() if d > 3}
    assert not late


@pytest.mark.parametrize("field", ["departure_s15", "departure_s2"])
def test_tune_set_within_budget_of_sustained_departure(field: str) -> None:
    _within_budget(_delays([r for r in DIVERGING if r["set"] == "tune"], field))


@pytest.mark.parametrize("field", DEPARTURE_FIELDS)
def test_jumps_and_nan_within_budget_of_any_departure(field: str) -> None:
    runs = [
        r
        for r in DIVERGING
        if r["kind"] in ("lr_jump", "nan_weight") and r["set"] in ("tune", "holdout")
    ]
    # Held out, reported, not tuned on: blobs (CE ~0.12, +-70% batch noise, so 3 sigma is
    # 3.4x) after a mild LR jump sits at 2-3x, then dips: fired 6 steps after departure.
    runs = [r for r in runs if r["name"] != "holdout_blobs_cls_lr_jump_727"]
    _within_budget(_delays(runs, field))


@pytest.mark.xfail(
    strict=True,
    reason="slow ramps: the strict departure (first step beyond the pre-onset max or 1.5x "
    "median) is often a noise step 20-40 steps before the loss leaves; see docs/divergence.md",
)
def test_tune_ramps_within_budget_of_strict_departure() -> None:
    _within_budget(_delays([r for r in DIVERGING if r["set"] == "tune"], "departure"))


@pytest.mark.xfail(
    strict=True,
    reason="held out: blobs LR jump 727 (6 steps) and LR ramp 727 (5): a divergence at 2-3x "
    "under +-70% noise; see docs/divergence.md",
)
def test_holdout_within_budget_of_sustained_departure() -> None:
    _within_budget(_delays([r for r in DIVERGING if r["set"] == "holdout"], "departure_s15"))


# The runs detected more than 2 steps after the sustained 1.5x departure, and how late.
# docs/divergence.md ("The late runs") says for each why earlier would mean a false
# positive on a recorded healthy run or on a common spike shape. A run that gets faster
# fails this test too: update the table and the docs with it.
LATE_BEYOND_2 = {
    "blind2_blobs_cls_lr_ramp_2227": 3,
    "blind2_blobs_cls_slow_2224": 3,
    "blind2_cnn_img_lr_ramp_2327": 3,
    "blind2_reg_bs1_lr_jump_2427": 28,
    "blind_blobs_cls_lr_jump_1227": 6,
    "blind_char_mlp_lr_ramp_1027": 3,
    "blind_reg_bs1_lr_jump_1427": 9,
    "blind_reg_mlp_lr_jump_1077": 3,
    "blind_reg_mlp_lr_ramp_1077": 3,
    "fresh_reg_bs1_lr_ramp_977": 4,
    "holdout_blobs_cls_lr_jump_727": 6,
    "holdout_blobs_cls_lr_jump_737": 3,
    "holdout_blobs_cls_lr_ramp_727": 5,
    "holdout_blobs_cls_lr_ramp_737": 3,
    "holdout_blobs_cls_slow_724": 3,
    "holdout_reg_sgd_lr_ramp_637": 3,
}


def test_within_two_steps_of_sustained_departure_but_the_documented_few() -> None:
    runs = [r for r in DIVERGING if r["name"] not in KNOWN_FRESH_MISS]
    late = {n: d for n, d in _delays(runs, "departure_s15").items() if d > 2}
    assert late == LATE_BEYOND_2


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_fires_immediately_even_in_warmup(bad: float) -> None:
    rule = DivergenceRule()
    assert rule.update(1, 2.0) is None
    detection = rule.update(2, bad)
    assert detection is not None
    assert detection.step == 2
    assert "non-finite" in detection.reason


@pytest.mark.parametrize("factor", [0.01, 100.0])
def test_scale_invariance(factor: float) -> None:
    for run in RUNS:
        base = first_detection(run["loss"])
        scaled = first_detection([v * factor for v in run["loss"]])
        assert (base and base.step) == (scaled and scaled.step), run["name"]


def test_state_dict_round_trip_continues_identically() -> None:
    for run in DIVERGING + HEALTHY[:4]:
        values = run["loss"]
        whole = DivergenceRule()
        expected = [whole.update(s, v) for s, v in enumerate(values, start=1)]
        first, cut = DivergenceRule(), min(len(values) - 1, (run["onset"] or 200) - 3)
        got = [first.update(s, v) for s, v in enumerate(values[:cut], start=1)]
        state = json.loads(json.dumps(first.state_dict()))
        resumed = DivergenceRule()
        resumed.load_state_dict(state)
        got += [resumed.update(s, v) for s, v in enumerate(values[cut:], start=cut + 1)]
        assert got == expected, run["name"]


def test_resumed_rule_keeps_its_baseline() -> None:
    values = [1.0] * 100 + [1.5] * 5
    before = DivergenceRule()
    for step, value in enumerate(values[:100], start=1):
        before.update(step, value)
    resumed = DivergenceRule()
    resumed.load_state_dict(before.state_dict())
    fired = [resumed.update(s, v) for s, v in enumerate(values[100:], start=101)]
    assert [d.step for d in fired if d is not None] == [103]
    # Without the state, the rule is back in warmup and cannot see the rise.
    fresh = DivergenceRule()
    assert all(fresh.update(s, v) is None for s, v in enumerate(values[100:], start=101))


def test_unknown_state_version_is_refused() -> None:
    state = DivergenceRule().state_dict()
    state["version"] = 99
    with pytest.raises(ValueError, match="version"):
        DivergenceRule().load_state_dict(state)


def noisy(n: int, level: float, rel: float, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return [level * math.exp(rng.gauss(0.0, rel)) for _ in range(n)]


def test_constant_loss_never_fires_and_a_real_rise_does() -> None:
    assert first_detection([1.0] * 300) is None
    detection = first_detection([1.0] * 100 + [1.5] * 5)
    assert detection is not None
    assert detection.step == 103
    assert detection.baseline == pytest.approx(1.0)
    assert first_detection([1.0] * 100 + [1.1] * 50) is None  # below the 20% floor


def test_exact_zero_loss() -> None:
    values = [2.0 * 0.97**i for i in range(150)] + [0.0] * 50 + [1e-7, 0.0] * 20
    assert first_detection(values) is None
    detection = first_detection([*values, 1.0, 1.0, 1.0])
    assert detection is not None
    assert detection.step == len(values) + 3


def test_negative_metric_uses_differences() -> None:
    values = [-3.0 + 0.05 * math.sin(i) for i in range(200)]
    assert first_detection(values) is None
    detection = first_detection([*values, -1.0, -0.8, -0.5])
    assert detection is not None
    assert detection.step == 203
    assert "above" in detection.reason


def test_noise_measured_on_few_values_is_widened() -> None:
    # Plain +-40% lognormal noise, first 60 steps: the noise measured on 10-30 values is
    # often far too low, and 3 sigma of it was crossed in 20 of 200 seeds (4 now).
    fired = sum(first_detection(noisy(60, 2.0, 0.4, seed=seed)) is not None for seed in range(200))
    assert fired <= 6


def test_two_step_6x_spike_is_ignored() -> None:
    base = noisy(300, 2.0, 0.05)
    base[150:152] = [12.0, 12.0]
    assert first_detection(base) is None


def test_one_step_20x_spike_is_ignored() -> None:
    base = noisy(300, 0.02, 0.2, seed=1)
    base[150] = 0.4
    assert first_detection(base) is None


def test_two_step_huge_jump_fires_fast() -> None:
    base = noisy(200, 2.0, 0.05, seed=2)
    detection = first_detection([*base, 50.0, 60.0])
    assert detection is not None
    assert detection.step == 202


def test_three_elevated_steps_fire_on_the_third() -> None:
    base = noisy(200, 2.0, 0.05, seed=3)
    detection = first_detection([*base, 5.0, 6.0, 7.0, 8.0])
    assert detection is not None
    assert detection.step == 203
    assert detection.value == 7.0


def test_fast_path_needs_two_steps_past_twelve_times() -> None:
    base = noisy(200, 2.0, 0.05, seed=2)
    detection = first_detection([*base, 26.0, 26.0])
    assert detection is not None
    assert detection.step == 202
    assert "for 2 steps" in detection.reason
    assert first_detection([*base, 18.0, 18.0, 2.0, 2.0, 2.0]) is None  # a 9x spike


def test_raised_dip_does_not_reset_persistence() -> None:
    base = noisy(200, 1.0, 0.2, seed=4)
    rise = [3.0, 3.0, 1.3, 3.0]  # noisy new level: the dip is still well above baseline
    detection = first_detection([*base, *rise])
    assert detection is not None
    assert detection.step == 204
    assert "3 of 4" in detection.reason
    assert first_detection([*base, *rise], DivergenceRule(slack=0)) is None


def test_geometric_ramp_fires_on_its_third_elevated_step() -> None:
    # The excess grows each step, so the smallest is under half the largest: `hold` used
    # to read that as a spike's tail, and this ramp fired only at 50x, on its 6th step.
    base = noisy(200, 2.0, 0.05, seed=7)
    detection = first_detection([*base, 3.0, 4.5, 9.0, 20.0, 45.0, 100.0])
    assert detection is not None
    assert detection.step == 203


def test_jump_that_overshoots_then_settles_fires_on_its_fourth_step() -> None:
    # 8x, 8.5x, then a new level at 2.2x: four elevated steps are longer than any spike,
    # whatever their shape. Was the fifth.
    base = noisy(200, 2.0, 0.05, seed=7)
    detection = first_detection([*base, 16.0, 17.0, 4.4, 4.6, 4.4, 4.5])
    assert detection is not None
    assert detection.step == 204
    assert "raised for 4 steps" in detection.reason


def test_jump_past_the_spike_range_that_settles_fires_on_its_third_step() -> None:
    # 11x, 11.5x, then 2.2x (the recorded fresh CNN LR jump 877 does this: 11.8x, 12.7x,
    # 2.1x): a 2-step peak past `spike_ratio` (10x) is taller than any corrupted batch, so
    # its fall is no spike's tail. Fired on the 4th step before.
    base = noisy(200, 2.0, 0.05, seed=7)
    detection = first_detection([*base, 22.0, 23.0, 4.4, 4.6, 4.4, 4.5])
    assert detection is not None
    assert detection.step == 203
    assert "elevated in 3 of 3 steps" in detection.reason
    assert first_detection([*base, 22.0, 23.0, 4.4], DivergenceRule(spike_ratio=12.0)) is None


def test_two_step_9x_spike_with_an_elevated_step_after_it_does_not_fire() -> None:
    # The largest corrupted-batch spikes recorded reach 8-10x the (low) baseline; one more
    # elevated step after them is still a spike's aftermath.
    base = noisy(200, 2.0, 0.05, seed=7)
    assert first_detection([*base, 18.0, 19.0, 3.2, 2.0, 2.0, 2.0, 2.0]) is None
    assert first_detection([*base, 19.0, 18.0, 3.6, 2.0, 2.0, 2.0, 2.0]) is None


def test_spike_with_one_elevated_aftermath_step_does_not_fire() -> None:
    # A 6x two-step spike whose third step is still 1.6x (elevated), then back; and a
    # noisy 1.65x step before a spike that peaks and falls. Both fall from their peak.
    base = noisy(200, 2.0, 0.05, seed=7)
    assert first_detection([*base, 12.0, 12.0, 3.2, 2.0, 2.0, 2.0, 2.0]) is None
    assert first_detection([*base, 3.3, 12.0, 11.0, 2.0, 2.0, 2.0]) is None


def test_spike_back_to_baseline_then_noise_does_not_fire() -> None:
    base = noisy(200, 1.0, 0.2, seed=4)
    assert first_detection([*base, 3.0, 3.0, 1.0, 2.5, 1.0, 1.0]) is None


def test_longer_rise_below_three_sigma_fires_on_its_fourth_step() -> None:
    base = noisy(200, 1.0, 0.2, seed=5)
    detection = first_detection([*base, 1.5, 1.45, 1.55, 1.5, 1.55])
    assert detection is not None
    assert detection.step == 204
    assert "raised for 4 steps" in detection.reason
    assert (
        first_detection([*base, 1.5, 1.45, 1.55, 1.5, 1.55], DivergenceRule(long_sigmas=3.0))
        is None
    )


def test_earlier_spikes_do_not_raise_the_threshold() -> None:
    values = noisy(260, 2.0, 0.05, seed=6)
    values[200:260] = [3.0] * 60  # a real rise to 1.5x
    clean = first_detection(values)
    assert clean is not None
    spiked = list(values)
    spiked[150:152] = [12.0, 12.0]
    spiked[170:172] = [12.0, 12.0]
    detection = first_detection(spiked)
    assert detection is not None
    assert detection.step == clean.step == 203


def test_fires_once_unless_reset() -> None:
    rule = DivergenceRule()
    assert rule.update(1, math.nan) is not None
    assert rule.update(2, math.nan) is None
    assert rule.fired
    rule.reset()
    assert not rule.fired
    assert rule.update(3, math.nan) is not None


def test_rearms_after_excursion_when_not_once() -> None:
    rule = DivergenceRule(once=False)
    values = [1.0] * 50 + [3.0] * 5 + [1.0] * 50 + [3.0] * 3
    fired = [s for s, v in enumerate(values, 1) if rule.update(s, v) is not None]
    assert fired == [53, 108]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"warmup": -1},
        {"window": 2},
        {"persist": 0},
        {"slack": -1},
        {"dip": 2.0},
        {"hold": 1.5},
        {"fast_ratio": 1.0},
        {"spike_ratio": 0.5},
        {"memory": 0},
        {"sigmas": -1.0},
    ],
)
def test_bad_parameters_raise(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="must be"):
        DivergenceRule(**kwargs)


@pytest.mark.xfail(
    strict=True,
    reason="fresh set (never tuned on): batch-size-1 LR jump missed, batch-size-1 LR ramp "
    "fired 4 steps after departure; see docs/divergence.md",
)
def test_fresh_set_within_budget_of_sustained_departure() -> None:
    _within_budget(_delays([r for r in DIVERGING if r["set"] == "fresh"], "departure_s15"))


def test_a_rise_past_a_floats_range_is_reported_not_raised() -> None:
    """A ratio above e^709 overflowed `math.exp` while wording the reason: the rule raised
    OverflowError (the detector failed) instead of reporting the divergence."""
    r = DivergenceRule()
    for i in range(30):
        assert r.update(i, 1e-300 * (1 + 0.01 * (i % 3))) is None
    got = [d for i in range(30, 33) if (d := r.update(i, 1e300)) is not None]
    assert len(got) == 1 and got[0].reason.startswith("e^1382x the baseline")


def test_a_ratio_just_under_a_floats_range_is_worded_as_before() -> None:
    """e^709.5 is still a float (math.exp overflows past ~709.78): the reason said "e^709.5x"
    where the rule always said "1.35e+308x", so a Detection differed from the old rule's."""
    r = DivergenceRule(warmup=0, window=3, noise_window=3, persist=1)
    for i in range(5):
        assert r.update(i, 1.0) is None
    d = r.update(5, math.exp(709.5))
    assert d is not None and d.reason.startswith("1.35e+308x the baseline")


def test_overflowing_differences_leave_the_rule_able_to_detect_later() -> None:
    """Values near the float range (with one <= 0, so differences) make the noise's median
    infinite: its deviations are inf - inf = nan and inf, and their median depends on the
    order they are sorted from. Taken from the already sorted differences it was nan (the old
    rule's arrival order gave inf): a nan threshold froze a baseline no excursion ever left,
    and the rule never fired again (the ramp below went unreported)."""
    r = DivergenceRule(warmup=4, window=3, noise_window=3)
    values = [-1e308, 1e308, -1e308, 1e308] + [1.0] * 30 + [100.0 * 2**k for k in range(10)]
    got = [(i, d) for i, v in enumerate(values) if (d := r.update(i, v)) is not None]
    assert [i for i, _ in got] == [35]
    assert got[0][1].reason == "200x the baseline, for 2 steps"
