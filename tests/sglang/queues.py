"""SGLang 0.5.23's own disaggregation queues, driven in one process per TP rank.

Each rank process does what SGLang's scheduler process does before its event loop: parses
``ServerArgs`` from a command line (SGLang's defaults for everything not given), publishes them
(``runtime_context.publish`` with the rank's placement), joins a gloo group with the other ranks of
its side (the group SGLang all-reduces polls over), and builds SGLang's real CPU pools:
``ReqToTokenPool``, ``MHATokenToKVPool`` / ``MLATokenToKVPool`` on device ``cpu``, the paged
allocator and a ``RadixCache`` with the radix cache disabled, as SGLang builds them by default on
a disaggregated instance (a decode's is on where the plan's prompts share prefixes). Then it runs
SGLang's queues over real ``Req`` objects:

- prefill: ``PrefillBootstrapQueue`` (``add``, ``pop_bootstrapped``), then the scheduler mixin's
  ``send_kv_chunk`` and ``process_disagg_prefill_inflight_queue``;
- decode: ``DecodePreallocQueue`` (``add``, ``pop_preallocated``) and ``DecodeTransferQueue``
  (``pop_transferred``, ``resolve_deferred_releases``).

:class:`Scheduler` holds what those classes read from SGLang's ``Scheduler``. The only stand-in
is the model forward: the prefill writes a deterministic pattern (:func:`token_bytes`) into the
pages its allocator gave the request, and the decode checks every byte of every page it received.
"""

from __future__ import annotations

import json
import os
import signal
import time
import traceback
from array import array
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from tests.sglang.conftest import enable_sglang_scheduler_imports

enable_sglang_scheduler_imports()  # torchvision where SGLang's scheduler modules find it (conftest.py)

from sglang.srt.disaggregation.decode import SchedulerDisaggregationDecodeMixin  # noqa: E402
from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin  # noqa: E402

PAGE = 4
"""Tokens per page (``--page-size``), the prefill's always; a decode's may be larger (:attr:`Plan.page_size`)."""
LAYERS = 3
HEADS = 4
HEAD_DIM = 16
LATENT = 24
"""MLA: ``kv_lora_rank`` + ``qk_rope_head_dim`` (16 + 8) bf16 elements per token per layer."""
POOL_TOKENS = 64 * PAGE
"""The prefill's pool."""
DECODE_POOL_TOKENS = 1024 * PAGE
"""The decode's pool: SGLang's decode admits a request only with ``--num-reserved-decode-tokens``
(512 by default) free beyond it for every request in flight."""


def write_model(directory: str, mla: bool) -> str:
    """A model directory holding only an HF ``config.json``: SGLang resolves its arguments from it."""
    if mla:
        config = {
            "model_type": "deepseek_v3",
            "architectures": ["DeepseekV3ForCausalLM"],
            "num_hidden_layers": LAYERS,
            "hidden_size": 64,
            "num_attention_heads": HEADS,
            "num_key_value_heads": HEADS,
            "kv_lora_rank": 16,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 16,
            "v_head_dim": 16,
            "q_lora_rank": None,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "first_k_dense_replace": LAYERS,
            "vocab_size": 256,
            "torch_dtype": "bfloat16",
        }
    else:
        config = {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "num_hidden_layers": LAYERS,
            "hidden_size": HEADS * HEAD_DIM,
            "num_attention_heads": HEADS,
            "num_key_value_heads": HEADS,
            "head_dim": HEAD_DIM,
            "intermediate_size": 128,
            "vocab_size": 256,
            "torch_dtype": "bfloat16",
        }
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return directory


@dataclass
class Plan:
    """What one side does; the same plan is given to every rank of that side."""

    role: str
    tp_size: int
    rank: int
    group_port: int
    bootstrap_port: int
    mla: bool
    model: str
    """A directory from :func:`write_model`."""
    waves: list[list[tuple[int, int]]]
    """(bootstrap room, prompt tokens) of each request; a wave arrives once the last one is done on
    this side, so its pages are the ones the last wave freed (reused at once)."""
    abort_rooms: list[int] = field(default_factory=list)
    """Rooms this side aborts as soon as it has sent (prefill) or received pages for them (decode)."""
    die_in_room: int = 0
    """Prefill: the process kills itself (SIGKILL) once this room is bootstrapped, before its forward."""
    timeout_s: float = 60.0
    page_size: int = PAGE
    """This side's ``--page-size``."""
    chunk_tokens: int = 0
    """Prefill: chunked prefill, one chunk of this many tokens per scheduler step, each sent as SGLang's
    non-overlap scheduler sends it (a middle chunk by ``process_prefill_chunk``, the last after its
    forward); 0: the whole prompt in one forward and one send. A room in :attr:`abort_rooms` is
    aborted after its first chunk, mid-room, as SGLang aborts a request it is still chunking."""
    prefix_of: dict[int, int] = field(default_factory=dict)
    """Room -> an earlier room whose whole prompt this room's prompt starts with. Non-empty on a
    decode: SGLang's decode radix cache is on (``--disaggregation-decode-enable-radix-cache``), a
    received room's KV stays in it, and a later room's cached prefix goes to the prefill as
    ``decode_prefix_len`` (only the rest is sent)."""


