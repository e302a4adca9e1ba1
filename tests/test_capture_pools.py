"""The capture pools: pinned buffers reused within their bounds, safely across threads."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from eventbus._capture_pools import PinnedPool


def test_pool_reuses_buffers_and_respects_its_bounds() -> None:
    pool = PinnedPool(max_bytes=64, max_per_key=2)
    a, b, c = (torch.empty(4) for _ in range(3))  # 16 bytes each (put never pins)
    for buf in (a, b, c):
        pool.put(buf)
    assert pool.statistics()["free"] == 2  # per-key bound
    got = pool.get(torch.float32, (4,))
    assert got is b or got is a
    assert pool.statistics()["reused"] == 1
    pool.put(torch.empty(100))  # 400 bytes: over the byte bound, dropped
    assert pool.statistics()["free_bytes"] <= 64
    with pytest.raises(ValueError, match="bounds"):
        PinnedPool(max_bytes=-1)


def test_pool_is_safe_under_concurrent_get_and_put() -> None:
    pool = PinnedPool(max_bytes=1 << 20, max_per_key=1000)
    bufs = [torch.empty(2) for _ in range(200)]
    for buf in bufs:
        pool.put(buf)
    taken: list[list[Any]] = [[] for _ in range(4)]

    def take(i: int) -> None:
        for _ in range(50):
            taken[i].append(pool.get(torch.float32, (2,)))

    threads = [threading.Thread(target=take, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    ids = [id(x) for lst in taken for x in lst]
    assert len(ids) == 200 == len(set(ids))  # nobody got the same buffer twice
    assert pool.statistics() == {"allocated": 0, "reused": 200, "free": 0, "free_bytes": 0}
