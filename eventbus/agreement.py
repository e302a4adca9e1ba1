"""Agreed stop and save: `bus.should_stop` decided by all ranks together, at the same check.

A stop asked on one rank (a monitor saw NaN there) must stop every rank at the same step, or
the others wait forever in their next collective. Each check is one all_reduce(MAX) of four
ints (stop, abort, stopping rank + 1, saving rank + 1) over the job's process group; every rank
takes part in every check whether it asked or not, so nothing waits for a rank that has
nothing to say. A save asked on one rank (`eventbus ctl save` reaches rank 0) rides the same
collective: at the check that carries it, `control.save_requested` turns True on every rank.

    rank 0: should_stop -> all_reduce([0, 0, 0, 1]) --+
                                                     +--> [1, 0, 2, 1] on both: stop, asked
    rank 1: should_stop -> all_reduce([1, 0, 2, 0]) --+    on rank 1; save, asked on rank 0

Checks run on every `every`-th call (the calls between return the last agreed value), only on
the thread that made the first call, only in the process that created the bus. Once a stop is
agreed the answer is frozen and no further collective runs (code after the loop may check on
some ranks only). By default (`overlap=True`) the all_reduce started at check k is read at
check k+1: its wait hides behind a step, and a stop is seen one check later, still by all
ranks at the same check. `overlap=False` waits at the check itself.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

from eventbus.control import Control
from eventbus.log import get_logger

__all__ = ["StopAgreement"]


def _dist() -> Any:
    """`torch.distributed` if it was imported and initialised (never imports torch)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist
    return None


