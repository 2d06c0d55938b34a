"""`pwctl convert`: an HF MoE checkpoint -> a pack of nested bit-planes, streamed block by block.

Everything is checked before any work starts (architecture, shards, every expert tensor's shape and
dtype). Blocks are then read one expert slice at a time, quantized, and appended to their layer's
page file, so memory holds one block (plus the quantizer's workspace) at a time; with --calib the
source model is loaded once, before quantization, for the importance statistics.
"""

from __future__ import annotations

import json
import resource
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from pwctl.build import calibrate
from pwctl.build.checkpoint import FLOAT_DTYPES, Checkpoint, resolve_source, torch_dtype
from pwctl.build.quantize import quantize_nested
from pwctl.device import parse_device
from pwctl.errors import PwctlError
from pwctl.format.bitplanes import pack_planes, words_per_row
from pwctl.format.pack import (
    NONEXPERT,
    REFERENCE,
    Manifest,
    PackWriter,
    SafetensorsStream,
    check_replaceable,
)
from pwctl.format.recipe import PROJECTIONS, MoESpec, Recipe, load_recipe, resolve_spec

COPY_PATTERNS = (
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "vocab*",
    "merges.txt",
    "*.model",
    "chat_template*",
    "added_tokens.json",
)
FP16_MAX = 65504.0


@dataclass
class ConvertOptions:
    min_bits: int = 2
    max_bits: int = 8
    device: str = "cpu"
    calib: Path | None = None
    calib_tokens: int = 16384
    force: bool = False
    reference: bool = True
    table_group: int = 1024  # rows share a table until a table covers >= this many weights


@dataclass
class BlockSource:
    name: str
    layer: int
    expert: int
    shared: bool
    proj: str
    rows: int
    cols: int
    dtype: torch.dtype
    fetch: Callable[[], torch.Tensor]


@dataclass
class ConvertReport:
    pack: Path
    model_type: str
    layers: int
    blocks: int
    weighting: str
    seconds: float
    expert_bytes_in: int
    pack_bytes: int
    peak_rss_mb: float

    @property
    def mb_per_s(self) -> float:
        return self.expert_bytes_in / 1e6 / max(self.seconds, 1e-9)


def rows_per_table(rows: int, cols: int, group: int) -> int:
    """Smallest divisor r of rows with r * cols >= group: per-row tables (APL) for wide blocks,
    shared tables where a per-row table would cost several bits per weight."""
    for r in range(1, rows + 1):
        if rows % r == 0 and r * cols >= group:
            return r
    return rows


def _check(ckpt: Checkpoint, name: str, shape: tuple[int, ...]) -> torch.dtype:
    info = ckpt.info(name)
    if info.dtype not in FLOAT_DTYPES:
        raise PwctlError(
            f"{info.shard}: tensor {name} has dtype {info.dtype}; "
            f"expected one of {', '.join(FLOAT_DTYPES)}"
        )
    if info.shape != shape:
        raise PwctlError(
            f"{info.shard}: tensor {name} has shape {list(info.shape)}, expected {list(shape)}"
        )
    return FLOAT_DTYPES[info.dtype]


