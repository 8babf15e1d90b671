"""A small Llama-style decoder whose KV cache lives in the engine's paged pool, tensor parallel.

RMSNorm, rotary position embeddings, grouped-query attention (``kv_heads`` may be fewer than
``heads``), a SwiGLU MLP; weights drawn from ``seed`` (no download), identical for every TP size.
Tensor parallelism splits the attention heads (query and KV heads alike, in consecutive groups, so
rank ``r`` holds the same KV heads as its :class:`~transfer_engine.KVPool` slice) and the MLP's
columns; the attention block and the MLP block each end in one all-reduce of their partial
output. Embedding, final norm and LM head are replicated, so every rank ends with the same logits.

The KV cache is the pool: per layer ``K_l`` and ``V_l`` of shape ``[slots, H_local, D]``, slot
``page * page_size + offset``. A sequence's page table lists its pages in token order; the forward
writes the new tokens' K (after RoPE) and V into their slots, then every query gathers the
sequence's whole context from the pool through the page table and runs SDPA with a causal mask.

:meth:`TPModel.layers` runs one layer per step and yields after that layer's K/V are written and
final, so a caller can send layer groups while the next layer computes; :meth:`TPModel.forward`
runs it to the end with an optional ``on_layer`` callback.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from transfer_engine import ConfigError, KVLayout, KVPool


@dataclass(frozen=True)
class ModelConfig:
    """The model's shape; every rank of both servers and the reference must use the same one."""

    vocab: int = 512
    hidden: int = 128
    layers: int = 4
    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 16
    ffn: int = 256
    rope_theta: float = 10000.0
    eps: float = 1e-5
    seed: int = 0

    def check(self, tp_size: int) -> None:
        """ConfigError naming the value when this shape cannot be split ``tp_size`` ways."""
        for name in ("vocab", "hidden", "layers", "heads", "kv_heads", "head_dim", "ffn"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"model {name}={value!r} must be a positive integer")
        if self.heads % self.kv_heads:
            raise ConfigError(f"model heads={self.heads} is not a multiple of kv_heads={self.kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"model head_dim={self.head_dim} must be even (rotary embedding)")
        if tp_size < 1 or self.kv_heads % tp_size or self.ffn % tp_size:
            raise ConfigError(f"tp_size={tp_size} must divide kv_heads={self.kv_heads} and ffn={self.ffn}")

    def kv_layout(self, dtype: torch.dtype, page_size: int) -> KVLayout:
        return KVLayout(self.layers, self.kv_heads, self.head_dim, dtype, page_size)


@dataclass(frozen=True)
class Seq:
    """One sequence's part of a forward: ``tokens`` at positions ``start ..``, its pages in order.

    ``page_table`` must cover every position up to ``start + len(tokens)``; the positions before
    ``start`` must already hold this sequence's K/V (earlier chunks, or pages that arrived).
    """

    tokens: Sequence[int]
    start: int
    page_table: Sequence[int]


AllReduce = Callable[[torch.Tensor], None]


def _no_reduce(t: torch.Tensor) -> None:
    return None


class TPModel:
    """Rank ``tp_rank``'s shard of the model; ``all_reduce`` sums a tensor over the TP group in place."""

    def __init__(
        self,
        cfg: ModelConfig,
        tp_size: int = 1,
        tp_rank: int = 0,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        all_reduce: AllReduce | None = None,
    ) -> None:
        cfg.check(tp_size)
        if not 0 <= tp_rank < tp_size:
            raise ConfigError(f"tp_rank={tp_rank} is not a rank of tp_size={tp_size}")
        self.cfg = cfg
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.device = torch.device(device)
        self.dtype = dtype
        self.all_reduce = all_reduce if all_reduce is not None and tp_size > 1 else _no_reduce
        self.hq = cfg.heads // tp_size
        self.hk = cfg.kv_heads // tp_size
        self._load(cfg)

    def _load(self, cfg: ModelConfig) -> None:
        """Draw the full weights from the seed on the CPU, keep this rank's shard on the device."""
        g = torch.Generator().manual_seed(cfg.seed)
        r, tp = self.tp_rank, self.tp_size
        D, H = cfg.head_dim, cfg.hidden

        def draw(rows: int, cols: int, scale: float) -> torch.Tensor:
            return torch.randn(rows, cols, generator=g) * scale

        def cols(w: torch.Tensor, parts: int) -> torch.Tensor:
            n = w.shape[1] // parts
            return w[:, r * n : (r + 1) * n]

        def rows(w: torch.Tensor, parts: int) -> torch.Tensor:
            n = w.shape[0] // parts
            return w[r * n : (r + 1) * n]

        def put(w: torch.Tensor) -> torch.Tensor:
            return w.contiguous().to(self.device, self.dtype)

        self.embed = put(draw(cfg.vocab, H, 1.0))
        self.layer_w = []
        for _ in range(cfg.layers):
            wq = draw(H, cfg.heads * D, H**-0.5)
            wk = draw(H, cfg.kv_heads * D, H**-0.5)
            wv = draw(H, cfg.kv_heads * D, H**-0.5)
            wo = draw(cfg.heads * D, H, (cfg.heads * D) ** -0.5)
            wg = draw(H, cfg.ffn, H**-0.5)
            wu = draw(H, cfg.ffn, H**-0.5)
            wd = draw(cfg.ffn, H, cfg.ffn**-0.5)
            norm1 = 1.0 + 0.1 * torch.randn(H, generator=g)
            norm2 = 1.0 + 0.1 * torch.randn(H, generator=g)
            self.layer_w.append(
                {
                    "wq": put(cols(wq, tp)),
                    "wk": put(cols(wk, tp)),
                    "wv": put(cols(wv, tp)),
                    "wo": put(rows(wo, tp)),
                    "wg": put(cols(wg, tp)),
                    "wu": put(cols(wu, tp)),
                    "wd": put(rows(wd, tp)),
                    "norm1": put(norm1),
                    "norm2": put(norm2),
                }
            )
        self.final_norm = put(1.0 + 0.1 * torch.randn(H, generator=g))
        self.lm_head = put(draw(H, cfg.vocab, 2.0 * H**-0.5))
        half = D // 2
        self.inv_freq = (1.0 / (cfg.rope_theta ** (torch.arange(half, dtype=torch.float64) * 2 / D))).to(
            self.device, torch.float32
        )

    # --- pieces -----------------------------------------------------------------------------------

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + self.cfg.eps) * w

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, D]; cos/sin: [T, 1, D/2]; rotate halves (the Llama/NeoX convention)."""
        half = x.shape[-1] // 2
        a, b = x[..., :half], x[..., half:]
        return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)

    def check_pool(self, pool: KVPool) -> None:
        lay = pool.layout
        if (lay.num_layers, lay.num_heads, lay.head_dim) != (
            self.cfg.layers,
            self.cfg.kv_heads,
            self.cfg.head_dim,
        ):
            raise ConfigError(
                f"pool layout L={lay.num_layers} H={lay.num_heads} D={lay.head_dim} does not match the model's "
                f"L={self.cfg.layers} H={self.cfg.kv_heads} D={self.cfg.head_dim}"
            )
        if (pool.tp_size, pool.tp_rank) != (self.tp_size, self.tp_rank) or lay.dtype != self.dtype:
            raise ConfigError(
                f"pool is tp {pool.tp_rank}/{pool.tp_size} {lay.dtype}, model is tp "
                f"{self.tp_rank}/{self.tp_size} {self.dtype}"
            )

    # --- forward ----------------------------------------------------------------------------------

    def layers(self, seqs: Sequence[Seq], pool: KVPool) -> Generator[int, None, torch.Tensor]:
        """Run the forward one layer per step; yields each layer index once its K/V are in the pool.

        Returns (as the generator's value) the logits of each sequence's last new token,
        ``[len(seqs), vocab]`` float32 on the model's device. On CUDA everything is enqueued on the
        current stream and nothing here synchronizes. Every rank of the TP group must run the same
        ``seqs`` (the all-reduces pair up).
        """
        if not seqs:
            raise ConfigError("a forward needs at least one sequence")
        cfg, dev = self.cfg, self.device
        ps = pool.layout.page_size
        L = cfg.layers
        tok_list: list[int] = []
        pos_list: list[int] = []
        ctx: list[tuple[int, int, torch.Tensor]] = []  # per seq: (start, n, context slots)
        for s in seqs:
            n = len(s.tokens)
            end = s.start + n
            if n == 0 or s.start < 0 or len(s.page_table) * ps < end:
                raise ConfigError(
                    f"sequence at start={s.start} with {n} tokens needs {-(-end // ps)} pages, "
                    f"page table has {len(s.page_table)}"
                )
            table = torch.as_tensor(list(s.page_table), dtype=torch.int64)
            positions = torch.arange(end, dtype=torch.int64)
            slots = table[positions // ps] * ps + positions % ps
            ctx.append((s.start, n, slots.to(dev)))
            tok_list.extend(int(t) for t in s.tokens)
            pos_list.extend(range(s.start, end))
        tokens = torch.as_tensor(tok_list, dtype=torch.int64).to(dev)
        new_slots = torch.cat([c[2][c[0] :] for c in ctx])
        positions = torch.as_tensor(pos_list, dtype=torch.float32).to(dev)
        angles = positions[:, None] * self.inv_freq[None, :]
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
        T, D = len(tok_list), cfg.head_dim
        masks = []
        for start, n, slots in ctx:
            if n == 1:
                masks.append(None)
            else:
                q_pos = torch.arange(start, start + n, device=dev)[:, None]
                masks.append(torch.arange(len(slots), device=dev)[None, :] <= q_pos)

        x = self.embed[tokens]
        for layer in range(L):
            w = self.layer_w[layer]
            k_cache, v_cache = pool.tensors[layer], pool.tensors[L + layer]
            h = self._rms(x, w["norm1"])
            q = self._rope((h @ w["wq"]).view(T, self.hq, D), cos, sin)
            k = self._rope((h @ w["wk"]).view(T, self.hk, D), cos, sin)
            v = (h @ w["wv"]).view(T, self.hk, D)
            k_cache.index_copy_(0, new_slots, k)
            v_cache.index_copy_(0, new_slots, v)
            outs = []
            offset = 0
            for (_, n, slots), mask in zip(ctx, masks, strict=True):
                qs = q[offset : offset + n].transpose(0, 1)[None]  # [1, hq, n, D]
                ks = k_cache[slots].transpose(0, 1)[None]  # [1, hk, ctx, D]
                vs = v_cache[slots].transpose(0, 1)[None]
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)
                outs.append(o[0].transpose(0, 1).reshape(n, self.hq * D))
                offset += n
            attn = torch.cat(outs) @ w["wo"]
            self.all_reduce(attn)
            x = x + attn
            h = self._rms(x, w["norm2"])
            mlp = (F.silu(h @ w["wg"]) * (h @ w["wu"])) @ w["wd"]
            self.all_reduce(mlp)
            x = x + mlp
            yield layer
        last = torch.as_tensor([sum(c[1] for c in ctx[: i + 1]) - 1 for i in range(len(ctx))], device=dev)
        return (self._rms(x[last], self.final_norm) @ self.lm_head).float()

    def forward(
        self, seqs: Sequence[Seq], pool: KVPool, on_layer: Callable[[int], None] | None = None
    ) -> torch.Tensor:
        """:meth:`layers` run to the end; ``on_layer(l)`` is called once layer ``l``'s K/V are in the pool."""
        steps = self.layers(seqs, pool)
        while True:
            try:
                layer = next(steps)
            except StopIteration as done:
                logits: torch.Tensor = done.value
                return logits
            if on_layer is not None:
                on_layer(layer)
