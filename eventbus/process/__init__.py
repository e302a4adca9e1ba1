"""`placement="process"`: a subscriber in a child process, so its Python work never holds our GIL.

    bus thread (parent)                               child process (spawn)
    its queue --batch--> ProcessSubscriber            core.delivery: on_events(batch) / fn(ev)
      wire.pack (type name + field tuples)     --->   wire.unpack -> events
      await the reply in an I/O thread         <---   ok | error + event type, events it
      count ok / failed like any subscriber             published, its Control's requests

Modules: `wire` (the message format), `spawn` (launching and ending the child, the parent's
`__main__`), `proxy` (the parent's `ProcessSubscriber`), `child` (the child's loop).

The subscriber must be picklable, or be given as an import path `"package.module:factory"`
with `args` / `kwargs`, built in the child. A subscriber class defined in the script being
run makes the child import that script (as multiprocessing's spawn does, only then): its
training code must sit under `if __name__ == "__main__":`; an unguarded script fails to start
the child with an error saying so.
"""

from eventbus.process.errors import ChildProcessDied, ChildProcessHung, RemoteError, SubscriberGone
from eventbus.process.proxy import ProcessSubscriber

__all__ = [
    "ChildProcessDied",
    "ChildProcessHung",
    "ProcessSubscriber",
    "RemoteError",
    "SubscriberGone",
]
