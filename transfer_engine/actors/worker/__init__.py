"""TransferWorker actor (prefill): turns a room's chunk into one WRITE to one decode rank.

The engine runs N workers and shards jobs by destination decode agent, so every chunk a room sends
to one decode rank goes through one worker, in order. Every job a worker is given ends in exactly
one reply to its room: the poller's :class:`~transfer_engine.runtime.mail.WriteEnded` for a WRITE
it started, or a :class:`~transfer_engine.runtime.mail.WriteDone` from the worker (refused,
cancelled, staged WRITE finished). ``CancelRoom`` ends a failed room's chunks that are not posted
yet. The worker never waits on the network or on the GPU.

The worker owns its parts, one module each, built in its ``__init__`` and each handed only the
ports it uses; calls go down the list, never back up (:mod:`.core` says what they share):

- :mod:`.actor`: :class:`TransferWorker`, the mailbox: which part each mail goes to;
- :mod:`.layerwise`: the layer groups of a staged chunk, and that chunk's one region;
- :mod:`.direct`: direct and slice WRITEs, their layer groups, and the lists those groups share;
- :mod:`.staged`: staged and host WRITEs, gathered into a staging lease, written into a ring region;
- :mod:`.held`: jobs held until their KV is written, their WRITEs started by the completion waiter's
  thread (the one cross-thread state machine);
- :mod:`.core`: the mail, a WRITE made ahead and its seal, the worker's own reply and inbox, and
  :class:`~.core.Starter` (the held part starting what the direct part made);
- :mod:`.plan`: what a job moves, as pure functions (descriptors, slots, notifications).
"""

from .actor import TransferWorker
from .core import WorkerMail
from .kernel import warm_copy_kernel

__all__ = ["TransferWorker", "WorkerMail", "warm_copy_kernel"]
