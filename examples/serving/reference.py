"""The monolithic reference: the same model, same TP, same paged pool, prefill and decode in one place.

``reference(...)`` starts ``tp`` rank processes (gloo/NCCL, like a server) that serve the prompts
one at a time with no engine: pages from an allocator, chunked prefill with the servers'
``chunk_tokens``, the first token from the last chunk's logits, then greedy decode steps. It returns,
per prompt, the generated tokens, the first decode step's logits and the per-head digests of the
prompt's KV, which the serving run is compared against.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from examples import common
from examples.serving.model import ModelConfig


@dataclass(frozen=True)
class RefSpec:
    model: ModelConfig
    tp: int
    page_size: int
    chunk_tokens: int
    device: str
    dist_port: int
    prompts: list[list[int]]
    max_new: list[int]
    torch_threads: int = 1


@dataclass
class RefResult:
    tokens: list[int]
    first_logits: list[float] | None
    kv: dict[str, str]


async def _serve(spec: RefSpec, rank: int, events: Any) -> int:
    import torch

    from examples.serving.model import Seq, TPModel
    from examples.serving.server import PageAllocator, kv_digests, pages_for
    from examples.serving.tp import TPGroup
    from transfer_engine import KVPool

    if spec.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", rank % torch.cuda.device_count())
    else:
        device = torch.device("cpu")
    group = TPGroup(spec.tp, rank, spec.dist_port, device)
    model = TPModel(spec.model, spec.tp, rank, device=device, all_reduce=group.all_reduce)
    ps = spec.page_size
    need = max(pages_for(len(p) + n - 1, ps) for p, n in zip(spec.prompts, spec.max_new, strict=True))
    pool = KVPool.allocate(spec.model.kv_layout(torch.float32, ps), spec.tp, rank, need + 1, device=device)
    alloc = PageAllocator(need + 1)
    alloc.alloc(1)  # page 0 stays unused, so pages are not simply 0..n-1
    for index, (prompt, max_new) in enumerate(zip(spec.prompts, spec.max_new, strict=True)):
        pages = alloc.alloc(pages_for(len(prompt) + max_new - 1, ps))
        assert pages is not None
        logits = None
        for start in range(0, len(prompt), spec.chunk_tokens):
            end = min(len(prompt), start + spec.chunk_tokens)
            logits = model.forward([Seq(prompt[start:end], start, pages[: pages_for(end, ps)])], pool)
        assert logits is not None
        tokens = [int(logits[0].argmax().item())]
        kv = kv_digests(pool, pages, len(prompt), rank)
        first_logits = None
        while len(tokens) < max_new:
            pos = len(prompt) + len(tokens) - 1
            logits = model.forward([Seq([tokens[-1]], pos, pages[: pages_for(pos + 1, ps)])], pool)
            if first_logits is None:
                first_logits = logits[0].cpu().tolist()
            tokens.append(int(logits[0].argmax().item()))
        alloc.release(pages)
        events.put(("ref", rank, (index, tokens, first_logits, kv)))
    group.close()
    return 0


def _rank(spec: RefSpec, rank: int, events: Any) -> None:
    import anyio

    args = SimpleNamespace(
        log_level="WARNING", torch_threads=spec.torch_threads, tp=spec.tp, nixl_progress_thread=True
    )
    common.rank_entry(lambda: anyio.run(_serve, spec, rank, events), f"reference rank {rank}", args, events)  # type: ignore[arg-type]


def reference(spec: RefSpec, timeout: float = 600.0) -> list[RefResult]:
    """Run the reference (blocking; call it from a thread or before the event loop)."""
    ctx = mp.get_context("spawn")
    events = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(spec, r, events), daemon=True) for r in range(spec.tp)]
    for p in procs:
        p.start()
    results: dict[int, RefResult] = {}
    got = 0
    deadline = time.monotonic() + timeout
    try:
        while got < spec.tp * len(spec.prompts):
            try:
                kind, rank, payload = events.get(timeout=0.2)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"reference failed: exit codes {[p.exitcode for p in procs]}"
                    ) from None
                continue
            if kind != "ref":
                continue
            index, tokens, first_logits, kv = payload
            r = results.setdefault(index, RefResult(tokens, first_logits, {}))
            r.kv.update(kv)
            got += 1
    finally:
        for p in procs:
            p.join(10)
            if p.exitcode is None:
                p.kill()
                p.join(5)
    return [results[i] for i in range(len(spec.prompts))]
