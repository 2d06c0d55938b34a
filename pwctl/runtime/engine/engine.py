"""The engine every front end shares (generate, bench, serve): a pack loaded into a
transformers model with pwctl MoE blocks, a tokenizer, and the expert widths of a policy.

Two paths share the model: the single-sequence reference (`logits`, `generate_ids`: transformers'
own attention and generate; bench and profile use them) and continuous batching
(`start_batching`, then `add_request` / `step` / `abort`, or `generate_batch`): paged KV cache,
scheduler and one memory budget for planes + KV + workspace (batcher.py); with "paged",
planes and KV blocks live in one arena of slabs sized from that budget at `start_batching`.

Two expert backends (`experts`): "store" (ExpertStore: dequantized weights per width, the CPU
reference; fp16 and RTN variants) and "paged" (PagedExperts: planes paged into slabs by the
pager, the fused MoE reads them; the default on CUDA). With "paged", every width change is a
`PagedExperts.request` and the widths kernels read change only at `PagedExperts.commit`, which
the batcher calls at each step boundary (set_policy settles at once: no step is running)."""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pwctl.errors import PwctlError
from pwctl.format.pack import Pack
from pwctl.format.profile import PROFILE_JSON
from pwctl.kernels import geometry
from pwctl.policy import Budget, BudgetArg, Kind, Policy
from pwctl.runtime.engine.batcher import BatchConfig, Batcher
from pwctl.runtime.engine.decode_graphs import DecodeGraphs
from pwctl.runtime.engine.loader import load_model
from pwctl.runtime.engine.runner import ModelRunner
from pwctl.runtime.engine.scheduler import SamplingParams, Scheduler, Sequence
from pwctl.runtime.memory.accounting import (
    FixedPart,
    StepShape,
    cap_allocator,
    configure_allocator,
    device_capacity,
    fixed_part,
    measures_steps,
    release_allocator_cap,
    step_bytes,
)
from pwctl.runtime.memory.budget import MemoryBudget
from pwctl.runtime.memory.kv_cache import KVCache, KVLayout
from pwctl.runtime.memory.paged_experts import PagedExperts
from pwctl.runtime.moe.block import MoEBlock, MoETap
from pwctl.runtime.moe.dense_experts import DenseExperts, dense_dtype
from pwctl.runtime.widths.allocator import WidthAllocator

log = logging.getLogger(__name__)


def open_pack(name_or_path: str | Path) -> Pack:
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise PwctlError(f"{path}: no such pack (make one with `pwctl convert SRC {path}`)")
    return Pack(path)


EXPERTS = ("store", "paged", "dense")


def serving_dtype(device: str, experts: str = "paged") -> torch.dtype:
    """Half precision where serving runs it (CUDA: fp16 for the fused kernels, bf16 for the
    16-bit experts' grouped GEMMs); float32 on the CPU reference path."""
    if experts == "dense":
        return dense_dtype(device)
    return torch.float16 if device.startswith("cuda") else torch.float32


def experts_for(policy: Policy | None, device: str) -> str:
    """The expert backend a front end serving one `policy` (None: `--policy auto`, always
    planes) wants on `device`: on CUDA the paged planes, or for fp16 the 16-bit grouped GEMMs
    (reference weights are not planes); on the CPU the store (the reference path)."""
    if not device.startswith("cuda"):
        return "store"
    return "dense" if policy is not None and policy.kind is Kind.FP16 else "paged"