def prompt(plan: Plan, room: int) -> list[int]:
    """The token ids of ``room``'s prompt (its length from the plan's waves)."""
    tokens = {r: t for wave in plan.waves for r, t in wave}
    base = prompt(plan, plan.prefix_of[room]) if room in plan.prefix_of else []
    return (base + [(room + i) % 250 + 1 for i in range(len(base), tokens[room])])[: tokens[room]]


def token_bytes(ids: list[int], buffers: int, heads: int, head_bytes: int) -> torch.Tensor:
    """The bytes the forward writes for a prompt: [buffer, token, head, byte], every head of the model.
    A token's bytes follow from its position and id, so prompts that share a prefix share its KV."""
    out = []
    for position, token in enumerate(ids):
        gen = torch.Generator().manual_seed(position * 7919 + token * 17 + 1)
        out.append(torch.randint(0, 256, (buffers, 1, heads, head_bytes), generator=gen, dtype=torch.uint8))
    return torch.cat(out, dim=1)


class _Group:
    """A built TP group as SGLang's ``GroupCoordinator`` exposes it to the queues."""

    def __init__(self, cpu_group: Any, world_size: int, rank: int) -> None:
        self.cpu_group = cpu_group
        self.world_size = world_size
        self.rank_in_group = rank


def _radix(plan: Plan) -> bool:
    """Whether this side runs SGLang's radix cache: a decode whose rooms share prefixes."""
    return plan.role == "decode" and bool(plan.prefix_of)


def _server_args(plan: Plan) -> Any:
    from sglang.srt.server_args import prepare_server_args

    radix = ["--disaggregation-decode-enable-radix-cache"] if _radix(plan) else []
    return prepare_server_args(
        ["--model-path", plan.model, "--skip-tokenizer-init", "--device", "cpu", "--tp-size", str(plan.tp_size),
         "--page-size", str(plan.page_size), "--disaggregation-mode", plan.role,
         "--disaggregation-transfer-backend", "transfer_engine",
         "--disaggregation-bootstrap-port", str(plan.bootstrap_port), *radix]
    )  # fmt: skip


def _publish(plan: Plan, server_args: Any) -> Any:
    import torch.distributed as dist
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, spawn_world_rank

    publish(
        server_args,
        role="scheduler",
        ranks=SpawnRanks(world_rank=spawn_world_rank(server_args, tp_rank=plan.rank, pp_rank=0), gpu_id=0),
    )
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{plan.group_port}", rank=plan.rank, world_size=plan.tp_size
    )
    group = dist.new_group(list(range(plan.tp_size)), backend="gloo")
    single = dist.new_group([plan.rank], backend="gloo") if plan.tp_size == 1 else None
    tp = _Group(group, plan.tp_size, plan.rank)
    get_parallel().override_permanently(tp_group=tp, attn_tp_group=tp)
    return group, single


def _pool_tokens(plan: Plan) -> int:
    return DECODE_POOL_TOKENS if plan.role == "decode" else POOL_TOKENS


