"""Which decode kernels a fused MoE call launches, as data: `DispatchRules` holds the thresholds
(measured on the H200, docs/decisions/022-popc-by-layer-size.md and 034-wide-block-rule.md) and
the forced choices A/B runs set; its methods apply them to a layer's widths (`WidthSpan`). A
`FusedMoE` takes one (default: `DispatchRules()`); benchmarks and tests pass their own instead of
writing module globals.

Builds: "n<tiles>" the lookup kernels, "p1" / "p1b3" / "p1b5" the one-token popc kernels (binary
tensor cores up to 4 / 3 / 5 bits), "pn" / "pnb3" the popc kernels of a few tokens, "n1p1" the
split build (the lookup gate_up, the popc down)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from pwctl.kernels import geometry


class WidthSpan(NamedTuple):
    """A layer's blocks at the widths the kernels read: what the launcher's rule looks at."""

    narrowest: int
    widest: int
    wide: float  # the share of the layer's weights in blocks wider than geometry.POPC_MAX_BITS
    wider: float  # the share in blocks wider than 5 bits (past p1b5's binary mma)
    gate_up_wide: float  # the same two shares of its gate and up weights alone: where the
    gate_up_wider: float  # one-token builds p1 and n1p1 differ on a large layer (the same down)


# the one-token popc builds (their gate_up on a persistent grid) and the widest block each one's
# binary mma reads
ONE_TOKEN_BITS = {"p1": 4, "p1b3": 3, "p1b5": 5}
_SPLIT_BUILDS = {"n1p1": ("n1", "p1")}


def builds(kind: str) -> tuple[str, str]:
    """(gate_up's build, down's build) of a decode kind."""
    return _SPLIT_BUILDS.get(kind, (kind, kind))


def is_popc(build: str) -> bool:
    """Whether a build is one of the popc kernels' (x's or h's pieces on the binary mma)."""
    return build.startswith("p")


def past_mma(kind: str, span: WidthSpan) -> bool:
    """Whether some block of the layer is wider than the binary mma of a one-token gate_up of
    `kind` reads (those tiles take its lookup)."""
    gate_up = builds(kind)[0]
    return gate_up in ONE_TOKEN_BITS and span.widest > ONE_TOKEN_BITS[gate_up]