def plan_blocks(
    ckpt: Checkpoint, recipe: Recipe, spec: MoESpec
) -> tuple[list[int], list[BlockSource], set[str], dict[int, str]]:
    """Every block to quantize, in file order, after checking each source tensor."""
    h, i, n_exp = spec.hidden, spec.intermediate, spec.num_experts
    layers, blocks, consumed, layouts = [], [], set(), {}
    n_layers = int(ckpt.config.get("num_hidden_layers", 0))

    def add(layer, expert, shared, proj, rows, cols, dtype, fetch):
        blocks.append(
            BlockSource(
                f"layers.{layer}.experts.{expert}.{proj}",
                layer,
                expert,
                shared,
                proj,
                rows,
                cols,
                dtype,
                fetch,
            )
        )

    def shape(proj: str, inter: int) -> tuple[int, int]:
        return (h, inter) if proj == "down" else (inter, h)

    for layer in range(n_layers):
        per = {p: recipe.per_expert[p].format(layer=layer, expert=0) for p in PROJECTIONS}
        gu = recipe.fused["gate_up"].format(layer=layer)
        dn = recipe.fused["down"].format(layer=layer)
        if per["gate"] in ckpt.tensors:
            layouts[layer] = "per_expert"
            for e in range(n_exp):
                for p in PROJECTIONS:
                    name = recipe.per_expert[p].format(layer=layer, expert=e)
                    dt = _check(ckpt, name, shape(p, i))
                    add(layer, e, False, p, *shape(p, i), dt, lambda n=name: ckpt.tensor(n))
                    consumed.add(name)
        elif gu in ckpt.tensors:
            layouts[layer] = "fused"
            dt = _check(ckpt, gu, (n_exp, 2 * i, h))
            _check(ckpt, dn, (n_exp, h, i))
            for e in range(n_exp):
                add(layer, e, False, "gate", i, h, dt, lambda e=e, g=gu: ckpt.slice(g, e)[:i])
                add(layer, e, False, "up", i, h, dt, lambda e=e, g=gu: ckpt.slice(g, e)[i:])
                add(layer, e, False, "down", h, i, dt, lambda e=e, d=dn: ckpt.slice(d, e))
            consumed |= {gu, dn}
        else:
            continue
        layers.append(layer)
        if spec.has_shared:
            for p in PROJECTIONS:
                name = recipe.shared[p].format(layer=layer)
                dt = _check(ckpt, name, shape(p, spec.shared_intermediate))
                add(
                    layer,
                    n_exp,
                    True,
                    p,
                    *shape(p, spec.shared_intermediate),
                    dt,
                    lambda n=name: ckpt.tensor(n),
                )
                consumed.add(name)
        if recipe.dense:  # the dense MLP: in the shared expert's slot (its width per layer)
            rows = ckpt.info(recipe.dense["gate"].format(layer=layer)).shape[0]
            for p in PROJECTIONS:
                name = recipe.dense[p].format(layer=layer)
                dt = _check(ckpt, name, shape(p, rows))
                add(layer, n_exp, True, p, *shape(p, rows), dt, lambda n=name: ckpt.tensor(n))
                consumed.add(name)
    if not layers:
        raise PwctlError(
            f"{ckpt.path}: no expert tensors found where the {recipe.model_type} "
            f"recipe expects them (e.g. {recipe.per_expert['gate']})"
        )
    return layers, blocks, consumed, layouts


