"""The engine every front end shares (generate, bench, serve): a pack loaded into a
transformers model with pwctl MoE blocks, a tokenizer, and the expert widths of a policy.

Two paths share the model: the single-sequence reference (`logits`, `generate_ids`: transformers'
own attention and generate; bench and profile use them) and continuous batching
(`start_batching`, then `add_request` / `step` / `abort`, or `generate_batch`): paged KV cache,
scheduler and one memory budget for planes + KV + workspace (runtime/batcher.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from pwctl.errors import PwctlError
from pwctl.pack import Pack
from pwctl.policy import Policy, parse_budget
from pwctl.runtime.allocator import WidthAllocator
from pwctl.runtime.batcher import BatchConfig, Batcher
from pwctl.runtime.kv_cache import KVCache, KVLayout
from pwctl.runtime.loader import load_model
from pwctl.runtime.memory import MemoryBudget
from pwctl.runtime.moe import MoETap
from pwctl.runtime.runner import ModelRunner
from pwctl.runtime.scheduler import SamplingParams, Scheduler, Sequence


def open_pack(name_or_path: str | Path) -> Pack:
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise PwctlError(f"{path}: no such pack (make one with `pwctl convert SRC {path}`)")
    return Pack(path)


class Engine:
    def __init__(self, pack: Pack, device: str = "cpu", dtype: torch.dtype = torch.float32):
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise PwctlError("--device cuda: no CUDA device visible")
        self.pack = pack
        self.device = device
        self.dtype = dtype
        self.model, self.store = load_model(pack, device, dtype)
        self.batcher: Batcher | None = None
        self._tokenizer = None
        self._allocators: dict[str, WidthAllocator] = {}
        self.allocator: WidthAllocator | None = None

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
        self.allocator = None
        if policy.budget is None:
            self.store.apply(policy)
            return
        key = str(policy)
        if key not in self._allocators:
            self._allocators[key] = WidthAllocator(self.pack, policy)
        self.allocator = self._allocators[key]
        self.store.widths[:] = self.allocator.widths(headroom)

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
        called after every width change, between steps (the GPU path: Pager.request)."""
        cfg = config or BatchConfig()
        self.set_policy(policy)
        dynamic = self.allocator is not None and self.allocator.dynamic
        layout = KVLayout.from_config(self.model.config, self.dtype)
        max_len = cfg.max_model_len or self.model.config.max_position_embeddings
        total, fixed, capacity = self._split_budget(memory_budget, cfg, layout, max_len, dynamic)
        kv = KVCache(layout, capacity, cfg.block_size, self.device)
        memory = MemoryBudget(total, fixed, self.store, kv, self.allocator, on_widths)
        sched = Scheduler(kv, cfg.max_batch_tokens, cfg.max_seqs, cfg.max_queue, memory.make_room)
        runner = ModelRunner(self.model, kv, self.device)
        self.batcher = Batcher(
            runner, sched, memory, self.tokenizer, self.eos_ids(), max_len,
            self.allocator if dynamic else None,
        )  # fmt: skip
        return self.batcher

    def _split_budget(
        self, text: str | None, cfg: BatchConfig, layout: KVLayout, max_len: int, dynamic: bool
    ) -> tuple[int, int, int]:
        """(total, fixed, KV capacity in blocks) for the memory budget `text`."""
        block_bytes = KVCache.block_bytes_of(layout, cfg.block_size)
        fixed = self.fixed_bytes(cfg)
        floor = self.allocator.budget if dynamic else self.store.expert_bytes()
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
        return weights + work

    def widest_plane_bytes(self) -> int:
        m = self.pack.manifest
        return sum(b.bytes_at(m.max_bits) for b in self.pack.blocks)

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
