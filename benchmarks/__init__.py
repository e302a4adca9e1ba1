"""Benchmarks: eventbus against the callback systems users already have.

Run them all with `python -m benchmarks [--quick] [--json FILE]`; each module also has a
`run(quick) -> dict` of flat dotted keys (`overhead.*`, `stall.*`, `throughput.*`, ...).
"""