def _pools(plan: Plan) -> tuple[Any, Any, Any, Any]:
    tokens = _pool_tokens(plan)
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixCache

    if plan.role == "decode":
        from sglang.srt.disaggregation.decode import DecodeReqToTokenPool

        req_to_token: Any = DecodeReqToTokenPool(16, tokens, "cpu", False, pre_alloc_size=16)
    else:
        req_to_token = ReqToTokenPool(
            size=16, max_context_len=tokens, device="cpu", enable_memory_saver=False
        )
    if plan.mla:
        kv: Any = MLATokenToKVPool(
            tokens, plan.page_size, torch.bfloat16, kv_lora_rank=16, qk_rope_head_dim=8, layer_num=LAYERS,
            device="cpu", enable_memory_saver=False,
        )  # fmt: skip
    else:
        kv = MHATokenToKVPool(
            tokens, plan.page_size, torch.bfloat16, head_num=HEADS // plan.tp_size, head_dim=HEAD_DIM,
            layer_num=LAYERS, device="cpu", enable_memory_saver=False, enable_alt_stream=False,
        )  # fmt: skip
    allocator = PagedTokenToKVPoolAllocator(
        tokens, plan.page_size, torch.bfloat16, "cpu", kv, need_sort=False
    )
    cache = RadixCache(CacheInitParams(disable=not _radix(plan), req_to_token_pool=req_to_token,
                                       token_to_kv_pool_allocator=allocator, page_size=plan.page_size))  # fmt: skip
    return req_to_token, kv, allocator, cache


def run(plan: Plan, results: Any) -> None:
    """A rank process's entry point: puts ("ok", rank, report) or ("error", rank, traceback)."""
    try:
        report = _run(plan)
        results.put(("ok", plan.rank, report))
    except BaseException:
        results.put(("error", plan.rank, traceback.format_exc()))


def first_token(room: int) -> int:
    """The token the prefill's forward samples for ``room``; the decode reads it from the aux buffers."""
    return 1 + room % 200


def prefill_cached(room: int) -> int:
    """The prefix-cache hit the prefill reports for ``room`` (SGLang's second metadata buffer; its
    last, the bootstrap room, SGLang's decode checks itself)."""
    return 3 + room % 5


class Scheduler(SchedulerDisaggregationPrefillMixin, SchedulerDisaggregationDecodeMixin):
    """What SGLang's queues read from its ``Scheduler``: the pools, the groups, the queues, flags."""

    def _release_aborted_request(self, req: Any) -> None:
        """The scheduler's own step for an aborted request: the tree cache closes its handle.

        (``sglang.srt.managers.scheduler`` itself does not import on CPU: its Triton kernels.)
        """
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestOutcome

        self.tree_cache.finish(req.cache_request_handle, CacheRequestOutcome.ABORT)

    def __init__(self, plan: Plan, server_args: Any, group: Any, single: Any) -> None:
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.disaggregation.utils import MetadataBuffers, ReqToMetadataIdxAllocator

        self.plan = plan
        self.server_args = server_args
        self.model_config = ModelConfig.from_server_args(server_args)
        self.req_to_token_pool, self.kv, self.token_to_kv_pool_allocator, self.tree_cache = _pools(plan)
        self.attn_tp_cpu_group = group
        self.attn_cp_cpu_group = single if single is not None else group
        self.tp_worker = SimpleNamespace(
            model_runner=SimpleNamespace(
                kv_cache_dtype_str="auto",
                effective_logical_max_total_num_tokens=_pool_tokens(plan),
            ),
            is_hybrid_swa=False,
        )
        self.kv_shard_widening = 1
        self.rust_server = None
        self.metadata_buffers = MetadataBuffers(
            8, hidden_size=16, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=0
        )
        self.disagg_metadata_buffers = self.metadata_buffers
        self.req_to_metadata_buffer_idx_allocator = ReqToMetadataIdxAllocator(8)
        self.streamed: list[Any] = []
        self.output_streamer = SimpleNamespace(stream_output=lambda reqs, *a, **k: self.streamed.extend(reqs))
        self.metrics_reporter = SimpleNamespace(enable_metrics=False)
        self.spec_algorithm = SimpleNamespace(is_eagle=lambda: False, is_none=lambda: True)
        self.enable_overlap = False
        self.enable_staging = False
        self.kv_checksum_computer = None
        self.processed_tokens_counter = 0
        self.waiting_queue: list[Any] = []
        self.disagg_prefill_inflight_queue: list[Any] = []
        self.disagg_prefill_pending_chunk_rids: set[str] = set()
        self.random_seed = 0
        self.scheduler_stage_metrics = None
        self.enable_hisparse = False
        self.enable_decode_hicache = False
        self.enable_priority_scheduling = False
        self.schedule_low_priority_values_first = False
        self.enable_lora = False
        self.last_batch = None
        self.sliding_window_size = None
        self.running_batch = SimpleNamespace(reqs=[])
        self.running_mbs: list[Any] = []
        self.pool_stats_observer = None
        # counts reasoning tokens of the sampled token, for reasoning parsers only (none here)
        self.batch_result_processor = SimpleNamespace(_maybe_update_reasoning_tokens=lambda req, token: None)
        self.disaggregation_mode = plan.role


