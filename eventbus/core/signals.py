"""`SignalDrain`: on SIGTERM, close the bus (draining lossless subscribers), then do what the
process did before: run the handler that was installed, or exit with 128 + the signal.

torchrun and SLURM send SIGTERM before they kill; without this, what the bus held was lost.
Only the main thread may set handlers: elsewhere it installs nothing (close and atexit still
drain). A process that ignores SIGTERM keeps ignoring it.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from eventbus.core.ending import RunEnding

__all__ = ["SignalDrain"]

SIGNALS = (signal.SIGTERM,)


class SignalDrain:
    """Installs `close` as the SIGTERM handler, chaining the one it replaces."""

    def __init__(
        self, close: Callable[[], Any], timeout: Callable[[], float], ending: RunEnding
    ) -> None:
        self._close = close
        self._ending = ending  # told which signal ended the run
        self._timeout = timeout  # how long the drain may take (the bus's close_timeout)
        self._prev: dict[int, Any] = {}
        self._restored = False  # closed: a handler still in someone's chain only passes on

    def install(self) -> None:
        """Install (main thread only); the previous handlers are kept for chaining."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in SIGNALS:
            prev = signal.getsignal(sig)
            if prev is signal.SIG_IGN:
                continue
            self._prev[sig] = prev
            signal.signal(sig, self._on_signal)

    def restore(self) -> None:
        """Put back what was there, unless someone replaced us meanwhile: then we stay in
        their chain, and still pass the signal on to what we replaced."""
        if threading.current_thread() is not threading.main_thread():
            return
        self._restored = True
        for sig, prev in list(self._prev.items()):
            if signal.getsignal(sig) == self._on_signal:
                signal.signal(sig, _unwrap(prev, sig))
                del self._prev[sig]

    def forget(self) -> None:
        """In a forked child: the handlers are the parent's business."""
        self._prev.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        prev = self._prev.get(signum, signal.SIG_DFL)
        # Drain on a thread of its own: the code this handler interrupted may hold a lock the
        # close path needs; waiting here with a deadline, the process ends either way.
        self._ending.signalled(signal.Signals(signum).name)
        closer = threading.Thread(target=self._close, name="eventbus-sigterm", daemon=True)
        closer.start()
        closer.join(self._timeout() + 5.0)
        self.restore()
        if callable(prev):
            prev(signum, frame)
        elif prev != signal.SIG_IGN:
            raise SystemExit(128 + signum)


def _unwrap(handler: Any, sig: int) -> Any:
    """Skip the handlers of buses already closed (another bus put them in its chain): put
    back what the user had installed, not a closed bus's pass-through."""
    while isinstance(getattr(handler, "__self__", None), SignalDrain):
        drain = handler.__self__
        if not drain._restored:
            break
        handler = drain._prev.get(sig, signal.SIG_DFL)
    return handler
