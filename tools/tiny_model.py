"""A tiny random-weight Llama for vLLM, made offline: no hub, no download, no tokenizer.

    python tools/tiny_model.py /tmp/te-tiny-llama           # then MODEL=/tmp/te-tiny-llama
    python tools/tiny_model.py DIR --layers 4 --seed 1

It writes a Hugging Face model directory (``config.json`` and the weights) that vLLM loads with
``--model DIR``: 2 layers, hidden size 256, 8 attention heads over 4 KV heads of 32, a vocabulary of
1024, fp32 weights drawn from a fixed seed (the same directory every time). It has no tokenizer, so
vLLM runs it with ``--skip-tokenizer-init`` and prompts are token ids (``"prompt": [1, 2, 3]``):
enough to move real KV between real vLLM servers on a CPU box (docs/vllm.md). Its answers are
meaningless tokens. Needs torch and transformers (both come with vLLM).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

CONFIG = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    vocab_size=1024,
    max_position_embeddings=4096,
)
"""The Llama the vLLM tests run (tests/vllm/test_disaggregated.py imports it, as tools/bench_vllm.py does)."""


def make_model(path: Path, *, layers: int = CONFIG["num_hidden_layers"], seed: int = 0) -> Path:
    """Write the model to ``path`` (created if missing); returns ``path``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**{**CONFIG, "num_hidden_layers": layers})
    path.mkdir(parents=True, exist_ok=True)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("path", type=Path, help="the model directory to write")
    parser.add_argument(
        "--layers", type=int, default=CONFIG["num_hidden_layers"], help="decoder layers (default 2)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    args = parser.parse_args(argv)
    if args.layers < 1:
        parser.error("--layers must be >= 1")
    make_model(args.path, layers=args.layers, seed=args.seed)
    print(f"tiny Llama ({args.layers} layers, vocabulary {CONFIG['vocab_size']}) written to {args.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