def _new_req(plan: Plan, room: int) -> Any:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    ids = array("q", prompt(plan, room))  # as SGLang's tokenizer manager hands them
    return Req(
        f"req-{room}", "", ids, SamplingParams(max_new_tokens=4), bootstrap_host="127.0.0.1",
        bootstrap_port=plan.bootstrap_port, bootstrap_room=room,
    )  # fmt: skip


def _kv_tensors(kv: Any, mla: bool) -> list[torch.Tensor]:
    """The pool's buffers as [token, head, byte] uint8 views, in SGLang's transfer order (K then V)."""
    if mla:
        return [t.view(torch.uint8).view(t.shape[0], 1, -1) for t in kv.kv_buffer]
    return [t.view(torch.uint8).view(t.shape[0], t.shape[1], -1) for t in (*kv.k_buffer, *kv.v_buffer)]


def _expected(plan: Plan, req: Any, tensors: list[torch.Tensor]) -> torch.Tensor:
    heads_total = 1 if plan.mla else HEADS
    full = token_bytes(list(req.origin_input_ids), len(tensors), heads_total, tensors[0].shape[2])
    if plan.mla:
        return full
    per = HEADS // plan.tp_size
    return full[:, :, plan.rank * per : (plan.rank + 1) * per]


def _forward(sched: Scheduler, req: Any) -> None:
    """The prefill forward's effect on memory: a row and pages allocated, the request's KV written."""
    n = len(req.origin_input_ids)
    sched.req_to_token_pool.alloc([req])
    page = sched.plan.page_size
    locs = sched.token_to_kv_pool_allocator.alloc(-(-n // page) * page)
    assert locs is not None, "prefill pool exhausted"
    sched.req_to_token_pool.write((req.kv.req_pool_idx, slice(0, n)), locs[:n].to(torch.int32))
    req.kv.kv_allocated_len = n
    req.kv.kv_committed_len = n
    req.extend_end = n
    req.prefix_len = 0
    tensors = _kv_tensors(sched.kv, sched.plan.mla)
    expected = _expected(sched.plan, req, tensors)
    for t, e in zip(tensors, expected, strict=True):
        t[locs[:n]] = e
    req.output_ids.append(first_token(req.bootstrap_room))
    req.cached_tokens = prefill_cached(req.bootstrap_room)


def _pages_of(sched: Scheduler, req: Any) -> list[int]:
    n = len(req.origin_input_ids)
    locs = sched.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n]
    return sorted({int(x) // sched.plan.page_size for x in locs})


def _settled_leaks(sched: Scheduler, within_s: float = 10.0) -> dict[str, int]:
    """What the engine still holds once its rooms ended (a room aborted mid-chunk by this side ends
    only after the peer's answer; SGLang never polls it again), or after ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        leaks = {k: v for k, v in sched.kv_manager.engine.leaks().items() if v}
        if not leaks or time.monotonic() > deadline:
            return leaks
        time.sleep(0.01)


class _Waves:
    """The requests of a side, wave by wave; what became of each and which pages each had."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.remaining = [list(w) for w in plan.waves]
        self.current: list[int] = []
        self.done: dict[int, str] = {}
        self.pages: dict[int, list[int]] = {}
        self.bytes_checked = 0
        self.prefix: dict[int, int] = {}
        """Prefill: the ``decode_prefix_len`` each room's decode sent (tokens the prefill skips)."""
        self.sent: dict[int, list[int]] = {}
        """Prefill, chunked: where each send of a room ended (``req.start_send_idx`` after it)."""
        self.deferred = 0
        """The most requests SGLang's decode held at once for deferred release."""

    def next_wave(self, add: Any) -> bool:
        """Add the next wave once the current one is done; False once every request is done."""
        if all(room in self.done for room in self.current):
            if not self.remaining:
                return False
            wave = self.remaining.pop(0)
            self.current = [room for room, _ in wave]
            for room, _ in wave:
                add(_new_req(self.plan, room))
        return True

    def report(self, sched: Scheduler) -> dict[str, Any]:
        return {
            "done": self.done,
            "pages": self.pages,
            "bytes_checked": self.bytes_checked,
            "sent": self.sent,
            "prefix": self.prefix,
            "deferred": self.deferred,
            # pages free, or kept by the radix cache with no request holding them (evictable)
            "free_tokens": sched.token_to_kv_pool_allocator.available_size()
            + sched.tree_cache.evictable_size(),
            "pool_tokens": _pool_tokens(self.plan),
            "free_rows": sched.req_to_token_pool.available_size(),
            "free_metadata": sched.req_to_metadata_buffer_idx_allocator.available_size(),
            "leaks": _settled_leaks(sched),
        }

    def __str__(self) -> str:
        return f"done {self.done}, waiting for {[r for r in self.current if r not in self.done]}"


def _run_prefill(plan: Plan, server_args: Any, group: Any, single: Any) -> dict[str, Any]:
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
    from sglang.srt.disaggregation.utils import TransferBackend

    sched = Scheduler(plan, server_args, group, single)
    queue = PrefillBootstrapQueue(
        sched.kv, None, sched.req_to_metadata_buffer_idx_allocator, sched.metadata_buffers, 0,
        plan.bootstrap_port, POOL_TOKENS, sched, None, TransferBackend("transfer_engine"),
    )  # fmt: skip
    sched.disagg_prefill_bootstrap_queue = queue
    sched.kv_manager = queue.kv_manager
    waves = _Waves(plan)
    chunking: list[Any] = []
    deadline = time.monotonic() + plan.timeout_s
    while waves.next_wave(lambda req: queue.add(req, HEADS)) or chunking:
        if time.monotonic() > deadline:
            raise TimeoutError(f"prefill rank {plan.rank}: {waves}")
        for req in queue.pop_bootstrapped():
            if req.bootstrap_room == plan.die_in_room:
                os.kill(os.getpid(), signal.SIGKILL)
            _forward(sched, req)
            waves.pages[req.bootstrap_room] = _pages_of(sched, req)
            waves.prefix[req.bootstrap_room] = req.disagg_decode_prefix_len
            if plan.chunk_tokens:
                req.extend_end = 0  # its chunks go out one per step, below
                chunking.append(req)
                continue
            sched.checkpoint_disagg_prefill(req)
            sched.disagg_prefill_inflight_queue.append(req)
            sched.send_kv_chunk(req, last_chunk=True)
            if req.bootstrap_room in plan.abort_rooms:
                req.disagg_kv_sender.abort()
        chunking = [req for req in chunking if _prefill_chunk(sched, req, waves)]
        for req in sched.process_disagg_prefill_inflight_queue():
            waves.done[req.bootstrap_room] = type(req.finished_reason).__name__
        for req in sched.streamed:
            waves.done.setdefault(req.bootstrap_room, type(req.finished_reason).__name__)
        sched.streamed.clear()
        time.sleep(0.001)
    sched.token_to_kv_pool_allocator.merge_and_sort_free()
    report = waves.report(sched)
    queue.kv_manager.close()
    return report


def _prefill_chunk(sched: Scheduler, req: Any, waves: _Waves) -> bool:
    """One chunk of a chunked prefill (the KV is written already); whether ``req`` has chunks left.

    A middle chunk is sent as SGLang's non-overlap ``process_prefill_chunk`` sends it (checkpoint,
    then ``send_kv_chunk(req)``: whole pages up to ``extend_end``), the last as after its forward (on
    the inflight queue, ``send_kv_chunk(req, last_chunk=True)``). A room the plan aborts is aborted
    after its first chunk the way ``Scheduler.process_pending_chunked_abort`` aborts a request being
    chunked (that module does not import on CPU): its pages are freed at once, before the room ended.
    """
    from sglang.srt.disaggregation.prefill import maybe_release_metadata_buffer
    from sglang.srt.disaggregation.utils import prepare_abort
    from sglang.srt.mem_cache.common import release_kv_cache

    n = len(req.origin_input_ids)
    req.extend_end = min(req.extend_end + sched.plan.chunk_tokens, n)
    sched.checkpoint_disagg_prefill(req)
    sent = waves.sent.setdefault(req.bootstrap_room, [])
    if req.extend_end == n:
        sched.disagg_prefill_inflight_queue.append(req)
        sched.send_kv_chunk(req, last_chunk=True)
        sent.append(req.start_send_idx)
        return False
    sched.send_kv_chunk(req)
    sent.append(req.start_send_idx)
    if req.bootstrap_room not in sched.plan.abort_rooms:
        return True
    prepare_abort(req, "Aborted")
    sched.clear_pending_chunk_send(req)
    req.disagg_kv_sender.abort()
    maybe_release_metadata_buffer(req, sched.req_to_metadata_buffer_idx_allocator)
    req.pending_bootstrap = False
    sched._release_aborted_request(req)
    release_kv_cache(req, sched.tree_cache, checkpoint=False)
    waves.done[req.bootstrap_room] = type(req.finished_reason).__name__
    return False


def _check_received(sched: Scheduler, req: Any) -> int:
    """Every byte of ``req``'s KV in this decode rank's pages against the prefill's pattern; the bytes."""
    n = len(req.origin_input_ids)
    locs = sched.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n].long()
    tensors = _kv_tensors(sched.kv, sched.plan.mla)
    expected = _expected(sched.plan, req, tensors)
    for i, (t, e) in enumerate(zip(tensors, expected, strict=True)):
        bad = int((t[locs] != e).sum())
        if bad:
            raise AssertionError(f"room {req.bootstrap_room}: {bad} bytes differ in buffer {i}")
    if list(req.output_ids[:1]) != [first_token(req.bootstrap_room)]:
        raise AssertionError(
            f"room {req.bootstrap_room}: first token {req.output_ids[:1]} from the aux buffers"
        )
    if req.cached_tokens != prefill_cached(req.bootstrap_room):
        raise AssertionError(
            f"room {req.bootstrap_room}: cached_tokens {req.cached_tokens} from the aux buffers"
        )
    return sum(e.numel() for e in expected)


def _run_decode(plan: Plan, server_args: Any, group: Any, single: Any) -> dict[str, Any]:
    from sglang.srt.disaggregation.decode import DecodePreallocQueue, DecodeTransferQueue
    from sglang.srt.disaggregation.utils import TransferBackend
    from sglang.srt.mem_cache.common import release_kv_cache
    from sglang.srt.runtime_context import get_disagg

    sched = Scheduler(plan, server_args, group, single)
    transfer = DecodeTransferQueue(
        sched.req_to_metadata_buffer_idx_allocator, sched.metadata_buffers, sched, sched.tree_cache
    )
    sched.disagg_decode_transfer_queue = transfer
    sched.disagg_decode_prealloc_queue = None
    prealloc = DecodePreallocQueue(
        sched.req_to_token_pool, sched.token_to_kv_pool_allocator, None,
        sched.req_to_metadata_buffer_idx_allocator, sched.metadata_buffers, sched, transfer, sched.tree_cache,
        0, plan.bootstrap_port, DECODE_POOL_TOKENS, get_disagg().num_reserved_decode_tokens,
        TransferBackend("transfer_engine"),
    )  # fmt: skip
    sched.disagg_decode_prealloc_queue = prealloc
    sched.kv_manager = prealloc.kv_manager
    waves = _Waves(plan)
    deadline = time.monotonic() + plan.timeout_s
    while waves.next_wave(prealloc.add) or transfer.has_pending_deferred_releases():
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"decode rank {plan.rank}: {waves}; prealloc "
                f"{[(d.req.rid, d.waiting_for_input, d.kv_receiver.poll()) for d in prealloc.queue]} pending "
                f"{len(prealloc.pending_reqs)} transfer {[d.req.rid for d in transfer.queue]}"
            )
        for decode_req in transfer.queue:
            room = decode_req.req.bootstrap_room
            if room not in waves.pages and decode_req.req.kv.holds_kv:
                waves.pages[room] = _pages_of(sched, decode_req.req)
                if room in plan.abort_rooms:
                    decode_req.kv_receiver.abort()
        sched.process_decode_queue()
        waves.deferred = max(waves.deferred, transfer.num_pending_deferred_releases())
        for req in sched.waiting_queue:
            waves.bytes_checked += _check_received(sched, req)
            waves.done[req.bootstrap_room] = "received"
            release_kv_cache(req, sched.tree_cache, checkpoint=_radix(plan))  # the tree keeps its KV
        sched.waiting_queue.clear()
        for req in sched.streamed:
            waves.done.setdefault(req.bootstrap_room, type(req.finished_reason).__name__)
        sched.streamed.clear()
        sched.token_to_kv_pool_allocator.merge_and_sort_free()  # freed pages first in line: reused at once
        time.sleep(0.001)
    report = waves.report(sched)
    prealloc.kv_manager.close()
    return report


def _run(plan: Plan) -> dict[str, Any]:
    server_args = _server_args(plan)
    group, single = _publish(plan, server_args)
    if plan.role == "prefill":
        return _run_prefill(plan, server_args, group, single)
    return _run_decode(plan, server_args, group, single)
