"""Tiny checkpoints of every supported architecture, built locally with transformers'
save_pretrained (hub per-expert layout or the fused one). Tests and the demo use them; nothing
is downloaded. Logits are scaled away from uniform so quantization error is visible."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

VOCAB = 320
ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss")
ROUTER_SCALE = 30.0  # Gemma-4's router weights, times this (`make_checkpoint`)
GEMMA4 = "gemma4"  # not in ARCHS: transformers < 5.25 has no gemma4 (`has_gemma4`)

TOKENIZER_TEXT = (
    "In the beginning God created the heavens and the earth. The earth was formless and empty. "
    "It is a truth universally acknowledged that a single man in possession of a good fortune "
    "must be in want of a wife. The quick brown fox jumps over the lazy dog. 0123456789 "
)


def has_gemma4() -> bool:
    """Whether the installed transformers has Gemma-4 (`transformers.models.gemma4`)."""
    try:
        from transformers import Gemma4TextConfig  # noqa: F401
    except ImportError:
        return False
    return True


def tiny_config(arch: str, hidden: int = 128, layers: int = 2, experts: int = 4):
    from transformers import (
        GptOssConfig,
        MixtralConfig,
        OlmoeConfig,
        Qwen2MoeConfig,
        Qwen3MoeConfig,
    )

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
    if arch == "gpt_oss":  # sliding (window 8) and full layers alternate, as in the release
        return GptOssConfig(
            **common,
            intermediate_size=hidden,
            head_dim=hidden // 4,
            num_local_experts=experts,
            num_experts_per_tok=2,
            sliding_window=8,
            swiglu_limit=0.75,  # the release's 7.0 is never reached by a tiny random model
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 8.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
            },
        )
    if arch == GEMMA4:
        return gemma4_config(hidden, layers, experts)
    raise ValueError(f"no tiny config for {arch}")


def gemma4_config(
    hidden: int = 128, layers: int = 2, experts: int = 4, multimodal: bool = False, **extra: Any
):
    """A tiny Gemma-4 MoE text config with what sets it apart (26B-A4B's shape, scaled down):
    sliding and full layers alternating (window 8), full layers with twice the head dim and one
    key/value head (attention_k_eq_v: values from the key projection), final-logit softcapping,
    the dense MLP beside the experts. `extra` overrides (num_kv_shared_layers, per-layer inputs).
    `multimodal`: wrapped in Gemma4Config (no towers), saved as ForConditionalGeneration is."""
    from transformers import Gemma4Config, Gemma4TextConfig

    fields: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        global_head_dim=hidden // 2,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * (layers // 2)
        + ["full_attention"] * (layers % 2),
        final_logit_softcapping=30.0,
        enable_moe_block=True,
        num_experts=experts,
        top_k_experts=2,
        moe_intermediate_size=hidden // 2,
        hidden_size_per_layer_input=0,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    text = Gemma4TextConfig(**(fields | extra))
    if not multimodal:
        return text
    return Gemma4Config(
        text_config=text.to_dict(), vision_config=None, audio_config=None, tie_word_embeddings=False
    )


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
    mxfp4: bool = False,
    multimodal: bool = False,
    **sizes: int,
) -> Path:
    """Save a random tiny `arch` model (and tokenizer) to `path`; returns `path`. GPT-OSS is
    saved in bf16 (as released), its experts on the MXFP4 grid (the bf16 releases are
    dequantized MXFP4 too) and, with `mxfp4`, as MXFP4 blocks and scales: the same weights.
    `multimodal` (Gemma-4 only): saved as the ForConditionalGeneration release is, `sizes` also
    take Gemma-4's extra fields (`gemma4_config`)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    if arch == GEMMA4:
        config = gemma4_config(multimodal=multimodal, **sizes)
    else:
        config = tiny_config(arch, **sizes)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
        if arch == GEMMA4:  # norms and scales start at one: move them, so each one counts
            for name, t in [*model.named_parameters(), *model.named_buffers()]:
                if name.endswith(("norm.weight", "router.scale", "expert_scale", "layer_scalar")):
                    t.mul_(torch.empty_like(t).uniform_(0.5, 1.5))
                if name.endswith("router.proj.weight"):  # its input is unit-RMS times hidden^-0.5:
                    t.mul_(ROUTER_SCALE)  # router logits away from ties, as trained ones are
    packed = _gpt_oss_weights(model) if arch == "gpt_oss" else {}
    model.save_pretrained(path, save_original_format=not fused)
    if mxfp4:
        if not packed:
            raise ValueError(f"no MXFP4 experts for {arch}")
        _write_mxfp4(path, packed)
    make_tokenizer(path)
    return path


def _gpt_oss_weights(model: Any) -> dict[str, torch.Tensor]:
    """GPT-OSS's tiny weights, in place: biases, router bias and attention sinks big enough to
    matter (transformers initialises some to zero), experts snapped to the MXFP4 grid, all bf16.
    Returns the experts' MXFP4 tensors under the hub's names (`<name>_blocks`, `<name>_scales`)."""
    from pwctl.build import mxfp4

    packed = {}
    with torch.no_grad():
        for n, layer in enumerate(model.model.layers):
            experts, prefix = layer.mlp.experts, f"model.layers.{n}.mlp.experts"
            experts.gate_up_proj_bias.normal_(0.0, 0.5)
            experts.down_proj_bias.normal_(0.0, 0.1)
            layer.mlp.router.bias.normal_(0.0, 1.0)
            layer.self_attn.sinks.normal_(0.0, 1.0)
            for name in ("gate_up_proj", "down_proj"):
                w = getattr(experts, name)  # [E, in, out]; MXFP4 holds [E, out, in]
                blocks, scales = mxfp4.quantize(w.transpose(1, 2))
                w.copy_(mxfp4.dequantize(blocks, scales).transpose(1, 2))
                packed[f"{prefix}.{name}_blocks"] = blocks
                packed[f"{prefix}.{name}_scales"] = scales
    model.to(torch.bfloat16)
    return packed


def _write_mxfp4(path: Path, packed: dict[str, torch.Tensor]) -> None:
    """Replace the saved experts' 16-bit tensors by their MXFP4 blocks and scales, and mark the
    config as the hub marks it."""
    import json

    from safetensors.torch import load_file, save_file

    shard = path / "model.safetensors"
    tensors = load_file(shard)
    for name in packed:
        if name.endswith("_blocks"):
            del tensors[name.removesuffix("_blocks")]
    save_file({**tensors, **packed}, shard, metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": None}
    (path / "config.json").write_text(json.dumps(config, indent=2))
