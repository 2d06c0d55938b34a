"""The engine every front end shares (generate, bench, later serve): a pack loaded into a
transformers model with pwctl MoE blocks, a tokenizer, and the expert widths of a policy.

This first version runs one sequence at a time on the CPU reference path; the serving issue adds
the scheduler, paged KV cache and the GPU kernels behind the same methods."""

from __future__ import annotations

from pathlib import Path

import torch

from pwctl.errors import PwctlError
from pwctl.pack import Pack
from pwctl.policy import Policy
from pwctl.runtime.allocator import WidthAllocator
from pwctl.runtime.loader import load_model
from pwctl.runtime.moe import MoETap


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
        self.model, self.store = load_model(pack, device, dtype)
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
