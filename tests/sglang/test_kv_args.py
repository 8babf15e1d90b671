"""The KVArgs SGLang builds, read as bytes; what is refused at start. Pure: no engine, no sockets.

Each case is a ``KVArgs`` as SGLang 0.5.23's ``_init_kv_manager`` fills it (the model runner's
``kv_cache_dtype_str``, never a torch dtype name; the pool's pointers, lengths and item lengths;
draft buffers appended with ``num_draft_entries``). Budget: well under a second.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from sglang.srt.disaggregation.base.conn import KVArgs, StateType

from transfer_engine import ConfigError, LayoutError
from transfer_engine.integrations.sglang.kv_args import pool_from_kv_args, refuse_unsupported
from transfer_engine.integrations.sglang.settings import registry_host

PAGE_SLOTS = 64  # pages in every fake buffer
BASE = 1 << 32  # fake addresses: nothing is mapped, pool_from_kv_args only reads numbers


@dataclass
class Pool:
    """A pool as SGLang describes it: ``layers`` K then V buffers (or one latent per layer)."""

    layers: int
    heads_local: int
    head_bytes: int
    page_size: int = 4
    mla: bool = False
    draft_layers: int = 0
    draft_head_bytes: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def kv_args(self, dtype_str: str) -> KVArgs:
        per = 1 if self.mla else 2
        entries = per * self.layers
        draft = per * self.draft_layers
        item = self.page_size * self.heads_local * self.head_bytes
        draft_item = self.page_size * self.heads_local * (self.draft_head_bytes or self.head_bytes)
        args = KVArgs()
        args.engine_rank = 0
        args.kv_cache_dtype_str = dtype_str
        args.kv_item_lens = [item] * entries + [draft_item] * draft
        args.kv_data_lens = [i * PAGE_SLOTS for i in args.kv_item_lens]
        args.kv_data_ptrs = [BASE + n * (1 << 24) for n in range(entries + draft)]
        args.num_draft_entries = draft
        args.kv_layer_ids = []
        args.page_size = self.page_size
        if not self.mla:  # SGLang sets head counts for MHA pools only
            args.kv_head_num = self.heads_local
            args.total_kv_head_num = self.heads_local * 2
        args.prefill_start_layer = 0
        args.prefill_end_layer = self.layers
        for name, value in self.extra.items():
            setattr(args, name, value)
        return args


# (SGLang's kv_cache_dtype_str, bytes per element as its pool stores them): "auto" is the model's
# bf16; fp8 formats are one byte; nvfp4 packs two 4-bit values per byte; mxfp8 one byte.
DTYPES = [("auto", 2.0), ("bf16", 2.0), ("fp8_e4m3", 1.0), ("fp8_e5m2", 1.0), ("mxfp8", 1.0), ("nvfp4", 0.5)]


@pytest.mark.parametrize(("dtype_str", "elem_bytes"), DTYPES)
@pytest.mark.parametrize("mla", [False, True])
def test_every_kv_cache_dtype_starts_and_is_described_in_bytes(
    dtype_str: str, elem_bytes: float, mla: bool
) -> None:
    head_dim = 576 if mla else 128
    pool = Pool(layers=3, heads_local=1 if mla else 2, head_bytes=int(head_dim * elem_bytes), mla=mla)
    desc = pool_from_kv_args(pool.kv_args(dtype_str), is_mla=mla)
    assert desc.layout.dtype == torch.uint8
    assert desc.layout.head_dim == int(head_dim * elem_bytes)
    assert desc.layout.num_layers == 3 and desc.layout.mla is mla
    assert desc.layout.num_heads == (1 if mla else 4)
    assert (desc.target_layers, desc.draft_layers) == (3, 0)


def test_draft_entries_are_layers_after_the_targets_k_before_v() -> None:
    pool = Pool(layers=3, heads_local=2, head_bytes=256, draft_layers=1)
    args = pool.kv_args("auto")
    desc = pool_from_kv_args(args, is_mla=False)
    p = args.kv_data_ptrs  # target K0 K1 K2 V0 V1 V2, then draft K0 V0
    assert desc.kv_data_ptrs == [p[0], p[1], p[2], p[6], p[3], p[4], p[5], p[7]]
    assert desc.layout.num_layers == 4 and (desc.target_layers, desc.draft_layers) == (3, 1)
    mla = Pool(layers=2, heads_local=1, head_bytes=576, mla=True, draft_layers=1)
    margs = mla.kv_args("auto")
    assert pool_from_kv_args(margs, is_mla=True).kv_data_ptrs == margs.kv_data_ptrs


def test_kv_layer_ids_and_nhd_layout_are_honoured() -> None:
    args = Pool(layers=3, heads_local=2, head_bytes=256, draft_layers=1).kv_args("auto")
    args.kv_layer_ids = [0, 1, 2, 0, 1, 2, 3, 3]  # SGLang's band for the draft: num_hidden_layers + i
    args.kv_layout = "NHD"
    assert pool_from_kv_args(args, is_mla=False).layout.num_layers == 4


def _set(**attrs: Any) -> Any:
    def apply(args: KVArgs) -> None:
        for name, value in attrs.items():
            setattr(args, name, value)

    return apply


BAD = [
    ("kv_layer_ids differ K/V", _set(kv_layer_ids=[0, 1, 2, 0, 2, 1]), ConfigError, "V entries' ids"),
    ("kv_layer_ids count", _set(kv_layer_ids=[0, 1]), ConfigError, "2 ids for 6"),
    ("kv_layer_ids order", _set(kv_layer_ids=[2, 1, 0, 2, 1, 0]), ConfigError, "must increase"),
    ("kv_layout of its own", _set(kv_layout="hnd"), ConfigError, "kv_layout='hnd'"),
    ("DeepSeek V4", _set(mla_compression_ratios=[0, 4, 128]), ConfigError, "mla_compression_ratios"),
    ("pipeline stage", _set(prefill_start_layer=2), ConfigError, "prefill_start_layer=2"),
    ("end layer", _set(prefill_end_layer=5), ConfigError, "prefill_end_layer=5"),
    ("draft count", _set(num_draft_entries=6), ConfigError, "num_draft_entries=6"),
    ("odd draft", _set(num_draft_entries=1), LayoutError, "5 target kv_data_ptrs"),
    ("item not heads", _set(kv_item_lens=[1030] * 6), LayoutError, "kv_item_lens\\[0\\]=1030"),
    ("lengths", _set(kv_data_lens=[1024 * 64] * 5 + [1024]), LayoutError, "kv_data_lens\\[5\\]=1024"),
    ("counts", _set(kv_item_lens=[1024] * 5), LayoutError, "5 kv_item_lens"),
    ("negative", _set(kv_data_ptrs=[-1] * 6), LayoutError, "kv_data_ptrs\\[0\\]=-1"),
]


@pytest.mark.parametrize(("case", "change", "error", "match"), BAD, ids=[b[0] for b in BAD])
def test_kv_args_that_do_not_fit_are_refused_naming_the_value(
    case: str, change: Any, error: type[Exception], match: str
) -> None:
    args = Pool(layers=3, heads_local=2, head_bytes=128).kv_args("auto")
    change(args)
    with pytest.raises(error, match=match):
        pool_from_kv_args(args, is_mla=False)


@pytest.mark.parametrize(
    "end", [2, 3, None], ids=["pool end_layer (last, inclusive)", "layer shard (exclusive)", "unset"]
)
def test_prefill_end_layer_is_read_as_sglang_fills_it(end: int | None) -> None:
    args = Pool(layers=3, heads_local=2, head_bytes=128).kv_args("auto")
    args.prefill_end_layer = end
    assert pool_from_kv_args(args, is_mla=False).target_layers == 3


def test_draft_with_another_page_width_is_refused() -> None:
    args = Pool(layers=2, heads_local=2, head_bytes=128, draft_layers=1, draft_head_bytes=64).kv_args("auto")
    with pytest.raises(LayoutError, match="kv_item_lens\\[4\\]=512 \\(draft\\)"):
        pool_from_kv_args(args, is_mla=False)


def _server(**overrides: Any) -> Any:
    fields = {"tp_size": 2, "pp_size": 1, "dp_size": 1, "enable_dp_attention": False, "attn_dp_size": 1,
              "attn_cp_size": 1, "host": "127.0.0.1", "dist_init_addr": None}  # fmt: skip
    return SimpleNamespace(**{**fields, **overrides})


REFUSED = [
    ("mamba state", _set(state_types=[StateType.MAMBA], state_data_ptrs=[[BASE]]), {}, "state_types=\\['mamba'\\]"),
    ("swa state", _set(state_types=[StateType.SWA], state_data_ptrs=[[BASE]]), {}, "state_types=\\['swa'\\]"),
    ("dsa state", _set(state_types=[StateType.DSA], state_data_ptrs=[[BASE]]), {}, "state_types=\\['dsa'\\]"),
    ("hybrid mla", _set(is_hybrid_mla_backend=True), {}, "is_hybrid_mla_backend"),
    ("pp", _set(), {"pp_size": 2}, "--pp-size=2"),
    ("dp attention", _set(), {"enable_dp_attention": True, "dp_size": 2, "attn_dp_size": 2}, "--enable-dp-attention"),
    ("attention cp", _set(), {"attn_cp_size": 2}, "--attn-cp-size=2"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "change", "server", "match"), REFUSED, ids=[r[0] for r in REFUSED])
def test_unsupported_launches_are_refused_naming_the_flag(
    case: str, change: Any, server: dict[str, Any], match: str
) -> None:
    args = Pool(layers=3, heads_local=2, head_bytes=128).kv_args("auto")
    args.state_types, args.state_data_ptrs = [], []
    change(args)
    with pytest.raises(ConfigError, match=match):
        refuse_unsupported(args, _server(**server))


def test_supported_launch_is_not_refused() -> None:
    args = Pool(layers=3, heads_local=2, head_bytes=128).kv_args("auto")
    args.state_types, args.state_data_ptrs = [], []
    refuse_unsupported(args, _server())


@pytest.mark.parametrize(
    ("host", "dist", "want"),
    [("0.0.0.0", None, "127.0.0.1"), ("::", None, "::1"), ("10.1.2.3", None, "10.1.2.3"),
     ("0.0.0.0", "127.0.0.5:5000", "127.0.0.5"), ("0.0.0.0", "[::1]:5000", "::1")],
)  # fmt: skip
def test_registry_host_is_resolved_as_sglang_resolves_it(host: str, dist: str | None, want: str) -> None:
    assert registry_host(_server(host=host, dist_init_addr=dist)) == want
