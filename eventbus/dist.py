"""Where this process sits in a distributed job: rank, local rank and world size."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

__all__ = ["RankInfo", "rank_info"]


@dataclass(frozen=True, slots=True)
class RankInfo:
    """Rank, local rank and world size of this process (0, 0, 1 when not distributed)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def rank_info() -> RankInfo:
    """From `torch.distributed` when initialised, else torchrun's environment variables."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return RankInfo(
            rank=dist.get_rank(),
            local_rank=_env_int("LOCAL_RANK", 0),
            world_size=dist.get_world_size(),
        )
    return RankInfo(
        rank=_env_int("RANK", 0),
        local_rank=_env_int("LOCAL_RANK", 0),
        world_size=_env_int("WORLD_SIZE", 1),
    )
