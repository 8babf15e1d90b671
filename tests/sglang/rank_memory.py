"""One TP rank's memory as a serving system owns it, and the backend's ``KVManager`` over it.

For the tests that call the backend's classes directly (``test_adapter``, ``test_group_release``,
``test_killed_peer`` and its ``prefill_proc``): raw KV tensors handed as pointers, SGLang's own
``MetadataBuffers`` as the aux buffers, ``KVArgs`` filled as SGLang fills them, and ``ServerArgs``
parsed with SGLang's defaults. How SGLang's scheduler drives the backend is tested against its own
queues (``queues.py``, ``test_sglang_queues.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sglang.srt.disaggregation.base.conn import KVArgs
from sglang.srt.disaggregation.utils import MetadataBuffers
from sglang.srt.server_args import prepare_server_args

from transfer_engine.config import EngineConfig
from transfer_engine.integrations.sglang import KVManager
from transfer_engine.memory.layout import KVLayout

SMALL = KVLayout(num_layers=3, num_heads=4, head_dim=16, dtype=torch.bfloat16, page_size=4)
"""The model every test here uses: 3 layers, 4 KV heads of 16 bf16 elements, pages of 4 tokens."""


@dataclass
class Memory:
    """A rank's KV and aux buffers as a serving system owns them: raw tensors, handed as pointers.

    The aux buffers are SGLang's own ``MetadataBuffers`` (first output token, cached-token counts,
    logprobs, hidden states, bootstrap room...).
    """

    kv: list[torch.Tensor]
    metadata: MetadataBuffers

    @classmethod
    def allocate(cls, layout: KVLayout, tp_size: int, num_pages: int, aux_slots: int) -> Memory:
        heads = layout.heads_local(tp_size)
        kv = [
            torch.zeros(num_pages * layout.page_size, heads, layout.head_dim, dtype=layout.dtype)
            for _ in range(layout.num_kv_tensors)
        ]
        metadata = MetadataBuffers(
            aux_slots, hidden_size=16, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=0
        )
        return cls(kv, metadata)

    def kv_args(self, layout: KVLayout, tp_size: int, rank: int) -> KVArgs:
        args = KVArgs()
        args.engine_rank = rank
        args.kv_data_ptrs = [t.data_ptr() for t in self.kv]
        args.kv_data_lens = [t.numel() * t.element_size() for t in self.kv]
        page_bytes = layout.page_size * self.kv[0].shape[1] * layout.head_dim * self.kv[0].element_size()
        args.kv_item_lens = [page_bytes] * len(self.kv)
        args.kv_cache_dtype_str = "auto"  # what SGLang passes by default; the backend never reads it
        args.kv_head_num = layout.heads_local(tp_size)
        args.total_kv_head_num = layout.num_heads
        args.page_size = layout.page_size
        args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = self.metadata.get_buf_infos()
        args.gpu_id = 0
        return args


def manager(
    role: str,
    layout: KVLayout,
    tp_size: int,
    rank: int,
    memory: Memory,
    bootstrap_port: int,
    **config: object,
) -> KVManager:
    """The backend's ``KVManager`` for one rank over ``memory``, as SGLang makes it (engine ``config``
    fields may be set)."""
    server_args = prepare_server_args(
        ["--model-path", "unused", "--device", "cpu", "--tp-size", str(tp_size), "--disaggregation-mode", role,
         "--disaggregation-transfer-backend", "transfer_engine",
         "--disaggregation-bootstrap-port", str(bootstrap_port)]
    )  # SGLang's defaults for everything else  # fmt: skip
    cfg = EngineConfig(
        role=role, tp_size=tp_size, tp_rank=rank, bootstrap_port=bootstrap_port, host_bootstrap=False,
        num_workers=2, **config,
    )  # type: ignore[arg-type]  # fmt: skip
    return KVManager(memory.kv_args(layout, tp_size, rank), role, server_args, False, config=cfg)