class Engine:
    def __init__(
        self,
        pack: Pack,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        experts: str | None = None,
        max_bits: int | None = None,
    ):
        """`experts`: "store" or "paged" (None: paged on CUDA, store on the CPU). `max_bits`:
        the widest width served, below the pack's (None: the pack's); no plan goes past it."""
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise PwctlError("--device cuda: no CUDA device visible")
        if device.startswith("cuda"):
            configure_allocator()  # before the first weight lands on the device
            release_allocator_cap(device)  # the last engine's budget is not this one's
        experts = experts or ("paged" if device.startswith("cuda") else "store")
        if experts not in EXPERTS:
            raise PwctlError(f"experts {experts!r}: choose from {EXPERTS}")
        self.pack = pack
        self.device = device
        self.dtype = dtype
        self.model, self.store = load_model(pack, device, dtype)
        if max_bits is not None:
            self.store.limit(max_bits)
        self.paged = self._install_paged() if experts == "paged" else None
        self.dense = self._install_dense() if experts == "dense" else None
        self.batcher: Batcher | None = None
        self._tokenizer: Any = None  # loaded on first use
        self._allocators: dict[str, WidthAllocator] = {}
        self.allocator: WidthAllocator | None = None
        # bytes the largest eager step of each shape took on the device (`_measure_step`)
        self._measured: dict[StepShape, int] = {}

    @property
    def experts(self) -> str:
        if self.dense is not None:
            return "dense"
        return "store" if self.paged is None else "paged"

    def _install_dense(self) -> DenseExperts:
        """The 16-bit experts on the device, handed to every MoE block (fp16 policy only)."""
        if self.pack.manifest.spec.get("dense_intermediate"):
            raise PwctlError(
                f"{self.pack.path}: the 16-bit experts have no dense MLP (Gemma-4); use "
                "Engine(..., experts='store')"
            )
        dense = DenseExperts(self.pack, self.device, self.dtype)
        for m in self.model.modules():
            if isinstance(m, MoEBlock):
                m.dense = dense
        self.store.apply(Policy("fp16"))
        return dense

    def _install_paged(self) -> PagedExperts:
        """Build the paged backend and hand it to every MoE block. On CUDA its arena starts
        empty: serving sizes it from the memory budget (`start_batching`), and only the
        reference path (`set_policy`, `logits`) makes one for the widest widths, so a server
        never holds device memory past its budget, not even while it starts. On the CPU the
        arena is host memory: made for the widest widths at once."""
        cuda = self.device.startswith("cuda")
        try:
            paged = PagedExperts(
                self.pack, self.device, 0 if cuda else None, max_bits=self.store.max_bits
            )
        except ValueError as e:  # e.g. an activation the fused MoE does not implement
            raise PwctlError(
                f"{self.pack.path}: the paged experts cannot run this pack ({e})"
            ) from None
        if not cuda:
            paged.request(self.store.widths)
            paged.settle()
        for m in self.model.modules():
            if isinstance(m, MoEBlock):
                m.paged = paged
        return paged

    def _check_paged(self, policy: Policy) -> None:
        if self.dense is not None and policy.kind is not Kind.FP16:
            raise PwctlError(
                f"policy {policy}: the 16-bit experts run only fp16; use Engine(..., "
                "experts='paged') for bit-plane policies"
            )
        fp16 = policy.kind is Kind.FP16
        if self.paged is not None and (fp16 or self.store.has_variant(policy)):
            raise PwctlError(
                f"policy {policy}: not expressible in bit planes, so the paged experts cannot "
                "run it; use Engine(..., experts='store')"
            )

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            try:
                self._tokenizer = AutoTokenizer.from_pretrained(
                    self.pack.path, local_files_only=True
                )
            except (OSError, ValueError) as e:
                raise PwctlError(f"{self.pack.path}: pack has no usable tokenizer ({e})") from None
        return self._tokenizer

    def set_policy(self, policy: Policy, headroom: float = 0.0) -> None:
        """Fixed policies set widths once; budgeted ones get a WidthAllocator (kept per policy,
        so its live signals survive switching between policies in a bench). `headroom`: plane
        memory the KV cache leaves free now, as a fraction of BUDGET (dynamic policies only)."""
        self._apply_policy(policy, headroom)
        self._settle_paged()

    def _apply_policy(self, policy: Policy, headroom: float = 0.0) -> None:
        """The store's widths (the plan) for `policy`; the paged backend follows at a settle."""
        self._check_paged(policy)
        self.allocator = None
        if policy.budget is None:
            self.store.apply(policy)
        else:
            key = str(policy)
            if key not in self._allocators:
                # the paged backend counts whole slabs, as its memory budget does
                cost = None if self.paged is None else self.paged.table.cost_at
                self._allocators[key] = WidthAllocator(self.pack, policy, cost, self.store.max_bits)
            self.allocator = self._allocators[key]
            self.store.plan.set(self.allocator.widths(headroom))

    def _settle_paged(self) -> None:
        """The store's widths are the plan: the paged backend runs them from the next forward
        (callers between forwards only: settling waits for the copies). Outside serving, an
        arena too small for them (CUDA's empty one) is made for the widest widths first."""
        if self.paged is None:
            return
        if self.batcher is None and self.paged.arena_bytes < self.plane_bytes():
            self.paged.rebuild(self.widest_plane_bytes())
        self.paged.request(self.store.widths)
        self.paged.settle()

    def _reference_ready(self) -> None:
        """The reference path runs on the paged experts only once their planes are resident
        (CUDA's arena starts empty)."""
        if self.paged is not None and self.batcher is None and self.paged.arena_bytes == 0:
            self._settle_paged()

    def reset_policies(self) -> None:
        """Forget every budgeted policy's live state (a new run starts from the profile)."""
        self._allocators.clear()
        self.allocator = None

    def observe(self, tap: MoETap) -> None:
        """After a step: feed the active budgeted policy the signals of the tokens just seen."""
        if self.allocator is not None:
            self.allocator.observe(tap)

    @torch.no_grad()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        self._reference_ready()
        return self.model(ids.to(self.device)).logits.float()

    @torch.no_grad()
    def generate_ids(self, ids: list[int], max_tokens: int) -> list[int]:
        """Greedy continuation of `ids` (transformers' generate over our MoE blocks)."""
        if max_tokens < 1:
            raise PwctlError("--max-tokens must be at least 1")
        if not ids:
            raise PwctlError("empty prompt")
        self._reference_ready()
        prompt = torch.tensor([ids], device=self.device)
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        out = self.model.generate(  # type: ignore[operator]  # GenerationMixin, undeclared
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=eos if isinstance(eos, int) else 0,
        )
        return out[0, len(ids) :].tolist()

    def generate(self, prompt: str, max_tokens: int) -> str:
        ids = self.tokenizer(prompt).input_ids
        return self.tokenizer.decode(self.generate_ids(ids, max_tokens), skip_special_tokens=True)

    # --- continuous batching ------------------------------------------------------------------

    def start_batching(
        self,
        policy: Policy,
        memory_budget: str | int | None = None,
        config: BatchConfig | None = None,
        on_widths: Callable[[np.ndarray], None] | None = None,
    ) -> Batcher:
        """Set `policy` and build the batching path under one memory budget (a size, or a
        fraction: of free GPU memory on CUDA, of `full_need` on CPU; None: `full_need`, i.e.
        the widest planes plus a full context for every sequence). `on_widths(widths)` is
        called after every width change, between steps (after the paged backend's request)."""
        cfg = config or BatchConfig()
        self._drop_batcher()
        self._apply_policy(policy)
        dynamic = self.allocator is not None and self.allocator.dynamic
        max_len = self.max_len(cfg)
        total, fixed, capacity = self._split_budget(memory_budget, cfg, dynamic)
        cap_allocator(self.device, total)  # free cached pages go back before the budget passes
        if self._measure_step(cfg, total, fixed, capacity):  # the fixed part may have grown
            total, fixed, capacity = self._split_budget(memory_budget, cfg, dynamic)
        kv, memory = self._arena(total, fixed, capacity, cfg, on_widths)
        sched = Scheduler(kv, cfg.max_batch_tokens, cfg.max_seqs, cfg.max_queue, memory.make_room)
        runner = ModelRunner(self.model, kv, self.device, self._decode_graphs(cfg, kv))
        self.batcher = Batcher(
            runner, sched, memory, self.tokenizer, self.eos_ids(), max_len,
            self.allocator if dynamic else None,
            self.paged.commit if self.paged is not None else None, cfg.overlap,
        )  # fmt: skip
        self.batcher.info = {"policy": str(policy), "device": self.device, "experts": self.experts}
        return self.batcher

    def _drop_batcher(self) -> None:
        """The previous batcher's KV blocks go with its arena; on CUDA its decode graphs' pool
        and cached pages go too, before the new budget caps the allocator (what a reference
        cycle kept would otherwise count against it)."""
        had, self.batcher = self.batcher is not None, None
        if had and self.device.startswith("cuda"):
            gc.collect()
            torch.cuda.empty_cache()

    def _arena(
        self,
        total: int,
        fixed: int,
        capacity: int,
        cfg: BatchConfig,
        on_widths: Callable[[np.ndarray], None] | None,
    ) -> tuple[KVCache, MemoryBudget]:
        """The KV cache of `capacity` blocks and the memory budget over it, the planes of the
        budget's first plan resident (on the paged backend one arena of `total - fixed` holds
        planes and KV blocks)."""
        if self.paged is not None:
            self.paged.rebuild(total - fixed)
        layout = KVLayout.from_config(self.model.config, self.dtype)
        kv = KVCache(layout, capacity, cfg.block_size, self.device, self.paged)
        memory = MemoryBudget(
            total, fixed, self.store, kv, self.allocator, self._on_widths(on_widths), self.paged
        )
        self._settle_paged()  # the budget's first plan runs from the first step
        return kv, memory

    def _measure_step(self, cfg: BatchConfig, total: int, fixed: int, capacity: int) -> bool:
        """CUDA, once a step shape: run the largest eager step and the largest decode graph and
        keep what they took (`fixed_part` counts it from then on); whether anything ran. They
        run in a probe arena of the first plan's planes and one full-length sequence (the
        budget's other KV blocks are not made), so where the formula fell short the step's
        workspace takes their room, not room past the budget; the serving arena is built after,
        from the confirmed part. A formula that fell short is logged: the calculator
        (`serving_budget`) has only it."""
        step = self._step_shape(cfg)
        if not measures_steps(self.device) or step in self._measured:
            return False
        one = self._seq_blocks(cfg)
        unmade = (capacity - one) * self._block_bytes(cfg)
        kv, memory = self._arena(total - unmade, fixed, one, cfg, None)
        short = kv.blocks_for(step.max_len) - kv.available
        if short > 0:  # a dynamic policy's first plan may leave less than one sequence
            memory.make_room(short, urgent=True)
        runner = ModelRunner(self.model, kv, self.device, self._decode_graphs(cfg, kv))
        with runner.probe_sequence(step.max_len) as rows:
            eager = partial(
                runner.largest_eager_step, rows, step.max_seqs, step.max_batch_tokens, step.max_len
            )
            graphs = partial(runner.largest_graph_step, step.max_len)
            self._measured[step] = step_bytes(self.device, eager, graphs)
        del eager, graphs, runner, kv, memory  # the graphs' pool goes before serving's own
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()
        confirmed = self.fixed_bytes(cfg)
        if confirmed > fixed:
            log.warning(
                "the largest step took %.1f MB more than the workspace formula counts; the "
                "arena gives up that much (please report: the calculator will be short too)",
                (confirmed - fixed) / 1e6,
            )
        return True

    def max_len(self, cfg: BatchConfig) -> int:
        """The longest sequence (prompt + output) the batching path serves."""
        return cfg.max_model_len or self.model.config.max_position_embeddings

    def _decode_graphs(self, cfg: BatchConfig, kv: KVCache) -> DecodeGraphs | None:
        """CUDA graphs of decode steps: the paged experts on CUDA only (the store's experts
        read routing on the host), steps of at most the decode kernels' tokens."""
        if not self._graphs_on(cfg):
            return None
        seqs = min(cfg.max_seqs, geometry.DECODE_MAX_TOKENS)
        if self.paged is None:  # the 16-bit experts: nothing chosen on the host
            return DecodeGraphs(self.model, kv, seqs)
        paged = self.paged
        return DecodeGraphs(self.model, kv, seqs, lambda T: paged.fused.decode_builds(T))

    def _on_widths(
        self, hook: Callable[[np.ndarray], None] | None
    ) -> Callable[[np.ndarray], None] | None:
        """The memory budget's width hook: the paged backend's request, then the caller's."""
        if self.paged is None:
            return hook
        paged = self.paged

        def on_widths(widths: np.ndarray) -> None:
            paged.request(widths)
            if hook is not None:
                hook(widths)

        return on_widths

    def _split_budget(
        self, text: str | int | None, cfg: BatchConfig, dynamic: bool
    ) -> tuple[int, int, int]:
        """(total, fixed, KV capacity in blocks) for the memory budget `text`. On the paged
        backend planes and KV blocks count in whole slabs of its arena. A dynamic policy's
        planes may go down to the narrowest widths under pressure (BUDGET gives way before a
        request is cut short), so its KV cache may grow to what those leave."""
        block_bytes, one_seq = self._block_bytes(cfg), self._seq_blocks(cfg)
        fixed, floor = self.fixed_bytes(cfg), self._floor_bytes(dynamic)
        widest = self.widest_plane_bytes() if dynamic else floor
        most_kv = cfg.max_seqs * one_seq
        arg = BudgetArg.parse(text)
        total = fixed + widest + most_kv * block_bytes
        if arg is not None:
            total = arg.resolve(self.device, total)
            has = device_capacity(self.device)
            if total > has:
                raise PwctlError(
                    f"--memory-budget {text}: {total / 1e9:.2f} GB is more than the "
                    f"{'GPU' if self.device.startswith('cuda') else 'machine'} has "
                    f"({has / 1e9:.2f} GB)"
                )
        capacity = min(most_kv, MemoryBudget.kv_capacity(total, fixed, floor, block_bytes))
        if capacity < one_seq:
            need = self._smallest(fixed, floor, one_seq * block_bytes)
            raise PwctlError(
                f"--memory-budget {text}: {total / 1e6:.2f} MB cannot hold the rest of the model "
                f"and its workspace ({fixed / 1e6:.2f} MB), the experts at their narrowest "
                f"({floor / 1e6:.2f} MB) and one sequence of {self.max_len(cfg)} tokens; the "
                f"smallest budget that starts is {need}b ({need / 1e6:.2f} MB), or lower "
                "--max-model-len"
            )
        return total, fixed, capacity

    def auto_policy(self, memory_budget: str | int | None, cfg: BatchConfig) -> Policy:
        """`--policy auto`: with a profile, pagedweight at the largest BUDGET that fits (every
        block at the widest width served, or what the memory budget leaves once one full-length
        sequence's KV is in); without one, uniform at the widest width that leaves that room.
        Front ends cap the widest width at AUTO_MAX_BITS unless --max-bits says otherwise (4 bits
        is the fastest decode width on the GPU: README)."""
        kv = self._seq_blocks(cfg) * self._block_bytes(cfg)
        fixed = self.fixed_bytes(cfg)
        arg = BudgetArg.parse(memory_budget)
        widest = self.widest_plane_bytes()
        full = fixed + widest + cfg.max_seqs * kv
        room = (full if arg is None else arg.resolve(self.device, full)) - fixed - kv
        if (self.pack.path / PROFILE_JSON).is_file():
            budget = min(widest, room)
            if budget >= self.narrowest_plane_bytes():
                return Policy("pagedweight", budget=Budget(nbytes=int(budget)))
        for bits in range(self.store.max_bits, self.store.min_bits - 1, -1):
            if self._uniform_plane_bytes(bits) <= room:
                return Policy("uniform", bits=bits)
        return Policy("uniform", bits=self.store.min_bits)  # start_batching says what is short

    def smallest_budget(self, policy: Policy, cfg: BatchConfig) -> int:
        """The smallest `--memory-budget` (bytes) that starts `policy` with `cfg`: the fixed
        part, the planes at their floor and one full-length sequence."""
        self._apply_policy(policy)
        floor = self._floor_bytes(self.allocator is not None and self.allocator.dynamic)
        kv = self._seq_blocks(cfg) * self._block_bytes(cfg)
        return self._smallest(self.fixed_bytes(cfg), floor, kv)

    def _smallest(self, fixed: int, floor: int, kv: int) -> int:
        """fixed + floor + kv, with a slab to spare for the arena's rounding."""
        return fixed + floor + kv + (0 if self.paged is None else self.paged.slab_bytes)

    def _block_bytes(self, cfg: BatchConfig) -> int:
        """Bytes of one KV block (whole slabs on the paged backend)."""
        layout = KVLayout.from_config(self.model.config, self.dtype)
        slab = None if self.paged is None else self.paged.slab_bytes
        return KVCache.block_bytes_of(layout, cfg.block_size, slab)

    def _seq_blocks(self, cfg: BatchConfig) -> int:
        """KV blocks of one full-length sequence."""
        return -(-self.max_len(cfg) // cfg.block_size)

    def _floor_bytes(self, dynamic: bool) -> int:
        """The fewest plane bytes the policy just applied can take: the narrowest widths for a
        dynamic one (its floors give way before a request is cut short), else its own."""
        return self.narrowest_plane_bytes() if dynamic else self.plane_bytes()

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        return self._batching().add(prompt_ids, params)

    def abort(self, seq_id: int) -> None:
        self._batching().abort(seq_id)

    def step(self) -> list[Sequence]:
        """One continuous-batching step: the sequences that got a token."""
        return self._batching().step()

    def generate_batch(self, prompts: list[list[int]], params: SamplingParams) -> list[Sequence]:
        return self._batching().run(prompts, params)

    def eos_ids(self) -> set[int]:
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        return ids | ({tok_eos} if tok_eos is not None else set())

    def fixed_bytes(self, cfg: BatchConfig) -> int:
        """Device bytes outside planes and KV blocks (memory/accounting.py owns the formula)."""
        return self.fixed_part(cfg).total

    def fixed_part(self, cfg: BatchConfig) -> FixedPart:
        """The accounting module's formula, confirmed by the measured largest step once
        `start_batching` has run it (CUDA)."""
        step = self._step_shape(cfg)
        graphs = self._graphs_on(cfg)
        part = fixed_part(self.model, self.pack.manifest.spec, self.dtype, step, graphs)
        measured = self._measured.get(step)
        return part if measured is None else part.confirmed(measured)

    def _step_shape(self, cfg: BatchConfig) -> StepShape:
        return StepShape(cfg.max_seqs, cfg.max_batch_tokens, self.max_len(cfg), cfg.block_size)

    def _graphs_on(self, cfg: BatchConfig) -> bool:
        """Whether decode steps replay CUDA graphs (the paged or 16-bit experts on CUDA)."""
        on_device = self.paged is not None or self.dense is not None
        return cfg.cuda_graphs and on_device and self.device.startswith("cuda")

    def plane_bytes(self) -> int:
        """Device bytes of the planes at the store's widths (whole slabs on the paged backend)."""
        if self.paged is None:
            return self.store.expert_bytes()
        return self.paged.plane_cost(self.store.widths)

    def widest_plane_bytes(self) -> int:
        """Every block at the widest width served (whole slabs on the paged backend)."""
        return self._uniform_plane_bytes(self.store.max_bits)

    def narrowest_plane_bytes(self) -> int:
        """Every block at the pack's narrowest width: what planes may shrink to under pressure."""
        return self._uniform_plane_bytes(self.store.min_bits)

    def _uniform_plane_bytes(self, bits: int) -> int:
        if self.paged is not None:
            return self.paged.widest_bytes(self.paged.table, bits)
        return sum(b.bytes_at(bits) for b in self.pack.blocks)

    def _batching(self) -> Batcher:
        if self.batcher is None:
            raise PwctlError("call Engine.start_batching first")
        return self.batcher
