"""`eventbus.bench`: what a subscriber costs your step, inline, on the bus, in the sidecar.

    result = eventbus.bench.run(my_step, ["jsonl:/tmp/bench", "mypkg.cb:Spectrum"])
    print(result.table())            # or result.as_dict(), result.plot("bench.png")

`my_step(step, bus)` runs one training step and publishes on `bus`. The command line:
`eventbus bench mypkg.train:step --subscribe SPEC...`. See docs/bench.md.
"""

from eventbus.bench.inline import InlineBus, NullBus
from eventbus.bench.measure import run
from eventbus.bench.report import BenchResult, VariantResult
from eventbus.bench.sources import BenchError, load_step

__all__ = ["BenchError", "BenchResult", "InlineBus", "NullBus", "VariantResult", "load_step", "run"]
