"""`pwctl bench --quantizer`: nested any-precision quantization against round-to-nearest with
group-128 scales at equal bits per weight (tables and scales counted), on heavy-tailed synthetic
weights (Student-t) and activations with skewed channel scales.

Errors: relative weight MSE ||Wq - W||^2 / ||W||^2 and relative output error
||(Wq - W) X||^2 / ||W X||^2; the nested scheme is shown unweighted and weighted by E[x^2]."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from pwctl.build.convert import rows_per_table
from pwctl.build.quantize import quantize_nested
from pwctl.policy import Policy

GROUP = 128


@dataclass
class QuantRow:
    scheme: str
    bits: int
    bits_per_weight: float
    weight_mse: float
    output_err: float


def rtn_group(w: torch.Tensor, bits: int, group: int = GROUP) -> torch.Tensor:
    """Asymmetric round-to-nearest per group of `group` inputs, best of a few clip ratios."""
    rows, cols = w.shape
    g = w.reshape(rows, cols // group, group)
    best, best_err = None, None
    levels = 2**bits - 1
    for clip in (1.0, 0.95, 0.9, 0.85, 0.8, 0.75):
        lo, hi = g.amin(-1, keepdim=True) * clip, g.amax(-1, keepdim=True) * clip
        scale = ((hi - lo) / levels).clamp_min(1e-12)
        q = ((g.clamp(lo, hi) - lo) / scale).round() * scale + lo
        err = ((q - g) ** 2).sum(-1, keepdim=True)
        best = q if best is None else torch.where(err < best_err, q, best)
        best_err = err if best_err is None else torch.minimum(err, best_err)
    assert best is not None  # the loop ran
    return best.reshape(rows, cols)


def add_rtn_variant(engine, bits: int, group: int = GROUP) -> Policy:
    """Register round-to-nearest weights of every block (from the pack's reference) as a policy
    of the engine, so perplexity compares it with the nested widths on the same code path.
    Rows narrower than `group` use one group per row."""
    pack = engine.pack
    ref = pack.reference()
    weights, nbytes = {}, 0
    for i, block in enumerate(pack.blocks):
        g = group if block.cols % group == 0 else block.cols
        weights[i] = rtn_group(ref[block.name].float(), bits, g)
        nbytes += block.rows * block.cols * bits // 8 + block.rows * (block.cols // g) * 4
    name = f"rtn-g{group}:{bits}"
    engine.store.add_variant(name, weights, nbytes)
    return Policy(name)


def nested_bits_per_weight(bits: int, min_bits: int, cols: int, r: int) -> float:
    """Planes plus every table up to `bits` (all stay resident so demotion needs no copy)."""
    return bits + sum(2**j for j in range(min_bits, bits + 1)) * 16 / (cols * r)


def run_quantizer_bench(
    rows: int = 1024,
    cols: int = 4096,
    tokens: int = 2048,
    min_bits: int = 2,
    max_bits: int = 8,
    device: str = "cpu",
    seed: int = 0,
) -> list[QuantRow]:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    w = torch.distributions.StudentT(5.0).sample((rows, cols)).to(device) * 0.02
    chan = torch.exp(torch.randn(cols, generator=gen) * 1.0).to(device)  # skewed channel scales
    x = torch.randn(cols, tokens, generator=gen).to(device) * chan[:, None]
    ex2 = (x**2).mean(1)
    ref = w @ x

    def out_err(wq: torch.Tensor) -> float:
        return float(((wq - w) @ x).pow(2).sum() / ref.pow(2).sum())

    def mse(wq: torch.Tensor) -> float:
        return float((wq - w).pow(2).sum() / w.pow(2).sum())

    r = rows_per_table(rows, cols, 1024)
    results = []
    for name, imp in (("nested", None), ("nested-ex2", ex2.repeat(r)[None])):
        q = quantize_nested(w.reshape(rows // r, r * cols), imp, min_bits, max_bits)
        for b in range(min_bits, min(max_bits, 6) + 1):
            lab = q.labels.long() >> (max_bits - b)
            wq = q.tables[b].half().float().gather(1, lab).reshape(rows, cols)
            results.append(
                QuantRow(
                    name, b, nested_bits_per_weight(b, min_bits, cols, r), mse(wq), out_err(wq)
                )
            )
    for b in range(2, 7):
        wq = rtn_group(w, b)
        results.append(QuantRow(f"rtn-g{GROUP}", b, b + 32 / GROUP, mse(wq), out_err(wq)))
    nested = [x for x in results if x.scheme == "nested"]
    for b in range(2, 6):  # the nested curve read off at RTN's bits per weight
        bpw = b + 32 / GROUP
        results.append(
            QuantRow(
                "nested@rtn-bpw",
                b,
                bpw,
                _interp(nested, bpw, "weight_mse"),
                _interp(nested, bpw, "output_err"),
            )
        )
    return results


def _interp(rows: list[QuantRow], bpw: float, field: str) -> float:
    """Error at `bpw` by log-linear interpolation between the two nearest widths."""
    lo = max((r for r in rows if r.bits_per_weight <= bpw), key=lambda r: r.bits_per_weight)
    hi = min((r for r in rows if r.bits_per_weight > bpw), key=lambda r: r.bits_per_weight)
    t = (bpw - lo.bits_per_weight) / (hi.bits_per_weight - lo.bits_per_weight)
    a, b = getattr(lo, field), getattr(hi, field)
    return float(a * (b / a) ** t)


def as_dicts(rows: list[QuantRow]) -> list[dict]:
    return [asdict(r) for r in rows]
