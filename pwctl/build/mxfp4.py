"""MXFP4 (OCP Microscaling, FP4 E2M1 elements, one E8M0 scale per 32): how GPT-OSS's published
experts are stored, as a `<name>_blocks` and a `<name>_scales` tensor per fused weight.

- blocks: uint8 [..., rows, groups, 16]: 32 elements of a row's group, two a byte, element 2j in
  byte j's low nibble and element 2j + 1 in its high nibble;
- scales: uint8 [..., rows, groups]: the group's power of two, 2^(s - 127); 255 is NaN.

The weight is [..., rows, 32 groups] (rows: outputs, i.e. `y = W x`). Dequantization is exact in
float32 (and in bf16, whose exponent range is float32's): an element has at most two significant
bits and the scale is a power of two. `quantize` is the inverse the tests and tiny checkpoints use
(round to the nearest element, the scale the smallest that holds the group's largest magnitude).
"""

from __future__ import annotations

import torch

GROUP = 32  # elements a scale covers
BYTES = GROUP // 2  # bytes of a group's blocks
# FP4 E2M1 by code: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127
SCALE_NAN = 255


def scale_values(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 codes -> float32 powers of two, exactly: code s is the float32 whose exponent field
    is s (2^(s-127)); code 0 is 2^-127, a subnormal; 255 is NaN."""
    code = scales.to(torch.int32)
    bits = code << 23
    bits = torch.where(code == 0, torch.full_like(bits, 1 << 22), bits)
    bits = torch.where(code == SCALE_NAN, torch.full_like(bits, 0x7FC00000), bits)
    return bits.view(torch.float32)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [..., rows, groups * 32] of MXFP4 `blocks` [..., rows, groups, 16] and `scales`
    [..., rows, groups] (shapes checked by the caller)."""
    table = torch.tensor(E2M1, dtype=torch.float32, device=blocks.device)
    b = blocks.to(torch.int64)
    pairs = torch.stack([table[b & 0xF], table[b >> 4]], dim=-1)  # [..., groups, 16, 2]
    values = pairs.flatten(-2) * scale_values(scales)[..., None]  # [..., groups, 32]
    return values.flatten(-2)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, scales) of `w` [..., rows, cols] (cols a multiple of 32): each group's scale is
    the smallest power of two that brings its largest magnitude to at most 6, each element the
    nearest E2M1 value (a tie to the smaller magnitude)."""
    *lead, cols = w.shape
    if cols % GROUP:
        raise ValueError(f"MXFP4 needs columns in groups of {GROUP} (got {cols})")
    g = w.float().reshape(*lead, cols // GROUP, GROUP)
    peak = g.abs().amax(-1).clamp_min(2.0**-126)
    exp = torch.ceil(torch.log2(peak / 6.0)).clamp(-SCALE_BIAS, SCALE_BIAS)
    scaled = g / torch.exp2(exp)[..., None]
    table = torch.tensor(E2M1[:8], dtype=torch.float32, device=w.device)
    code = (scaled.abs()[..., None] - table).abs().argmin(-1)  # the first on a tie
    code = code | ((scaled < 0) & (code > 0)).to(code.dtype) << 3
    packed = code[..., 0::2] | code[..., 1::2] << 4
    return packed.to(torch.uint8), (exp + SCALE_BIAS).to(torch.uint8)
