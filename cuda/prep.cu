// The launches that prepare a call (`decode_prep`, `prefill_prep`): the (token, expert) pairs
// grouped by expert, x in fragment order (and its pieces for the popc kernels), the output zeroed,
// and for prefill the sm_90a prefill's token-tile plan.
#ifndef PWCTL_PREP_CU
#define PWCTL_PREP_CU
#include "pieces.cuh"

// Decode-time preparation of one layer call, in one launch (it replaced ~20 small torch kernels,
// then three more launches: decisions/004). Block 0 groups the (token, expert) pairs by expert:
// pairs placed stably (sorted by expert, then by pair), slots listing the active experts in
// increasing order, empty slots after. The other blocks write x (fp16 [T, H]) in fragment order
// (fp16 [T, wpad, 32], zero-padded: fused_moe.fragment_order) and zero the fp32 output the down
// kernels add into. Dynamic shared memory: `experts` ints a grouping warp (geometry.group_smem).
// Lane i's v plus the v of every lane below it.
__device__ __forceinline__ int warp_inclusive_sum(int v) {
    const int lane = threadIdx.x & 31;
    #pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const int below = __shfl_up_sync(0xffffffffu, v, d);
        if (lane >= d) v += below;
    }
    return v;
}

#define GROUP_WARPS (PREP_THREADS / 32)
template <int W>
__device__ void group_pairs(const i64* index, const float* weights, int pairs, int k, int experts,
                            int slots, int* token, float* weight, int* s_expert, int* s_lo, int* s_hi) {
    // W warps place a contiguous share of the pairs each: prefill's prep takes W = 8 from
    // GROUP_SPLIT pairs on (one warp placing 16384 pairs took 225 us at Qwen3-MoE's 2048 tokens);
    // decode's few pairs stay with warp 0 (W = 1; the split cost a one-token call 1.2-1.7 us).
    // first[w][e]: share w's count of expert e, then where its next pair goes (after every pair of
    // e in the shares before: a stable placement).
    extern __shared__ int first[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, part = W > 1 ? warp : 0;
    const unsigned all = 0xffffffffu, below = (1u << lane) - 1;
    const int share = (pairs + W - 1) / W, lo = min(pairs, part * share);
    const int hi = warp < W ? min(pairs, lo + share) : lo;  // warps from W on place none
    int* mine = first + part * experts;
    for (int e = threadIdx.x; e < W * experts; e += blockDim.x) first[e] = 0;
    __syncthreads();
    const int from = W > 1 ? lo + lane : threadIdx.x, step = W > 1 ? 32 : blockDim.x;
    for (int i = from; i < (W > 1 ? hi : pairs); i += step) atomicAdd(&mine[(int)index[i]], 1);
    __syncthreads();
    if (warp == 0) {  // counts -> first pairs (a scan 32 experts at a time), active -> slots
        int start = 0, n = 0;
        for (int e0 = 0; e0 < experts; e0 += 32) {
            const int e = e0 + lane;
            int c = 0;
            #pragma unroll
            for (int w = 0; w < W; ++w) c += e < experts ? first[w * experts + e] : 0;
            const int inc = warp_inclusive_sum(c);
            const unsigned active = __ballot_sync(all, c > 0);
            const int slot = n + __popc(active & below), at = start + inc - c;
            #pragma unroll
            for (int w = 0, next = at; w < W; ++w) {
                if (e >= experts) break;
                const int v = first[w * experts + e];
                first[w * experts + e] = next;
                next += v;
            }
            if (c > 0 && slot < slots) {
                s_expert[slot] = e;
                s_lo[slot] = at;
                s_hi[slot] = at + c;
            }
            start += __shfl_sync(all, inc, 31);
            n += __popc(active);
        }
        for (int r = n + lane; r < slots; r += 32) s_expert[r] = s_lo[r] = s_hi[r] = 0;
    }
    __syncthreads();
    // place the warp's pairs 32 at a time, in order: a lane's rank among the lanes of its expert
    // below it. A lane loads its next 8 pairs at once (the warp waits on memory once per 256).
    for (int i0 = lo; i0 < hi; i0 += 256) {
        int ev[8];
        float wv[8];
        #pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int i = i0 + 32 * u + lane;
            ev[u] = i < hi ? (int)index[i] : -1;
            wv[u] = i < hi ? weights[i] : 0.f;
        }
        #pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int i = i0 + 32 * u + lane, e = ev[u];
            const unsigned peers = __match_any_sync(all, e);
            const int before = __popc(peers & below);
            if (e >= 0) {
                token[mine[e] + before] = i / k;
                weight[mine[e] + before] = wv[u];
            }
            __syncwarp();
            if (e >= 0 && before == __popc(peers) - 1) mine[e] += __popc(peers);
            __syncwarp();
        }
    }
}

