"""The TransferWorker actor: its mailbox, the parts it owns, and which part each mail goes to."""

from __future__ import annotations

import functools
import logging
from collections import defaultdict

import anyio
import anyio.abc

from transfer_engine.errors import FailureReason, TransferError
from transfer_engine.memory.integrity import PoolChecksums
from transfer_engine.memory.layout import KVPool
from transfer_engine.protocol import messages as m
from transfer_engine.runtime.completion import CompletionWaiter
from transfer_engine.runtime.mail import CancelRoom, Reached, RepeatStaging, WriteEnded, WriteJob
from transfer_engine.runtime.ports import Outbox, RankIdentity, RoomBoard, WritePort

from ..base import Actor
from .core import Made, OwnInbox, Sealer, WorkerMail, answer
from .direct import TABLE_MAX_DESCRIPTORS, DirectPath
from .held import HeldJobs, is_ready
from .kernel import KernelPath
from .layerwise import StagedGroups
from .plan import is_staged_job
from .staged import Lease, StagedPath

log = logging.getLogger(__name__)


class TransferWorker(Actor[WorkerMail]):
    """A prefill rank's worker actor (see the package docstring). ``inbox`` takes :data:`WorkerMail`;
    started with ``tg.start(worker.run)``.

    It owns its parts, built here, each handed only the ports it uses: :attr:`held` (jobs held until
    their KV is written), :attr:`direct` (direct and slice WRITEs, and their layer groups),
    :attr:`staged` (staged and host WRITEs: regions, leases, gathers) and :attr:`staged_groups` (the
    layer groups of staged chunks). It reads each mail and hands it to the part that carries it.
    """

    def __init__(
        self,
        index: int,
        me: RankIdentity,
        pool: KVPool,
        poller: WritePort,
        rooms: RoomBoard,
        outbox: Outbox,
        *,
        staging_bytes: int,
        capacity: int = 4096,
        reserve: int = 0,
        early_drive: float = 0.0,
        checksums: PoolChecksums | None = None,
        table_max_descriptors: int = TABLE_MAX_DESCRIPTORS,
    ) -> None:
        super().__init__(capacity, reserve)
        self.index = index
        self.me = me
        self.counters: dict[str, int] = defaultdict(int)
        """Every part's counters, by name (``watermark_waits``, ``early_starts``...)."""
        self.completions = CompletionWaiter(f"worker-{index}")
        """Wakes this worker when its gathers' stream or its jobs' ready events complete."""
        self._own = OwnInbox(self.inbox)
        self._sealer = Sealer(pool, checksums)
        done = functools.partial(answer, rooms)
        self._done = done
        self._taking = False
        self._refused: dict[int, TransferError] = {}
        """Jobs (by id) whose WRITE :meth:`_take` tried and was refused, queued for their answer."""
        self.inbox.taker = self._take
        trace = me.trace
        self.held = HeldJobs(
            index, poller, rooms, self._own, self.completions, done,
            trace=trace, counters=self.counters, early_drive=early_drive,
        )  # fmt: skip
        self.direct = DirectPath(
            index, pool, poller, rooms, self.held, self._sealer.sealed, done,
            trace=trace, counters=self.counters, table_max_descriptors=table_max_descriptors,
        )  # fmt: skip
        self.staged = StagedPath(
            index, pool, poller, outbox, self.held, self._own, self.completions, self._sealer.sealed,
            done, agent_name=me.agent_name, trace=trace, counters=self.counters,
            staging_bytes=staging_bytes,
        )  # fmt: skip
        self.staged_groups = StagedGroups(
            pool, outbox, self.staged, self.held, done,
            agent_name=me.agent_name, trace=trace, counters=self.counters,
        )  # fmt: skip
        self.kernel = KernelPath(
            index, pool, outbox, self._own, self.completions, done, self._through_nixl,
            lambda: self._sealer.checksums is not None, trace=trace, counters=self.counters,
        )  # fmt: skip

    # --- what the engine and the snapshot read (observe, the leak check) ----------------------------

    @property
    def checksums(self) -> PoolChecksums | None:
        """Integrity on: what a chunk's WRITE is sealed with (``EngineConfig.integrity``)."""
        return self._sealer.checksums

    @checksums.setter
    def checksums(self, checksums: PoolChecksums | None) -> None:
        self._sealer.checksums = checksums

    @property
    def depth(self) -> int:
        """Mails queued in the inbox."""
        return len(self.inbox)

    @property
    def held_jobs(self) -> int:
        """Jobs held until their KV is written (0 when idle)."""
        return self.held.held_jobs

    @property
    def layer_jobs(self) -> int:
        """Jobs held until their KV is written (layer groups, direct chunks), and layer-wise regions held
        (0 when idle)."""
        return self.held.held_jobs + self.staged_groups.regions + self.kernel.held_jobs

    @property
    def parked(self) -> int:
        """Staged chunks granted a region but waiting for the watermark or a staging lease."""
        return self.staged.parked

    @property
    def awaiting_grant(self) -> int:
        """Chunks (whole, or a layer-wise chunk's region) whose ring region was asked for and not
        granted yet."""
        return self.staged.awaiting_grant + self.staged_groups.awaiting_grant

    def leases(self) -> int:
        """Staging-buffer leases held (0 when idle: the leak check)."""
        return self.staged.leases()

    # --- the mailbox -----------------------------------------------------------------------------

    def _take(self, mail: WorkerMail) -> bool:
        """The inbox's taker (docs/DECISIONS.md, "A room applies mail in the sender's call when it
        waits"): a direct WriteJob whose KV is written, posted while this worker waits on its empty
        inbox, is planned, made and started in the poster's call (the room's), not one loop turn
        later; so is a kernel-path job (its copy launched, or the job held until its KV is written:
        :meth:`KernelPath.try_start`). False (queued as before) for anything else, and for a job whose
        WRITE was refused or that the kernel part has to answer or hand to NIXL: :meth:`handle` does
        that, without trying it again."""
        if self._taking or not self.inbox.waiting or not isinstance(mail, WriteJob):
            return False
        if self.kernel.takes(mail):
            self._taking = True
            try:
                self.me.trace.mark_mail("worker", mail)
                taken = self.kernel.try_start(mail)
                self.counters["kernel_taken"] += taken
                return taken
            finally:
                self._taking = False
        if (
            mail.group is not None
            or is_staged_job(mail)
            or self._sealer.checksums is not None
            or (mail.ready is not None and not is_ready(mail.ready))
        ):
            return False
        self._taking = True
        try:
            self.me.trace.mark_mail("worker", mail)
            self.direct.start_made(mail, self.direct._make_direct(mail))
        except TransferError as exc:
            self._refused[id(mail)] = exc
            return False
        finally:
            self._taking = False
        return True

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Handle mail until the inbox closes. Jobs whose KV is not written yet are held; the
        completion waiter's thread starts their WRITEs, and its callbacks post :class:`Reached` when
        the loop has to look (no polling)."""
        self.completions.start()
        try:
            await super().run(task_status=task_status)
        finally:
            self.completions.close()  # its thread is joined: no claim changes after this
            self.held.let_go_all()
            self.staged.let_go_gathering()
            self.direct.close_all_lists()
            self.kernel.close()  # after the waiter: no copy's callback can come any more

    async def handle(self, mail: WorkerMail) -> None:
        self.me.trace.mark_mail("worker", mail)
        match mail:
            case WriteJob() if id(mail) in self._refused:  # refused in the poster's call (_take)
                exc = self._refused.pop(id(mail))
                log.warning("worker %d: room %d: %s", self.index, mail.room, exc)
                await self._done(mail, False, str(exc), FailureReason.TRANSPORT)
            case WriteJob() if self.kernel.takes(mail):
                await self.kernel.execute(mail)
            case WriteJob(group=group) if group is not None and is_staged_job(mail):
                await self.staged_groups.layer_group(mail)
            case WriteJob(group=group) if group is not None:
                await self.direct.layer_group(mail)
            case WriteJob() if is_staged_job(mail):
                await self.staged.request_region(mail)
            case WriteJob():
                await self.direct.execute(mail)
            case m.StagingGrant() if self.staged_groups.has_layer_region(
                mail.agent, mail.room, mail.chunk_id
            ):
                await self.staged_groups.on_grant(mail)
            case m.StagingGrant():
                await self.staged.on_grant(mail)
            case m.StagingRefused() if self.staged_groups.has_layer_region(
                mail.agent, mail.room, mail.chunk_id
            ):
                await self.staged_groups.on_refused(mail)
            case m.StagingRefused():
                await self.staged.on_refused(mail)
            case m.Watermark():
                await self.staged.on_watermark(mail)
            case WriteEnded(token=Lease() as lease, ok=ok, detail=detail):
                await self.staged.on_lease_ended(lease, ok, detail)
            case CancelRoom(room=room):
                await self.cancel(room)
            case Reached():
                self._own.woken()
                await self.kernel.on_reached()
                await self.held.answer_failed_starts()
                for job, made in self.held.take_ready():
                    await self._start_held(job, made)
                await self.staged.progress_all()  # parked chunks whose KV was written meanwhile
            case RepeatStaging(before=before):
                self.staged.repeat_requests(before)
                self.staged_groups.repeat_requests(before)

    async def _start_held(self, job: WriteJob, made: Made | None) -> None:
        """Start a held job whose KV is written, through the part that carries it: a staged layer
        group through its chunk's region, any other (a direct or slice group, a direct chunk) with
        ``made``, the WRITE made for it while it was held."""
        if is_staged_job(job):
            await self.staged_groups.start(job)
        else:
            await self.direct.execute(job, made)

    async def _through_nixl(self, job: WriteJob) -> None:
        """A kernel-path job the kernel part hands back (no mapping): the direct part's WRITE of its slice."""
        if job.group is not None:
            await self.direct.layer_group(job)
        else:
            await self.direct.execute(job)

    async def cancel(self, room: int) -> None:
        """End every chunk of ``room`` not posted yet: waiting for its KV or a grant, or parked."""
        await self.held.cancel(room)
        await self.kernel.cancel(room)
        self.direct.close_lists(room)
        await self.staged_groups.cancel(room)
        await self.staged.cancel(room)
