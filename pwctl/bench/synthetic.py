"""Real-shape checkpoints with synthetic weights, for speed measurements of big models without
downloads: `python -m pwctl.bench.synthetic OUT --shape mixtral --layers 1`."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

SHAPES = {
    "mixtral": dict(hidden=4096, inter=14336, experts=8, top_k=2),
    "qwen-moe": dict(hidden=2048, inter=1408, experts=60, top_k=4),
    "qwen3-moe": dict(hidden=2048, inter=768, experts=128, top_k=8),
}
TOKENIZER = Path(__file__).parents[1] / "models" / "tokenizer"


def write_checkpoint(
    out: Path,
    shape: str,
    layers: int = 1,
    experts: int | None = None,
    vocab: int = 4096,
    device: str = "cpu",
) -> Path:
    """A checkpoint of Student-t weights in bf16, in Mixtral naming whatever the shape (the
    converter's cost depends on the shapes, not on the router's arithmetic)."""
    s = SHAPES[shape]
    h, inter, n_exp = s["hidden"], s["inter"], experts or s["experts"]
    out.mkdir(parents=True, exist_ok=True)
    config = dict(
        model_type="mixtral",
        architectures=["MixtralForCausalLM"],
        vocab_size=vocab,
        hidden_size=h,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_local_experts=n_exp,
        num_experts_per_tok=s["top_k"],
        max_position_embeddings=4096,
        hidden_act="silu",
        rms_norm_eps=1e-5,
        rope_theta=1e6,
        dtype="bfloat16",
    )
    (out / "config.json").write_text(json.dumps(config, indent=1))
    student = torch.distributions.StudentT(torch.tensor(5.0, device=device))

    def rand(*shape: int) -> torch.Tensor:
        return (student.sample(shape) * 0.02).to(torch.bfloat16).cpu()

    state = {
        "model.embed_tokens.weight": rand(vocab, h),
        "lm_head.weight": rand(vocab, h),
        "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
    }
    for layer in range(layers):
        p = f"model.layers.{layer}."
        kv = h // 4
        state |= {
            p + "self_attn.q_proj.weight": rand(h, h),
            p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h),
            p + "self_attn.o_proj.weight": rand(h, h),
            p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "block_sparse_moe.gate.weight": rand(n_exp, h),
        }
        for e in range(n_exp):
            q = f"{p}block_sparse_moe.experts.{e}."
            state |= {
                q + "w1.weight": rand(inter, h),
                q + "w3.weight": rand(inter, h),
                q + "w2.weight": rand(h, inter),
            }
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    if TOKENIZER.is_dir():  # the bundled tokenizer (vocab 4096), so profile can read text
        for f in TOKENIZER.iterdir():
            shutil.copy2(f, out / f.name)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out", type=Path)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="mixtral")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--experts", type=int, default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    write_checkpoint(a.out, a.shape, a.layers, a.experts, device=a.device)


if __name__ == "__main__":
    main()
