"""`placement="process"`: subscribers in the bus's sidecar process, off the training GIL.

    bus thread (parent)                               sidecar process (one per bus)
    router --> queue["sidecar"] --> Sidecar           a bus of its own: inbox, router, queues,
      keep what its subscribers want, pack once  ---> delivery (the same engine), each
      post within a byte window (backpressure)        subscriber with its own policy
      acks, counters, events, stop requests, logs <---

Modules: `wire` (the message format), `spawn` (launching the child, the parent's `__main__`),
`proxy` (`ProcessSubscriber`: what to build there), `channel` (the socket and its threads),
`remote` (a sidecar subscriber as the parent counts it), `sidecar` (the parent's side),
`child` (the sidecar's side).

A subscriber goes there from its pickle, or from an import path `"package.module:factory"`
with `args` / `kwargs`. A subscriber class defined in the script being run makes the sidecar
import that script (as multiprocessing's spawn does, only then): its training code must sit
under `if __name__ == "__main__":`; an unguarded script fails to build the subscriber there,
with an error saying so.
"""

from eventbus.process.errors import RemoteError, RemoteTimeout
from eventbus.process.proxy import ProcessSubscriber

__all__ = ["ProcessSubscriber", "RemoteError", "RemoteTimeout"]
