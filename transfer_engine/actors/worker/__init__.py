"""TransferWorker actor (prefill): turns a room's chunk into one WRITE to one decode rank.

The engine runs N workers and shards jobs by destination decode agent, so every chunk a room sends
to one decode rank goes through one worker, in order. Every job a worker is given ends in exactly
one reply to its room: the poller's :class:`~transfer_engine.runtime.mail.WriteEnded` for a WRITE
it started, or a :class:`~transfer_engine.runtime.mail.WriteDone` from the worker (refused,
cancelled, staged WRITE finished). ``CancelRoom`` ends a failed room's chunks that are not posted
yet. The worker never waits on the network or on the GPU.

One module per part, each adding to the one before it (:mod:`.core` says how they fit):

- :mod:`.plan`: what a job moves, as pure functions (descriptors, slots, notifications);
- :mod:`.core`: identity, ports, counters, the completion waiter, the worker's own reply;
- :mod:`.held`: jobs held until their KV is written, their WRITEs started by the completion waiter's
  thread (the one cross-thread state machine);
- :mod:`.direct`: direct and slice WRITEs, and the lists a chunk's layer groups share;
- :mod:`.staged`: staged and host WRITEs, gathered into a staging lease, written into a ring region;
- :mod:`.layerwise`: layer groups, and a layer-wise staged chunk's one region;
- :mod:`.actor`: :class:`TransferWorker`, the mailbox.
"""

from .actor import TransferWorker
from .core import WorkerMail

__all__ = ["TransferWorker", "WorkerMail"]