// group_pairs for at most 32 pairs, by one warp, without shared memory or barriers: a bitonic
// sort of the lanes' keys (expert, pair), so that an expert's pairs keep their order as
// group_pairs places them. A decode call of a few tokens has this few (one token: k pairs), and
// group_pairs' pass over every expert and its barriers were most of its prep (decisions/004).
//
#define GROUP_FEW 32
__device__ void group_few(const i64* index, const float* weights, int pairs, int k, int slots,
                          int* token, float* weight, int* s_expert, int* s_lo, int* s_hi) {
    const unsigned all = 0xffffffffu;
    const int lane = threadIdx.x & 31;
    const bool in = lane < pairs;
    const float w = in ? weights[lane] : 0.f;
    int key = in ? (int)index[lane] * 32 + lane : 0x7fffffff;  // past the pairs: last
    for (int size = 2; size <= 32; size <<= 1)
        for (int j = size >> 1; j > 0; j >>= 1) {
            const int other = __shfl_xor_sync(all, key, j);
            key = ((lane & j) == 0) == ((lane & size) == 0) ? min(key, other) : max(key, other);
        }
    const int e = key >> 5, p = key & 31;  // lane: the sorted position of pair p
    const int before = __shfl_up_sync(all, e, 1);
    const unsigned firsts = __ballot_sync(all, in && (lane == 0 || e != before));
    const float wp = __shfl_sync(all, w, p);
    if (in) token[lane] = p / k, weight[lane] = wp;
    const unsigned upto = (2u << lane) - 1;  // lanes 0..lane (all of them for lane 31)
    if ((firsts >> lane) & 1) {
        const int slot = __popc(firsts & upto) - 1;
        const unsigned after = firsts & ~upto;
        if (slot < slots) {
            s_expert[slot] = e;
            s_lo[slot] = lane;
            s_hi[slot] = after ? __ffs(after) - 1 : pairs;
        }
    }
    for (int r = __popc(firsts) + lane; r < slots; r += 32) s_expert[r] = s_lo[r] = s_hi[r] = 0;
}

// The decode preps' grouping (every thread of the block calls it): one warp's sort up to
// GROUP_FEW pairs, group_pairs past that.
__device__ void group_decode(const i64* index, const float* weights, int pairs, int k, int experts,
                             int slots, int* token, float* weight, int* s_expert, int* s_lo,
                             int* s_hi) {
    if (pairs > GROUP_FEW)
        group_pairs<1>(index, weights, pairs, k, experts, slots, token, weight, s_expert, s_lo, s_hi);
    else if (threadIdx.x < 32)
        group_few(index, weights, pairs, k, slots, token, weight, s_expert, s_lo, s_hi);
}

// Threads first, first + stride, ...: x in fragment order (zero-padded), the output zeroed. A
// thread issues LOADS loads before their stores (xf might alias x for all the compiler knows, so
// with one at a time each load waits for the store before it): decode_prep takes 8 (2.6 -> 2.1 us
// at one token), route_prep 1 (8 cost it 0.1-1.3 us; decisions/009).
template <int LOADS>
__device__ void lay_out_x(const unsigned short* x, int T, int H, int wpad, unsigned short* xf,
                          float* out, int out_n, int first, int stride) {
    const int n_xf = T * wpad * 32;
    for (int i0 = first; i0 < n_xf; i0 += LOADS * stride) {
        unsigned short v[LOADS];
        #pragma unroll
        for (int u = 0; u < LOADS; ++u) {
            const int i = i0 + u * stride;
            v[u] = 0;
            if (i >= n_xf) break;
            // [n][w][4 s + j] holds column 32 w + s / 2 + 16 (s % 2) + 4 j
            const int n = i / (wpad * 32), w = i / 32 % wpad, s = i % 32 / 4;
            const int col = 32 * w + s / 2 + 16 * (s % 2) + 4 * (i % 4);
            if (col < H) v[u] = __ldg(x + (i64)n * H + col);
        }
        #pragma unroll
        for (int u = 0; u < LOADS; ++u)
            if (i0 + u * stride < n_xf) xf[i0 + u * stride] = v[u];
    }
    for (int i = first; i < out_n; i += stride) out[i] = 0.f;
}