class StopAgreement:
    """What `Control.agree` calls: (local stop, local abort) -> (stop, abort) agreed by all ranks.

    `every`: run the collective on every N-th call only. `group`: the process group (default:
    the job's). `overlap` (default): start at one check, read it at the next, so the wait hides
    behind a step and a stop lands one check later; False: wait at the check itself. All ranks
    must call `should_stop` / `should_abort` the same number of times (a normal loop does).
    """

    def __init__(
        self, control: Control, *, every: int = 1, group: Any = None, overlap: bool = True
    ) -> None:
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"stop_check_every must be an int >= 1, got {every!r}")
        self.control = control
        self.every = every
        self.group = group
        self.overlap = overlap
        self.checks = 0  # collectives completed
        self.check_ns = 0  # time spent in them on this thread (launch + wait + read)
        self.decided_at: int | None = None  # the check (1-based) at which a stop was agreed
        self._agreed = (False, False)
        self._frozen = False
        self._calls = 0
        self._owner: int | None = None
        self._pid = os.getpid()
        self._warned = False
        self._dev: Any = None  # device-side buffer (CUDA) or the CPU tensor (gloo)
        self._host: Any = None  # pinned host copy of the result (CUDA only)
        self._done: Any = None  # CUDA event recorded after the result's copy to the host
        self._work: Any = None  # the all_reduce in flight (overlap)

    @property
    def in_flight(self) -> bool:
        """True while an overlapped all_reduce waits to be read at the next check."""
        return self._work is not None

    @property
    def agreed(self) -> tuple[bool, bool]:
        """The last (stop, abort) all ranks agreed on."""
        return self._agreed

    def __call__(self, stop: bool, abort: bool) -> tuple[bool, bool]:
        if self._frozen:
            return self._agreed
        dist = _dist()
        if dist is None:
            self._warn_once()
            if self.control.save_pending:
                self.control.save_agreed()  # nobody to agree with yet: this rank's own
            return stop, abort
        tid = threading.get_ident()
        if self._owner is None:
            self._owner = tid
        elif tid != self._owner:
            return self._agreed  # another thread (a monitor) never joins a collective
        calls = self._calls
        self._calls = calls + 1
        if calls % self.every:
            return self._agreed
        if os.getpid() != self._pid:
            return stop, abort  # a forked child has no place in the job's collectives
        t0 = time.perf_counter_ns()
        try:
            result = self._check(dist, stop, abort)
        finally:
            self.check_ns += time.perf_counter_ns() - t0
        if result is not None:
            self._decide(dist, *result)
        return self._agreed

    def _warn_once(self) -> None:
        if not self._warned:
            self._warned = True
            get_logger().warning(
                "bus.should_stop is not agreed across ranks: torch.distributed is not "
                "initialised yet (call init_process_group before the training loop)"
            )

    def _check(self, dist: Any, stop: bool, abort: bool) -> tuple[int, int, int] | None:
        """One collective (or, with overlap, read the previous one and start the next)."""
        import torch

        if self._dev is None:
            self._setup(dist, torch)
        if not self.overlap:
            self._start(dist, torch, self._local(dist, stop, abort))
            return self._read()
        result = self._read() if self._work is not None else None  # none yet at check 1
        if result is None or not result[0]:  # every rank read the same result: all start
            self._start(dist, torch, self._local(dist, stop, abort))
        return result

    def _local(self, dist: Any, stop: bool, abort: bool) -> list[int]:
        """This rank's part: read after the previous result, so a save it carried is not
        sent twice."""
        me = dist.get_rank() + 1
        return [
            int(stop or abort),
            int(abort),
            me if (stop or abort) else 0,
            me if self.control.save_pending else 0,
        ]

    def _read(self) -> tuple[int, int, int]:
        """The collective's result: (stop, abort, requester); a save in it is handed over."""
        stop, abort, requester, saver = self._finish()
        if saver:
            self.control.save_agreed(asked_on=saver - 1)
        return stop, abort, requester

    def _setup(self, dist: Any, torch: Any) -> None:
        backend = str(dist.get_backend(self.group))
        if "gloo" in backend or "nccl" not in backend:
            self._dev = torch.zeros(4, dtype=torch.int64)
        else:  # NCCL only reduces CUDA tensors: a buffer on this rank's current device
            dev = torch.device("cuda", torch.cuda.current_device())
            self._dev = torch.zeros(4, dtype=torch.int64, device=dev)
            self._host = torch.zeros(4, dtype=torch.int64).pin_memory()
            self._done = torch.cuda.Event()

    def _start(self, dist: Any, torch: Any, local: list[int]) -> None:
        buf = self._dev
        if self._host is None:
            buf.copy_(torch.tensor(local, dtype=torch.int64))
            self._work = dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
            return
        host = self._host
        host[0], host[1], host[2], host[3] = local  # pinned; the last copy from it is done
        buf.copy_(host, non_blocking=True)  # async H2D from pinned memory: no sync
        work = dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        work.wait()  # NCCL: makes the current stream wait for the collective; no host wait
        host.copy_(buf, non_blocking=True)  # async D2H into pinned memory: no sync here
        self._done.record()
        self._work = work

    def _finish(self) -> tuple[int, int, int, int]:
        if self._host is None:
            self._work.wait()  # gloo: the collective itself, on CPU (no device involved)
            out = self._dev.tolist()
        else:
            # The one host wait of a check on CUDA: until the result reached the host, i.e.
            # until the device finished the work queued before this check's all_reduce (a
            # partial sync; with overlap it is the previous check's, normally long done).
            self._done.synchronize()
            out = self._host.tolist()
        self._work = None
        self.checks += 1
        return out[0], out[1], out[2], out[3]

    def _decide(self, dist: Any, stop: int, abort: int, requester: int) -> None:
        if not stop:
            return
        self._agreed = (True, bool(abort))
        self._frozen = True
        self.decided_at = self.checks
        ctl = self.control
        if not ctl.stop_requested or (abort and not ctl.abort_requested):
            # Asked on another rank: record it here too (a StopRequested event in this
            # rank's log) so every rank's log says why it stopped.
            reason = f"{'abort' if abort else 'stop'} requested on rank {requester - 1}"
            source = f"rank {requester - 1}"
            if abort:
                ctl.request_abort(reason, source=source)
            else:
                ctl.request_stop(reason, source=source)
        get_logger().info(
            "stop agreed across ranks",
            abort=bool(abort),
            asked_on_rank=requester - 1,
            rank=dist.get_rank(),
            check=self.checks,
        )
