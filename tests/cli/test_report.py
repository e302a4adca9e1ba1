"""The report: seq numbers counted exactly in any order, bad values named by file:line."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from eventbus.cli.report import SeqCounter, collect
from eventbus.codec import encode
from eventbus.events import DivergenceDetected, Loss
from eventbus.logformat import LogReadError


@pytest.mark.parametrize("window", [1, 3, 64, 4096])
def test_seq_counter_agrees_with_a_set_in_any_order(window: int) -> None:
    rng = random.Random(window)
    for _ in range(400):
        base = rng.choice([0, 1, 2**40])
        n = rng.randint(1, 300)
        kept = [base + s for s in range(n) if rng.random() > 0.2] or [base]
        repeats = [rng.choice(kept) for _ in range(rng.randint(0, 3))]
        seqs = kept + repeats
        if rng.random() < 0.5:
            rng.shuffle(seqs)
        else:  # several threads: each seq a few places from its own
            for i in range(len(seqs)):
                j = min(len(seqs) - 1, i + rng.randint(0, 6))
                seqs[i], seqs[j] = seqs[j], seqs[i]
        c = SeqCounter(window=window)
        for s in seqs:
            c.add(s)
        assert c.missing == max(kept) - min(kept) + 1 - len(set(kept)), seqs
        assert c.duplicates == len(repeats)


def test_seq_counter_memory_stays_bounded_across_gaps() -> None:
    c = SeqCounter(window=100)
    for s in range(0, 200_000, 2):  # every other number lost
        c.add(s)
    assert c.missing == 99_999
    assert len(c.ahead) <= 101


def test_a_value_the_summary_cannot_use_is_named_by_file_and_line(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    bad = encode(DivergenceDetected(step=2, value=1.0, baseline=1.0)).replace(
        b'"value":1.0', b'"value":"high"'
    )
    log.write_bytes(encode(Loss(step=1, value=1.0)) + bad)
    with pytest.raises(
        LogReadError,
        match=r"events\.jsonl:2: DivergenceDetected\.value must be "
        r"a number, got 'high'",
    ):
        collect([log])