def quantize_block(
    w: torch.Tensor, imp: torch.Tensor | None, name: str, opts: ConvertOptions
) -> tuple[torch.Tensor, dict[int, torch.Tensor], int]:
    rows, cols = w.shape
    w = w.to(opts.device, torch.float32)
    if not torch.isfinite(w).all():
        raise PwctlError(f"block {name}: non-finite weights in the source checkpoint")
    r = rows_per_table(rows, cols, opts.table_group)
    group_imp = None if imp is None else imp.to(opts.device).repeat(r)[None]
    q = quantize_nested(w.reshape(rows // r, r * cols), group_imp, opts.min_bits, opts.max_bits)
    for b, t in q.tables.items():
        if t.abs().max() > FP16_MAX:
            raise PwctlError(f"block {name}: {b}-bit table exceeds the fp16 range")
    planes = pack_planes(q.labels.reshape(rows, cols), opts.max_bits)
    return planes, {b: t.half() for b, t in q.tables.items()}, r


def convert(
    src: str | Path,
    out: Path,
    opts: ConvertOptions,
    progress: Callable[[int, int, str], None] | None = None,
) -> ConvertReport:
    if not 1 <= opts.min_bits <= opts.max_bits <= 8:
        raise PwctlError(
            f"--min-bits/--max-bits must satisfy 1 <= min <= max <= 8 "
            f"(got {opts.min_bits}, {opts.max_bits})"
        )
    if opts.calib_tokens < 1 or opts.table_group < 1:
        raise PwctlError(
            f"--calib-tokens {opts.calib_tokens} / --table-group {opts.table_group}: "
            "each must be at least 1"
        )
    if opts.calib is not None and not opts.calib.is_file():
        raise PwctlError(f"--calib {opts.calib}: no such file")
    opts = replace(opts, device=parse_device(opts.device))
    t0 = time.perf_counter()
    path = resolve_source(src)
    ckpt = Checkpoint(path)
    recipe = load_recipe(ckpt.model_type)
    multimodal = _language_model(ckpt, recipe)
    spec = resolve_spec(recipe, ckpt.config)
    layers, blocks, consumed, layouts = plan_blocks(ckpt, recipe, spec)
    check_replaceable(out, opts.force)  # before any work: --force replaces only a pack

    imp, calib_meta = None, None
    if opts.calib is not None:
        imp = calibrate.collect(
            path, recipe, spec, layers, opts.calib, opts.device, max_tokens=opts.calib_tokens
        )
        calib_meta = {"file": opts.calib.name, "tokens": imp.tokens}
    writer = PackWriter(out, opts.force)
    try:
        infos, bytes_in = [], 0
        _write_nonexpert(writer, ckpt, recipe, consumed)
        ref = (
            SafetensorsStream(
                writer.path(REFERENCE), [(b.name, b.dtype, (b.rows, b.cols)) for b in blocks]
            )
            if opts.reference
            else None
        )
        for n, b in enumerate(blocks):
            w = b.fetch()
            bytes_in += w.numel() * w.element_size()
            ref_crc = ref.write(b.name, w) if ref is not None else None
            weights, tokens = (
                (None, None)
                if imp is None
                else imp.weights(b.layer, b.expert, "mid" if b.proj == "down" else "in", b.shared)
            )
            planes, tables, r = quantize_block(w, weights, b.name, opts)
            meta = dict(
                name=b.name,
                layer=b.layer,
                expert=b.expert,
                shared=b.shared,
                proj=b.proj,
                rows=b.rows,
                cols=b.cols,
                words=words_per_row(b.cols),
                rows_per_table=r,
                importance_tokens=tokens,
                reference_crc32=ref_crc,
            )
            infos.append(writer.add_block(meta, planes, tables, opts.min_bits))
            if progress:
                progress(n + 1, len(blocks), b.name)
        if ref is not None:
            ref.close()
        _copy_side_files(path, writer.tmp)
        if multimodal:  # the pack holds the language model alone: its config is the text one
            (writer.tmp / "config.json").write_text(json.dumps(ckpt.config, indent=2))
        manifest = Manifest(
            model_type=ckpt.model_type,
            config=ckpt.config,
            spec=asdict(spec),
            min_bits=opts.min_bits,
            max_bits=opts.max_bits,
            weighting="uniform" if imp is None else "calib-ex2",
            moe_layers=layers,
            blocks=infos,
            calib=calib_meta,
            reference=opts.reference,
            source={"path": str(path), "layouts": layouts, "table_group": opts.table_group},
        )
        writer.commit(manifest)
    except BaseException:
        writer.abort()
        raise
    pack_bytes = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    return ConvertReport(
        out,
        ckpt.model_type,
        len(layers),
        len(blocks),
        manifest.weighting,
        time.perf_counter() - t0,
        bytes_in,
        pack_bytes,
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    )


def _language_model(ckpt: Checkpoint, recipe: Recipe) -> bool:
    """A multimodal checkpoint (the recipe's `[text]`) seen as its language model alone: the
    text config, tensors under text names, the towers left out. Whether it was one."""
    text = recipe.text_config(ckpt.config)
    if text is ckpt.config:
        return False
    ckpt.config = text
    ckpt.tensors = {
        new: info for name, info in ckpt.tensors.items() if (new := recipe.text_name(name))
    }
    return True


def _write_nonexpert(writer: PackWriter, ckpt: Checkpoint, recipe: Recipe, consumed: set[str]):
    names = sorted(set(ckpt.tensors) - consumed)
    entries = [
        (recipe.in_memory_name(n), torch_dtype(ckpt.tensors[n].dtype), ckpt.tensors[n].shape)
        for n in names
    ]
    stream = SafetensorsStream(writer.path(NONEXPERT), entries)
    for n, (mem_name, _, _) in zip(names, entries, strict=True):
        stream.write(mem_name, ckpt.tensor(n))
    stream.close()


def _copy_side_files(src: Path, dst: Path) -> None:
    for pattern in COPY_PATTERNS:
        for f in src.glob(pattern):
            if f.is_file():
                shutil.copy2(f, dst / f.name)
