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
from functools import partial
from pathlib import Path

import torch

from pwctl.build import calibrate, mxfp4
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
# one block of a fused layout: expert, projection, rows, cols, dtype, its read
ExpertSource = tuple[int, str, int, int, torch.dtype, Callable[[], torch.Tensor]]


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
        per = {p: recipe.per_expert[p].format(layer=layer, expert=0) for p in recipe.per_expert}
        gu = recipe.fused["gate_up"].format(layer=layer)
        dn = recipe.fused["down"].format(layer=layer)
        mx = {n: {k: v.format(name=n) for k, v in recipe.mxfp4.items()} for n in (gu, dn)}
        found = gu in ckpt.tensors or mx[gu].get("blocks") in ckpt.tensors
        if recipe.experts.get("transposed") and found:
            layouts[layer] = "fused" if gu in ckpt.tensors else "mxfp4"
            sources, names = _transposed(ckpt, recipe, spec, layer, gu, dn, mx)
            for e, p, rows, cols, dt, fetch in sources:
                add(layer, e, False, p, rows, cols, dt, fetch)
            consumed |= names
        elif per.get("gate") in ckpt.tensors:
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
            f"recipe expects them (e.g. {recipe.per_expert.get('gate', recipe.fused['gate_up'])})"
        )
    return layers, blocks, consumed, layouts


def _transposed(
    ckpt: Checkpoint,
    recipe: Recipe,
    spec: MoESpec,
    layer: int,
    gu: str,
    dn: str,
    mx: dict[str, dict[str, str]],
) -> tuple[list[ExpertSource], set[str]]:
    """One layer's blocks from transposed fused tensors (GPT-OSS: gate_up [E, H, 2I] with gate
    and up interleaved along its columns when the recipe says so, down [E, I, H]), in 16-bit
    or as MXFP4 blocks + scales ([E, out, in / 32, 16] and [E, out, in / 32], not transposed:
    rows are outputs); and the tensors consumed. Biases are checked, not consumed: they go to
    nonexpert.safetensors with the rest."""
    h, i, n_exp = spec.hidden, spec.intermediate, spec.num_experts
    inter = recipe.experts.get("interleaved", False)
    gate_rows, up_rows = (slice(0, None, 2), slice(1, None, 2)) if inter else (
        slice(0, i), slice(i, None))  # fmt: skip
    if gu in ckpt.tensors:  # [E, in, out]: an expert's slice transposed
        dt = _check(ckpt, gu, (n_exp, h, 2 * i))
        _check(ckpt, dn, (n_exp, i, h))

        def gate_up(e: int) -> torch.Tensor:
            return ckpt.slice(gu, e).T

        def down(e: int) -> torch.Tensor:
            return ckpt.slice(dn, e).T.contiguous()

        names = {gu, dn}
    else:
        dt = torch.bfloat16  # exact: FP4 elements times powers of two
        for name, out, cols in ((gu, 2 * i, h), (dn, h, i)):
            _check_mxfp4(ckpt, name, mx[name], (n_exp, out, cols))

        def read(name: str, e: int) -> torch.Tensor:
            b, sc = (ckpt.slice(mx[name][k], e) for k in ("blocks", "scales"))
            return mxfp4.dequantize(b, sc).to(dt)

        def gate_up(e: int) -> torch.Tensor:
            return read(gu, e)

        def down(e: int) -> torch.Tensor:
            return read(dn, e)

        names = {mx[n][k] for n in (gu, dn) for k in ("blocks", "scales")}
    if spec.expert_bias:
        for key, shape in (("gate_up_bias", (n_exp, 2 * i)), ("down_bias", (n_exp, h))):
            _check(ckpt, recipe.experts[key].format(layer=layer), shape)

    last: dict[int, torch.Tensor] = {}  # the expert gate_up was last read for: up follows gate

    def rows_of(e: int, r: slice) -> Callable[[], torch.Tensor]:
        def fetch() -> torch.Tensor:
            if e not in last:
                last.clear()
                last[e] = gate_up(e)
            return last[e][r].contiguous()

        return fetch

    sources: list[ExpertSource] = []
    for e in range(n_exp):
        sources.append((e, "gate", i, h, dt, rows_of(e, gate_rows)))
        sources.append((e, "up", i, h, dt, rows_of(e, up_rows)))
        sources.append((e, "down", h, i, dt, partial(down, e)))
    return sources, names


def _check_mxfp4(
    ckpt: Checkpoint, name: str, mx: dict[str, str], shape: tuple[int, int, int]
) -> None:
    """`name`'s MXFP4 blocks and scales exist, as uint8 of the weight `shape` [E, out, in]."""
    blocks, scales = mx["blocks"], mx["scales"]
    n, out, cols = shape
    ckpt.info(blocks)  # one missing: its error names it
    if scales not in ckpt.tensors:
        raise PwctlError(f"{ckpt.path}: MXFP4 tensor {blocks} has no scales tensor {scales}")
    groups = (n, out, cols // mxfp4.GROUP)
    want = {blocks: (*groups, mxfp4.BYTES), scales: groups}
    for t, s in want.items():
        info = ckpt.info(t)
        if info.dtype != "U8":
            raise PwctlError(f"{info.shard}: MXFP4 tensor {t} has dtype {info.dtype}; expected U8")
        if cols % mxfp4.GROUP or info.shape != s:
            raise PwctlError(
                f"{info.shard}: MXFP4 tensor {t} has shape {list(info.shape)}, expected "
                f"{list(s)} (a weight of {list(shape)} in groups of {mxfp4.GROUP})"
            )


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
        config = ckpt.config
        if "mxfp4" in layouts.values():  # the pack's experts are planes, the rest 16-bit
            config = {k: v for k, v in config.items() if k != "quantization_config"}
        if multimodal or config is not ckpt.config:  # multimodal: the language model's alone
            (writer.tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        manifest = Manifest(
            model_type=ckpt.model_type,
            config=config,
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