#if WANT(decode_prep)
extern "C" __global__ void decode_prep(const i64* index, const float* weights, int pairs, int k,
                                       int experts, int slots, int* token, float* weight,
                                       int* s_expert, int* s_lo, int* s_hi,
                                       const unsigned short* x, int T, int H, int wpad,
                                       unsigned short* xf, float* out, int out_n, int words,
                                       PopcX* px, int px_blocks) {
    STAMP(2, 0);
    start_next();  // gate_up's CTAs may launch; they wait for this grid to finish
    const int blocks = gridDim.x - px_blocks;  // the last px_blocks build x's pieces
    if ((int)blockIdx.x >= blocks) return x_piece(x, T, H, words, px, blockIdx.x - blocks);
    if (blockIdx.x == 0)
        return group_decode(index, weights, pairs, k, experts, slots, token, weight, s_expert, s_lo, s_hi);
    const int stride = (blocks - 1) * blockDim.x, first = (blockIdx.x - 1) * blockDim.x + threadIdx.x;
    lay_out_x<8>(x, T, H, wpad, xf, out, out_n, first, stride);
}
#endif

// The sm_90a prefill's token tiles (`fused_moe.tile_plan`): per tile (slot, pass), each slot's
// ceil(pairs / 128) tiles consecutive, then (-1, live tiles) up to `tiles` (a bound). One warp.
__device__ void plan_tiles(const int* s_lo, const int* s_hi, int slots, int* tile_info, int tiles) {
    const int lane = threadIdx.x & 31;
    int start = 0;
    for (int s0 = 0; s0 < slots; s0 += 32) {
        const int s = s0 + lane, n = s < slots ? (s_hi[s] - s_lo[s] + PF_TOKENS - 1) / PF_TOKENS : 0;
        const int inc = warp_inclusive_sum(n);
        for (int p = 0, t = start + inc - n; p < n; ++p, ++t)
            tile_info[2 * t] = s, tile_info[2 * t + 1] = p;
        start += __shfl_sync(0xffffffffu, inc, 31);
    }
    // dead tiles (a plan has at least one: the bound exceeds the live count) hold that count
    for (int t = start + lane; t < tiles; t += 32) tile_info[2 * t] = -1, tile_info[2 * t + 1] = start;
}

// What a prefill call needs before its kernels, in one launch (`fused_moe.prepare_prefill`; ~30
// small torch launches before, which left eager prefill host-bound: decisions/015).
// Block 0 groups the pairs (`group_pairs`), then its first warp plans the token tiles; the other
// blocks zero `out`.
#if WANT(prefill_prep)
extern "C" __global__ void prefill_prep(const i64* index, const float* weights, int pairs, int k,
                                        int experts, int slots, int* token, float* weight,
                                        int* s_expert, int* s_lo, int* s_hi, int* tile_info,
                                        int tiles, float* out, i64 out_n) {
    if (blockIdx.x > 0) {
        const i64 stride = (i64)(gridDim.x - 1) * blockDim.x;
        for (i64 i = (i64)(blockIdx.x - 1) * blockDim.x + threadIdx.x; i < out_n; i += stride)
            out[i] = 0.f;
        return;
    }
    if (pairs >= GROUP_SPLIT)
        group_pairs<GROUP_WARPS>(index, weights, pairs, k, experts, slots, token, weight, s_expert,
                                 s_lo, s_hi);
    else
        group_pairs<1>(index, weights, pairs, k, experts, slots, token, weight, s_expert, s_lo, s_hi);
    if (threadIdx.x >= 32) return;  // warp 0 wrote the slots (before group_pairs' last barrier)
    __syncwarp();
    plan_tiles(s_lo, s_hi, slots, tile_info, tiles);
}
#endif
#endif  // PWCTL_PREP_CU
