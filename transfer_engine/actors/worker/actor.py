"""The TransferWorker actor: its mailbox, and what each mail asks of the parts below it."""

from __future__ import annotations

import anyio
import anyio.abc

from transfer_engine.protocol import messages as m
from transfer_engine.runtime.mail import CancelRoom, Reached, RepeatStaging, WriteEnded, WriteJob

from .core import WorkerMail
from .layerwise import LayerwisePath
from .plan import is_staged_job
from .staged import Lease


class TransferWorker(LayerwisePath):
    """A prefill rank's worker actor (see the package docstring). ``inbox`` takes :data:`WorkerMail`.

    Made with ``(index, me, pool, poller, rooms, outbox, *, staging_bytes, capacity, reserve,
    early_drive)`` (:class:`~.core.WorkerCore`); started with ``tg.start(worker.run)``.
    """

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Handle mail until the inbox closes. Jobs whose KV is not written yet are held; the
        completion waiter's thread starts their WRITEs, and its callbacks post :class:`Reached` when
        the loop has to look (no polling)."""
        self.completions.start()
        try:
            await super().run(task_status=task_status)
        finally:
            self.completions.close()  # its thread is joined: no claim changes after this
            self.let_go_held()
            self.let_go_gathering()
            self.close_all_lists()

    async def handle(self, mail: WorkerMail) -> None:
        self.me.trace.mark_mail("worker", mail)
        match mail:
            case WriteJob(group=group) if group is not None:
                await self.layer_job(mail)
            case WriteJob() if is_staged_job(mail):
                await self.request_region(mail)
            case WriteJob():
                await self.execute(mail)
            case m.StagingGrant() if self.has_layer_region(mail.agent, mail.room, mail.chunk_id):
                await self.on_layer_grant(mail)
            case m.StagingGrant():
                await self.on_grant(mail)
            case m.StagingRefused() if self.has_layer_region(mail.agent, mail.room, mail.chunk_id):
                await self.on_layer_refusal(mail)
            case m.StagingRefused():
                await self.on_refused(mail)
            case m.Watermark():
                await self.on_watermark(mail)
            case WriteEnded(token=Lease() as lease, ok=ok, detail=detail):
                await self.on_lease_ended(lease, ok, detail)
            case CancelRoom(room=room):
                await self.cancel(room)
            case Reached():
                self.reached_taken()
                await self.answer_failed_starts()
                await self.start_ready()
                await self.progress_all()  # parked chunks whose KV was written meanwhile
            case RepeatStaging(before=before):
                self.repeat_requests(before)

    async def cancel(self, room: int) -> None:
        """End every chunk of ``room`` not posted yet: waiting for its KV or a grant, or parked."""
        await self.cancel_held(room)
        self.close_lists(room)
        await self.cancel_regions(room)
        await self.cancel_staged(room)
