"""Budgeted policies -> per-block widths: `static:BUDGET` (offline sensitivity only, planned
once: MxMoE's objective without its kernel-time term, which needs the fused kernel),
`pagedweight:BUDGET` with its ablations (the planner fed live router counts and the prompt
residual, re-planned after every step from the tokens already seen), and `dynamic-layer:BUDGET`
(DP-LLM-like: one width per layer, re-chosen every step from a linear estimate of the layer's
error from its input norm, fitted on the profile's per-sequence damage)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pwctl.errors import PwctlError
from pwctl.format.pack import Pack
from pwctl.format.profile import Profile
from pwctl.format.residual import RESIDUAL_JSON, ResidualModel
from pwctl.policy import Kind, Policy
from pwctl.runtime.moe.block import MoETap
from pwctl.runtime.transfer import HostCopies
from pwctl.runtime.widths.planner import Plan, Planner, PlannerConfig
from pwctl.text import norm_features

STATIC = PlannerConfig(use_router_stats=False, use_residual=False, dynamic_paging=False)


class WidthAllocator:
    def __init__(
        self,
        pack: Pack,
        policy: Policy,
        cost_at: np.ndarray | None = None,
        max_bits: int | None = None,
    ):
        """`cost_at` [n_blocks, pack max_bits + 1]: device bytes of each block per width (the
        paged backend's whole slabs, PageTable.cost_at); default: the planes' exact bytes.
        `max_bits`: the widest width any plan gives (default: the pack's)."""
        if policy.budget is None:
            raise PwctlError(f"policy {policy} has no budget")
        m = pack.manifest
        self.pack = pack
        self.layers = m.moe_layers
        self.profile = Profile.load(pack)
        self.residual = ResidualModel.load(pack) if (pack.path / RESIDUAL_JSON).is_file() else None
        if self.residual is not None and not self.residual.usable:
            self.residual = None  # a model that does not predict held-out sequences adds noise
        top = m.max_bits if max_bits is None else max_bits
        self.widest = top  # no plan gives a block more bits
        widths = range(m.min_bits, top + 1)
        if cost_at is None:
            cost = np.array([[b.bytes_at(w) for w in widths] for b in pack.blocks], np.int64)
        else:
            cost = np.asarray(cost_at, dtype=np.int64)[:, m.min_bits : top + 1]
        # the planner's curves stop at the cap: its widest width is `top`, damage taken from there
        damage = self.profile.damage[:, : top - m.min_bits + 1]
        # one rank's share of the pack holds no bytes of the other ranks' blocks
        # (runtime/parallel/rank_pack.py): the planner plans the blocks held here only
        self.n_blocks, self._held = len(pack.blocks), np.flatnonzero(pack.held)
        blocks = [pack.blocks[i] for i in self._held]
        cost, damage = cost[self._held], damage[self._held]
        self.budget = policy.budget.resolve(sum(b.fp16_bytes for b in blocks))
        if self.budget < cost[:, 0].sum():
            raise PwctlError(
                f"policy {policy}: {self.budget / 1e6:.2f} MB is below the "
                f"{cost[:, 0].sum() / 1e6:.2f} MB every block needs at "
                f"{m.min_bits} bits"
            )
        # planes never take more than every block at the widest width: BUDGET past that (a
        # fraction near 1, or a cap) would hold memory back from the KV cache for nothing
        self.budget = min(self.budget, int(cost[:, -1].sum()))
        self.narrowest = int(cost[:, 0].sum())  # every block at the narrowest width
        block_layer = np.array([self.layers.index(b.layer) for b in blocks])
        self._block_layer = block_layer
        self.per_layer = policy.kind is Kind.PER_LAYER
        self.last: Plan | None = None
        if self.per_layer:  # the planner's "blocks" are whole layers: one width each
            n_layers = len(self.layers)
            cost = np.stack([cost[block_layer == li].sum(0) for li in range(n_layers)])
            damage = np.stack([damage[block_layer == li].sum(0) for li in range(n_layers)])
            every_layer = np.array([self.layers.index(b.layer) for b in pack.blocks])
            self._norm_fit = _norm_estimator(self.profile, every_layer)
            self.planner = Planner(
                cost,
                damage,
                m.min_bits,
                np.arange(n_layers),
                np.zeros(n_layers, int),
                np.zeros(n_layers, bool),
                PlannerConfig(use_router_stats=False),
            )
            return
        config = STATIC if policy.kind is Kind.STATIC else PlannerConfig.from_policy(policy)
        self.planner = Planner(
            cost,
            damage,
            m.min_bits,
            np.array([b.layer for b in blocks]),
            np.array([b.expert for b in blocks]),
            np.array([b.shared for b in blocks]),
            config,
        )
        self.planner.set_prior(self.profile.router_share)

    @property
    def dynamic(self) -> bool:
        """Whether this policy may use plane memory the KV cache leaves free (static ones keep
        to BUDGET whatever the pressure)."""
        return self.planner.cfg.dynamic_paging

    def widths(self, headroom: float = 0.0) -> np.ndarray:
        """Widths for the next step: a full re-plan from the latest signals at BUDGET, plus
        `headroom` x BUDGET for dynamic policies when the KV cache is below its peak (BUDGET
        is the plane memory at peak pressure); static policies plan once and are frozen."""
        extra = headroom if self.dynamic else 0.0
        self.last = self.planner.plan(int(self.budget * (1 + extra)))
        return self._widths()

    @property
    def relaxed(self) -> bool:
        return self.planner.relaxed

    @property
    def floor_bytes(self) -> int:
        """The fewest plane bytes a plan may take now: BUDGET, or the narrowest widths while
        relaxed."""
        return self.narrowest if self.relaxed else self.budget

    def fit(self, plane_bytes: int) -> np.ndarray:
        """Widths for the serving engine's memory budget: free the excess over `plane_bytes`
        (never below the floor bytes, nor below the planner's floors), or promote into the
        spare bytes with the planner's hysteresis; static policies keep their first plan."""
        self.last = self.planner.fit(max(int(plane_bytes), self.floor_bytes))
        return self._widths()

    def squeeze(self, plane_bytes: int) -> np.ndarray:
        """`fit` with BUDGET and the hot and shared floors given way (down to the narrowest
        widths): what the engine does before it would preempt or cut a request short."""
        self.planner.relax(True)
        return self.fit(plane_bytes)

    def unsqueeze(self, spare_bytes: int) -> None:
        """Floors and BUDGET back once `spare_bytes` of plane memory would hold BUDGET."""
        if self.relaxed and spare_bytes >= self.budget:
            self.planner.relax(False)

    def replan(self, plane_bytes: int) -> np.ndarray:
        """A full re-plan at `plane_bytes` (the serving engine's start); below BUDGET the
        floors give way (`squeeze`), never below the narrowest widths."""
        self.planner.relax(int(plane_bytes) < self.budget)
        self.last = self.planner.plan(max(int(plane_bytes), self.floor_bytes))
        return self._widths()

    def adopt(self, widths: np.ndarray) -> None:
        """The planner takes `widths` (per block) as its current ones (a plan not taken)."""
        widths = np.asarray(widths)[self._held]
        if self.per_layer:  # one width a layer: its blocks share it
            first = np.unique(self._block_layer, return_index=True)[1]
            widths = widths[first]
        self.planner.adopt(widths)

    def _widths(self) -> np.ndarray:
        """The last plan's widths per block (a per-layer plan is spread to its blocks)."""
        assert self.last is not None  # a plan is made before its widths are read
        planned = self.last.widths
        out = np.full(self.n_blocks, self.widest, dtype=planned.dtype)  # unheld: no bytes at any
        out[self._held] = planned[self._block_layer] if self.per_layer else planned
        return out

    def observe(self, tap: MoETap) -> None:
        """Feed the planner the signals of the forward `tap` just recorded."""
        self.feed(self.signals(tap))

    @property
    def reads_inputs(self) -> bool:
        """Whether `signals` reads the blocks' inputs (their norm features): a per-layer policy,
        or a fitted residual; otherwise the routing alone."""
        return self.per_layer or self.residual is not None

    def signals(self, tap: MoETap) -> StepSignals:
        """The planner's signals of the forward `tap` just recorded, on their way to the host:
        each in one copy for every layer (not a copy a layer: on CUDA each would be a sync),
        queued behind the forward, so nothing waits here."""
        seen = [tap.seen[layer] for layer in self.layers]
        tokens = seen[0][0].shape[0]
        feats = index = None
        # the std of one token's norm is undefined: a one-token step keeps the last residual
        if self.per_layer or (self.residual is not None and tokens > 1):
            feats = norm_features(torch.stack([x for x, _, _ in seen]))
        if not self.per_layer:
            index = torch.stack([i.flatten() for _, i, _ in seen])
        return StepSignals.queue(index, feats)

    def feed(self, signals: StepSignals) -> None:
        """Router counts and the residual of one step's tokens to the planner (waits for their
        copies, if they are still running)."""
        index, feats = signals.host()
        if self.per_layer:
            assert feats is not None  # a per-layer policy's signals: the norm features alone
            slope, intercept = self._norm_fit
            self.planner.set_residual(np.clip(slope * feats[:, 0] + intercept, 0.1, 10.0))
            return
        assert index is not None  # the others': the router's choices (and maybe features)
        if self.residual is not None and feats is not None:  # none: the planner's factor is 1
            factor = self.residual.layer_factors(self.layers, feats)
            self.planner.set_residual(factor[self._block_layer])
        self.planner.observe(router_counts(index, self.pack.manifest.spec["num_experts"]))
        self.planner.tick()


@dataclass
class StepSignals:
    """One step's signals for the planner (router expert ids [layers, tokens x k], norm features
    [layers, 3] or None), in host tensors that CUDA copies fill behind the step's kernels; `host`
    waits for them. The serving loop reads a step's signals during the next step, so the
    planner's host work runs while the GPU runs that step (runtime/engine/batcher.py)."""

    copies: HostCopies  # (index, feats)

    @classmethod
    def queue(cls, index: torch.Tensor | None, feats: torch.Tensor | None) -> StepSignals:
        return cls(HostCopies.queue(index, feats))

    def host(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        index, feats = (None if t is None else t.numpy() for t in self.copies.wait())
        return index, feats


def router_counts(index: np.ndarray, n_experts: int) -> np.ndarray:
    """Tokens routed to each expert [layers, n_experts] of expert ids [layers, tokens x k]."""
    layers = index.shape[0]
    flat = (index + n_experts * np.arange(layers)[:, None]).ravel()
    return np.bincount(flat, minlength=layers * n_experts).reshape(layers, -1).astype(float)


def _norm_estimator(profile: Profile, block_layer: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per layer, a line from a sequence's mean input norm to its damage relative to the
    average (DP-LLM's linear error estimator on ||x||), least squares over the profile's
    sequences; flat (factor 1) where the norms do not vary."""
    n_layers = profile.features.shape[0]
    slope, intercept = np.zeros(n_layers), np.ones(n_layers)
    for li in range(n_layers):
        seq = profile.damage_seq[block_layer == li][:, :-1].sum(axis=(0, 1))
        norm = profile.features[li, :, 0]
        if seq.mean() <= 0 or np.ptp(norm) == 0:
            continue
        slope[li], intercept[li] = np.polyfit(norm, seq / seq.mean(), 1)
    return slope, intercept
