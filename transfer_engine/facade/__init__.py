"""The engine for threaded callers (serving systems' schedulers), and the one loop-thread bridge.

- :class:`BlockingEngine`, :class:`BlockingSender`, :class:`BlockingReceiver`: a rank's engine on a
  loop thread of its own, with methods that say how long they may block
  (:mod:`transfer_engine.facade.blocking`);
- :class:`LoopThread`: one asyncio event loop on a daemon thread, and the only way code on other
  threads hands work to a loop (:mod:`transfer_engine.facade.bridge`);
- :class:`BootstrapServer`: the prefill instance's bootstrap registry on a LoopThread
  (:mod:`transfer_engine.facade.bootstrap`);
- :func:`recorded`: a CUDA event recorded on a stream now (the caller's: the work it queued so far),
  for a ``ready`` a caller hands over (:func:`transfer_engine.events.recorded`).
"""

from transfer_engine.events import recorded
from transfer_engine.facade.blocking import BlockingEngine, BlockingReceiver, BlockingSender
from transfer_engine.facade.bootstrap import BootstrapServer
from transfer_engine.facade.bridge import LoopThread

__all__ = [
    "BlockingEngine",
    "BlockingReceiver",
    "BlockingSender",
    "BootstrapServer",
    "LoopThread",
    "recorded",
]
