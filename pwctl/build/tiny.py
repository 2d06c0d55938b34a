"""Tiny checkpoints of every supported architecture, built locally with transformers'
save_pretrained (hub per-expert layout or the fused one). Tests and the demo use them; nothing
is downloaded. Logits are scaled away from uniform so quantization error is visible."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

VOCAB = 320
ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
TOKENIZER_TEXT = (
    "In the beginning God created the heavens and the earth. The earth was formless and empty. "
    "It is a truth universally acknowledged that a single man in possession of a good fortune "
    "must be in want of a wife. The quick brown fox jumps over the lazy dog. 0123456789 "
)


def tiny_config(arch: str, hidden: int = 128, layers: int = 2, experts: int = 4):
    from transformers import MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    if arch == "mixtral":
        return MixtralConfig(
            **common, intermediate_size=2 * hidden, num_local_experts=experts, num_experts_per_tok=2
        )
    if arch == "qwen2_moe":
        return Qwen2MoeConfig(
            **common,
            intermediate_size=2 * hidden,
            moe_intermediate_size=hidden,
            shared_expert_intermediate_size=2 * hidden,
            num_experts=experts,
            num_experts_per_tok=2,
            norm_topk_prob=False,
        )
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(  # type: ignore[call-arg]  # head_dim: its typed signature omits it
            **common,
            intermediate_size=2 * hidden,
            moe_intermediate_size=hidden,
            head_dim=hidden // 4,
            num_experts=experts,
            num_experts_per_tok=2,
            norm_topk_prob=True,
        )
    if arch == "olmoe":
        return OlmoeConfig(
            **common, intermediate_size=hidden, num_experts=experts, num_experts_per_tok=2
        )
    raise ValueError(f"no tiny config for {arch}")


def make_tokenizer(path: Path) -> None:
    """A byte-level BPE small enough to train in milliseconds, saved for AutoTokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([TOKENIZER_TEXT] * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.save_pretrained(path)


def make_checkpoint(
    arch: str,
    path: Path,
    fused: bool = False,
    seed: int = 0,
    logit_scale: float = 20.0,
    **sizes: int,
) -> Path:
    """Save a random tiny `arch` model (and tokenizer) to `path`; returns `path`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **sizes)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    model.save_pretrained(path, save_original_format=not fused)
    make_tokenizer(path)
    return path