@dataclass(frozen=True)
class DispatchRules:
    """The popc kernels save ~15% of a one-token slot's streaming and cost more a call (x's
    pieces in the prep launch, popc_planes for h). On the H200 one-token calls win on Mixtral and
    Qwen1.5-MoE (once popc_planes let down launch early: routed, Qwen1.5-MoE 42.5 -> 38.9 us at 3
    bits), not on the smaller layers (`p1_min_weights`); calls of 2..POPC_MAX_TOKENS tokens win on
    Mixtral (~352M expert weights a token; 1.14-1.23x) and lose on Qwen1.5-MoE (69M) and Qwen3-MoE
    (38M; 2 tokens, routed: 44.3 against 52.2 us at 3 bits). So one token takes them from
    `p1_min_weights` a token, a few tokens from `popc_min_weights`, while their blocks are narrow
    enough (`popc_kind`).

    One token takes the popc kernels on a layer reading at least `p1_min_weights` a token, and
    the lookup kernels below it: on Qwen3-MoE (37.7M) and an OLMoE layer (50.3M: 64 experts, top
    8, 1024 x 2048) the lookup kernels were up to 12% faster than `p1` at 2-4 bits (both shapes at
    2 bits 11-12%, OLMoE at 4 bits 5%) and at most 1.6% slower, and 2-15% faster with wide blocks;
    on Qwen1.5-MoE (69.2M with its shared expert) and Mixtral `p1` leads by 7-35% at 2-4 bits.

    With blocks past 4 bits (`wide_kind`; every build timed on the same draws, `p1` on one CTA a
    gate_up tile, `gate_up_runs`; docs/decisions/034-wide-block-rule.md):
    - A large layer (`popc_min_weights`, Mixtral) takes `p1b5` from `p1b5_from_wide` of its
      weights past 4 bits while under `p1b5_until_wider` are past 5 (every wide block at 5 bits:
      p1 led to 0.42, p1b5 from 0.5, 173.6 against 177.0 us; half the blocks at 5 and one or two
      of 24 at 6 or 8: p1b5 3-11% ahead; four at 6: p1 172.1, p1b5 182.7). Else the split build
      (n1p1: the lookup gate_up, the popc down) from `p1_until_gate_up_wide` of its gate and up
      weights past 4 bits or `p1_until_gate_up_wider` past 5, else `p1`. Only gate and up count:
      both builds run the same down, and `p1` reads a wide gate or up (and the narrow one beside
      it) by a lookup on 4 CTAs an SM where `gate_up_n1` runs more (every gate at 5 bits: the
      split 141.7 against 147.5 us; every down at 6 bits: `p1` 149.5, the split 176.9).
    - A layer between them (Qwen1.5-MoE) takes `p1` while under `mid_p1_until_wide` of its
      weights are past 4 bits (5-8 bits on 2-8% of the blocks: 1-10% faster than the split), else
      the split build (1-11% faster than the lookup kernels in 15 of 19 cells, within 1.2% of them
      in the rest); p1b5 was 12-45% slower than the others in every cell. Its downs count too:
      past 4 bits they cost `p1` more than the split (every down at 8 bits: 68.6 against 63.9 us).
    A call of 2..POPC_MAX_TOKENS tokens takes the popc kernels below `pn_until_wide` past 4 bits
    and the lookup ones from it on (their slots on wide blocks run a lookup slower than the
    lookup kernels': 8 tokens, three quarters of the blocks at 8 bits, 1032 against 977)."""

    popc_min_weights: int = 128 << 20
    p1_min_weights: int = 56 << 20
    p1b5_from_wide: float = 0.45
    p1b5_until_wider: float = 0.12
    p1_until_gate_up_wide: float = 0.5
    p1_until_gate_up_wider: float = 0.3
    mid_p1_until_wide: float = 0.1
    pn_until_wide: float = 0.5
    # decode calls of up to POPC_MAX_TOKENS tokens on the popc kernels where a block is narrow
    # enough: True, False (the lookup kernels only), or None: by the rules above
    # (tools/kernel-dev/perf_kernel_ab.py's `popc=`)
    popc_decode: bool | None = None
    # One-token calls on a large layer may take the 5-bit build (`p1b5`: 5-bit blocks on the
    # binary mma too, not the lookup) where its rule says; off, they do not (perf_kernel_ab's
    # `b5=0`).
    popc_b5: bool = True
    # One token on a layer of p1_min_weights the rule sends off the popc builds (blocks past 4
    # bits): gate_up on the lookup, down on the popc build after popc_planes ("n1p1"), whose down
    # reads its narrow blocks on the binary mma and its wide ones on a lookup of its own, faster
    # than down_n1's (Mixtral: 1.6-8% off the lookup kernels in 7 of 10 cells, 1-3% slower on two
    # budget mixes), also where no block is narrow enough for its mma (every block at 5-8 bits or
    # the planner's mixes past budget 0.55: Qwen1.5-MoE 9-11% faster, Mixtral 0-5%); off, down on
    # the lookup too.
    popc_down: bool = True
    # a decode kind every call takes (A/B sweeps over builds, e.g. "n1p1"; it must suit the
    # call's token count and popc_decode), or None: `decode_kind`'s rule
    decode_kind: str | None = None
    # one-token gate_up's persistent CTAs: None, by geometry.gate_up_runs, but one CTA a tile
    # where a block is wider than the build's binary mma (`past_mma`: on Mixtral one CTA a tile
    # was 3-13% faster than the wave in 16 of 16 cells of 5-8-bit blocks; at 4 bits the wave is
    # 4% faster); a count, that many CTAs in equal shares (0: one a tile)
    gate_up_runs: int | None = None
    # CTAs sharing a down tile's columns: None, by geometry.k_split; a count, that one
    down_split: int | None = None
    # The sm_90a prefill's down on a wave of CTAs that split the last units' columns
    # (cuda/prefill_wg.cu down_span) where its rows are at least this many chunks of 8 plane words
    # long: Mixtral (56) gained 2-6% at 512 tokens; Qwen1.5-MoE's shared expert (22) gained
    # nothing measurable, and short rows lose (docs/decisions/017-prefill-down-stream-k.md).
    down_stream_k_chunks: int = 32
    # None: by down_stream_k_chunks; True / False (perf_kernel_ab's @sk=)
    down_stream_k: bool | None = None
    # geometry.down_groups' one-wave plan for the popc kernels' down beside a shared expert (False:
    # the routed split and the shared expert's balanced one as they come; perf_kernel_ab's
    # @dwave=0)
    down_one_wave: bool = True

    def __post_init__(self) -> None:
        if self.gate_up_runs is not None and self.gate_up_runs < 0:
            raise ValueError(f"gate_up_runs {self.gate_up_runs}: a count of CTAs, >= 0")
        if self.down_split is not None and self.down_split < 1:
            raise ValueError(f"down_split {self.down_split}: at least one CTA a tile")

    def decode_kernels(self, T: int, span: WidthSpan, weights: int, pieces: bool) -> str:
        """The decode kernels of a call of T tokens on a layer of `weights` expert weights a
        token: the popc kernels' build when x's pieces are made (`pieces`: `popc_kind` chose
        one), else the lookup kernels of T's n-tiles, but for one token on a layer of at least
        p1_min_weights (`popc_down`): the lookup gate_up with the popc down ("n1p1"), even where
        no block is narrow enough for that down's binary mma (its lookup of wide blocks beats
        down_n1's; docs/decisions/034-wide-block-rule.md)."""
        if self.decode_kind is not None:
            return self.decode_kind
        popc_kind = self.popc_kind(T, span, weights) if pieces else None
        if popc_kind:
            return popc_kind
        if T == 1 and self.popc_down and self.popc_decode is None and self.p1_pays(weights):
            return "n1p1"
        return f"n{geometry.n_tiles(T)}"

    def popc_kind(self, T: int, span: WidthSpan, weights: int) -> str | None:
        """The popc kernels' build for a call of T tokens, or None for the lookup kernels. Up to
        POPC_MAX_TOKENS tokens when popc_decode is set or (None) on a layer large enough: one
        token from p1_min_weights, a few from popc_min_weights. "p1" for one token, "pn" for more
        (their slots of several tokens take the lookup inside the launch; kept apart so that the
        one-token build carries none of it), "b3" (binary mma up to 3 bits; 6 CTAs an SM for one
        token, 5 for several, against 4) when no block is wider than 3 bits in the widths the
        kernels read (the last `DeviceTable.sync`), None when none is as narrow as the build's
        mma reads. With blocks wider than 4 bits, by default (popc_decode None): one token by
        `wide_kind`; a few tokens take the lookup kernels from pn_until_wide of the weights on.
        popc_decode True: p1b5 (p1 with popc_b5 off) or pn while any block is narrow enough.
        Every build reads every width (wider blocks take its lookup), so a graph captured before
        the pager widens a block stays correct, only slower."""
        auto = self.popc_decode is None
        pays = self.p1_pays(weights) if T == 1 else self.popc_pays(weights)
        if T > geometry.POPC_MAX_TOKENS or not (pays if auto else self.popc_decode):
            return None
        b3 = "b3" if span.widest <= 3 else ""
        if T > 1:
            if span.narrowest > geometry.POPC_MAX_BITS or (
                auto and span.wide >= self.pn_until_wide
            ):
                return None
            return "pn" + b3
        if span.widest <= geometry.POPC_MAX_BITS:
            return "p1" + b3
        if auto:
            return self.wide_kind(span, weights)
        if self.popc_b5 and span.narrowest <= 5:
            return "p1b5"
        return "p1" if span.narrowest <= geometry.POPC_MAX_BITS else None

    def wide_kind(self, span: WidthSpan, weights: int) -> str | None:
        """The default popc build of one token on a layer of p1_min_weights with a block past 4
        bits, or None for the split build (the lookup gate_up, the popc down). On a large layer
        (popc_min_weights): "p1b5" from p1b5_from_wide of its weights past 4 bits while under
        p1b5_until_wider are past 5; else "p1" while under p1_until_gate_up_wide of its gate and
        up weights are past 4 bits and under p1_until_gate_up_wider past 5. On a smaller one,
        "p1" while under mid_p1_until_wide of its weights are past 4 bits."""
        if not self.popc_pays(weights):
            return "p1" if span.wide < self.mid_p1_until_wide else None
        if self.popc_b5 and span.wide >= self.p1b5_from_wide and span.wider < self.p1b5_until_wider:
            return "p1b5"  # (a share past 5 bits under 1: a block of at most 5)
        split = (
            span.gate_up_wide >= self.p1_until_gate_up_wide
            or span.gate_up_wider >= self.p1_until_gate_up_wider
        )
        return None if split else "p1"  # (no block at 4 bits or less: every share is 1, split)

    def p1_pays(self, weights: int) -> bool:
        """Whether one token takes the popc kernels on a layer of `weights` a token (auto)."""
        return weights >= self.p1_min_weights

    def popc_pays(self, weights: int) -> bool:
        """Whether a few tokens take the popc kernels on a layer of `weights` a token (auto)."""
        return weights >= self.popc_min_weights

    def stream_k(self, chunks: int) -> bool:
        """Whether the sm_90a prefill down runs a stream-K wave on rows of `chunks` chunks."""
        return (
            chunks >= self.down_stream_k_chunks
            if self.down_stream_k is None
            else self.down_stream_k
        )
