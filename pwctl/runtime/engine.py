"""The engine every front end shares (generate, bench, serve): a pack loaded into a
transformers model with pwctl MoE blocks, a tokenizer, and the expert widths of a policy.

Two paths share the model: the single-sequence reference (`logits`, `generate_ids`: transformers'
own attention and generate; bench and profile use them) and continuous batching
(`start_batching`, then `add_request` / `step` / `abort`, or `generate_batch`): paged KV cache,
scheduler and one memory budget for planes + KV + workspace (runtime/batcher.py); with "paged",
planes and KV blocks live in one arena of slabs sized from that budget at `start_batching`.

Two expert backends (`experts`): "store" (ExpertStore: dequantized weights per width, the CPU
reference; fp16 and RTN variants) and "paged" (PagedExperts: planes paged into slabs by the
pager, the fused MoE reads them; the default on CUDA). With "paged", every width change is a
`PagedExperts.request` and the widths kernels read change only at `PagedExperts.commit`, which
the batcher calls at each step boundary (set_policy settles at once: no step is running)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from pwctl.errors import PwctlError
from pwctl.pack import Pack
from pwctl.policy import Policy, parse_budget
from pwctl.runtime import kernels
from pwctl.runtime.allocator import WidthAllocator
from pwctl.runtime.batcher import BatchConfig, Batcher
from pwctl.runtime.decode_graphs import DecodeGraphs
from pwctl.runtime.kv_cache import KVCache, KVLayout
from pwctl.runtime.loader import load_model
from pwctl.runtime.memory import MemoryBudget
from pwctl.runtime.moe import MoEBlock, MoETap
from pwctl.runtime.paged_experts import PagedExperts
from pwctl.runtime.runner import ModelRunner
from pwctl.runtime.scheduler import SamplingParams, Scheduler, Sequence


def open_pack(name_or_path: str | Path) -> Pack:
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise PwctlError(f"{path}: no such pack (make one with `pwctl convert SRC {path}`)")
    return Pack(path)


EXPERTS = ("store", "paged")


def serving_dtype(device: str) -> torch.dtype:
    """Half precision where serving runs it (CUDA); float32 on the CPU reference path."""
    return torch.float16 if device.startswith("cuda") else torch.float32


def experts_for(policy: Policy, device: str) -> str:
    """The expert backend a front end serving one `policy` wants: paged on CUDA, except fp16
    (reference weights are not planes), which stays on the store."""
    cuda = device.startswith("cuda")
    return "paged" if cuda and policy.name != "fp16" else "store"


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
        self.batcher: Batcher | None = None
        self._tokenizer = None
        self._allocators: dict[str, WidthAllocator] = {}
        self.allocator: WidthAllocator | None = None

    @property
    def experts(self) -> str:
        return "store" if self.paged is None else "paged"

    def _install_paged(self) -> PagedExperts:
        """Build the paged backend (pool for the widest widths), load the store's widths and
        hand it to every MoE block."""
        try:
            paged = PagedExperts(self.pack, self.device, max_bits=self.store.max_bits)
        except ValueError as e:  # e.g. an activation the fused MoE does not implement
            raise PwctlError(
                f"{self.pack.path}: the paged experts cannot run this pack ({e})"
            ) from None
        paged.request(self.store.widths)
        paged.settle()
        for m in self.model.modules():
            if isinstance(m, MoEBlock):
                m.paged = paged
        return paged

    def _check_paged(self, policy: Policy) -> None:
        if self.paged is not None and (policy.name == "fp16" or self.store.has_variant(policy)):
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
            self.store.widths[:] = self.allocator.widths(headroom)

    def _settle_paged(self) -> None:
        """The store's widths are the plan: the paged backend runs them from the next forward
        (callers between forwards only: settling waits for the copies)."""
        if self.paged is not None:
            self.paged.request(self.store.widths)
            self.paged.settle()

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
        return self.model(ids.to(self.device)).logits.float()

    @torch.no_grad()
    def generate_ids(self, ids: list[int], max_tokens: int) -> list[int]:
        """Greedy continuation of `ids` (transformers' generate over our MoE blocks)."""
        if max_tokens < 1:
            raise PwctlError("--max-tokens must be at least 1")
        if not ids:
            raise PwctlError("empty prompt")
        prompt = torch.tensor([ids], device=self.device)
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        out = self.model.generate(
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
        memory_budget: str | None = None,
        config: BatchConfig | None = None,
        on_widths: Callable[[np.ndarray], None] | None = None,
    ) -> Batcher:
        """Set `policy` and build the batching path under one memory budget (a size, or a
        fraction: of free GPU memory on CUDA, of `full_need` on CPU; None: `full_need`, i.e.
        the widest planes plus a full context for every sequence). `on_widths(widths)` is
        called after every width change, between steps (after the paged backend's request)."""
        cfg = config or BatchConfig()
        self.batcher = None  # the previous batcher's KV blocks go with its arena
        self._apply_policy(policy)
        dynamic = self.allocator is not None and self.allocator.dynamic
        layout = KVLayout.from_config(self.model.config, self.dtype)
        max_len = cfg.max_model_len or self.model.config.max_position_embeddings
        total, fixed, capacity = self._split_budget(memory_budget, cfg, layout, max_len, dynamic)
        if self.paged is not None:  # one arena for planes and KV blocks: total - fixed
            self.paged.rebuild(total - fixed)
        kv = KVCache(layout, capacity, cfg.block_size, self.device, self.paged)
        memory = MemoryBudget(
            total, fixed, self.store, kv, self.allocator, self._on_widths(on_widths), self.paged
        )
        self._settle_paged()  # the budget's first plan runs from the first step
        sched = Scheduler(kv, cfg.max_batch_tokens, cfg.max_seqs, cfg.max_queue, memory.make_room)
        runner = ModelRunner(self.model, kv, self.device, self._decode_graphs(cfg, kv))
        self.batcher = Batcher(
            runner, sched, memory, self.tokenizer, self.eos_ids(), max_len,
            self.allocator if dynamic else None,
            self.paged.commit if self.paged is not None else None,
        )  # fmt: skip
        return self.batcher

    def _decode_graphs(self, cfg: BatchConfig, kv: KVCache) -> DecodeGraphs | None:
        """CUDA graphs of decode steps: the paged experts on CUDA only (the store's experts
        read routing on the host), steps of at most the decode kernels' tokens."""
        if not (cfg.cuda_graphs and self.paged is not None and self.device.startswith("cuda")):
            return None
        paged = self.paged
        seqs = min(cfg.max_seqs, kernels.DECODE_MAX_TOKENS)
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
        self, text: str | None, cfg: BatchConfig, layout: KVLayout, max_len: int, dynamic: bool
    ) -> tuple[int, int, int]:
        """(total, fixed, KV capacity in blocks) for the memory budget `text`. On the paged
        backend planes and KV blocks count in whole slabs of its arena."""
        slab = None if self.paged is None else self.paged.slab_bytes
        block_bytes = KVCache.block_bytes_of(layout, cfg.block_size, slab)
        fixed = self.fixed_bytes(cfg)
        planes = (
            self.store.expert_bytes()
            if self.paged is None
            else self.paged.plane_cost(self.store.widths)
        )
        floor = self.allocator.budget if dynamic else planes
        widest = self.widest_plane_bytes() if dynamic else floor
        most_kv = cfg.max_seqs * -(-max_len // cfg.block_size)
        total = self._resolve_budget(text, fixed + widest + most_kv * block_bytes)
        capacity = min(most_kv, MemoryBudget.kv_capacity(total, fixed, floor, block_bytes))
        if capacity < 1:
            raise PwctlError(
                f"--memory-budget {text}: {total / 1e6:.2f} MB leaves no KV block once "
                f"the experts ({floor / 1e6:.2f} MB) and the rest ({fixed / 1e6:.2f} MB) are in"
            )
        return total, fixed, capacity

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
        """Device bytes outside planes and KV: non-expert weights + an activation workspace
        estimate (packed hidden states and attention/MLP temporaries, logits)."""
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        c, elem = self.model.config, torch.empty(0, dtype=self.dtype).element_size()
        work = cfg.max_batch_tokens * c.hidden_size * 16 * elem + cfg.max_seqs * c.vocab_size * 4
        if self.paged is not None:  # the CUDA backend's staging buffer (outside the slab pool)
            work += getattr(self.paged.backend, "workspace_bytes", 0)
        return weights + work

    def widest_plane_bytes(self) -> int:
        """Every block at the widest width served (whole slabs on the paged backend)."""
        top = self.store.max_bits
        if self.paged is not None:
            return self.paged.widest_bytes(self.paged.table, top)
        return sum(b.bytes_at(top) for b in self.pack.blocks)

    def _batching(self) -> Batcher:
        if self.batcher is None:
            raise PwctlError("call Engine.start_batching first")
        return self.batcher

    def _resolve_budget(self, text: str | None, full_need: int) -> int:
        if text is None:
            return full_need
        budget = parse_budget(text)
        if budget.fraction is None:
            return budget.resolve(0)
        if self.device.startswith("cuda"):
            return int(budget.fraction * torch.cuda.mem_get_info()[0])
        return int(budget.fraction * full_need)
