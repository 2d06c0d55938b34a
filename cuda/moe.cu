// The fused mixed-precision MoE kernels (docs/KERNELS.md). Compiled by CuPy (NVRTC) at first use.
// ("decisions/NNN" below: docs/decisions/NNN-*.md, the record with the figure behind a choice.)
// Every expert block is read at its current width straight from its planes, wherever the pager
// put them: a block's plane p is a chunk [bits | table] split over fixed-size slabs of one device
// arena, and the descriptor (per-block width, per-plane first slab-map entry, slab map) lives in
// device memory, rewritten by the pager between steps. Kernels never see host-side widths, so a
// width change costs no recompile, no reallocation and no host sync.
//
// Activations are read in "fragment order" (fused_moe.fragment_order): fp16 [rows, wpad, 32], where
// element [n][w][4s + i] is column 32w + (s >> 1) + 16(s & 1) + 4i, so that one 16-byte load is a
// lane's B fragment for two mma k-steps (see `mma_rows`). wpad: words rounded up to 8.

// Parts: kernels.py builds this source once a part (kernels.PARTS: -DPWCTL_PART=k, and
// -DPWCTL_WANT_<kernel>=1 for each of the part's kernels), all side by side: NVRTC's time is
// nearly all each kernel's own optimizer work, so parts build in parallel where one source would
// take one core for minutes (docs/KERNELS.md). Without PWCTL_PART (nvcc builds, probes) the
// source holds every kernel. (An undefined PWCTL_WANT_<kernel> reads 0 in #if.)
#ifdef PWCTL_PART
#define WANT(kernel) PWCTL_WANT_##kernel
#else
#define WANT(kernel) 1
#endif

// No headers: NVRTC finds none of its own, and fp32 -> fp16 is one PTX instruction.
__device__ __forceinline__ unsigned short f2h(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

typedef unsigned int u32;
typedef long long i64;

__device__ __forceinline__ float h2f(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// PRMT, as PTX defines it: byte i of the result is byte (s >> 4i) & 7 of {b, a} (bit 3 of a
// nibble would replicate a sign; every selector here keeps it clear). Not `__byte_perm`: CUDA
// documents that one as ignoring bit 3, so the compiler masks each run-time selector first.
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 s) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(s));
    return d;
}

__device__ __forceinline__ u32 smem_u32(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// The line holding p into L2 (a hint: nothing waits for it).
__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// A 4-byte word from global to shared memory by cp.async (`tables_landed` waits for them).
__device__ __forceinline__ void copy_word_async(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem_u32(dst)), "l"(src)
                 : "memory");
}

// Programmatic dependent launch (kernels.launch(early=True), Hopper on). `wait_previous`: block
// until the previous kernel on the stream has finished and its writes are visible; `start_next`:
// let the next kernel's CTAs launch now (they wait in their own `wait_previous`). Both are no-ops
// for a plain launch and compile to nothing before sm_90.
__device__ __forceinline__ void wait_previous() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void start_next() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Timing probe, never built by pwctl (tools/kernel-dev/stamp_phases.py: -DPWCTL_STAMPS builds):
// thread 0 of every CTA writes the global timer and its SM's clock at each phase of its kernel
// (kind: 0 gate_up, 1 down, 2 the prep launch, 3 popc_planes; the sm_90a prefill kernels take
// kinds 0 and 1 too, with phases of their own), and its SM.
#define STAMP_CTAS 16384
#ifdef PWCTL_STAMPS
__device__ unsigned long long pwctl_stamps[4][STAMP_CTAS][16];  // [kind][cta][timer 0-7, clock 8-15]
__device__ unsigned pwctl_smid[4][STAMP_CTAS];
__device__ __forceinline__ void stamp(int kind, int phase) {
    const unsigned cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    if (threadIdx.x != 0 || cta >= STAMP_CTAS) return;
    unsigned long long t;
    unsigned sm;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    pwctl_stamps[kind][cta][phase] = t;
    pwctl_stamps[kind][cta][8 + phase] = clock64();
    pwctl_smid[kind][cta] = sm;
}
#define STAMP(kind, phase) stamp(kind, phase)
#define STAMP_KIND(job, k) (job).kind = (k)
#else
#undef PWCTL_STAMPS_CHAIN
#define STAMP(kind, phase)
#define STAMP_KIND(job, k)
#endif
// Probe (-DPWCTL_STAMPS -DPWCTL_STAMPS_CHAIN; `stamp_phases.py ... chain`): the popc gate_up's
// staging chain, each stamp once the value it names has arrived (a branch on it).
#ifdef PWCTL_STAMPS_CHAIN
#define STAMP_AFTER(kind, phase, v) \
    if ((int)(v) != (int)0x80000001) STAMP(kind, phase)
#else
#define STAMP_AFTER(kind, phase, v)
#endif

struct Paged {
    const unsigned char* arena;  // [n_slabs, 1 << slab_shift]
    const int* slab_map;         // slab id of every (block, plane, page)
    const int* slab_off;         // [n_blocks, max_bits]: first slab-map entry of each plane
    const int* width;            // [n_blocks]: planes a kernel may read
    int slab_shift;
    int max_bits;
};

// Byte `off` of the plane whose first slab-map entry is `first`.
__device__ __forceinline__ const unsigned char* paged_at(const Paged& g, int first, i64 off) {
    const i64 slab = __ldg(g.slab_map + first + (int)(off >> g.slab_shift));
    return g.arena + (slab << g.slab_shift) + (off & ((1LL << g.slab_shift) - 1));
}

// `paged_at` of the plane's first entry (`plane_entry`), kept in its own form: written as that
// call, ptxas reorders the staging of the prefill kernels and of the one-token gate_up (cubin_diff,
// decisions/028), which were measured as they are.
__device__ __forceinline__ const unsigned char* paged(const Paged& g, int block, int plane, i64 off) {
    int entry = __ldg(g.slab_off + block * g.max_bits + plane) + (int)(off >> g.slab_shift);
    i64 slab = __ldg(g.slab_map + entry);
    return g.arena + (slab << g.slab_shift) + (off & ((1LL << g.slab_shift) - 1));
}

// A plane is stored tiled (docs/FORMAT.md, pwctl/format/bitplanes.py `tile`): 16-byte units of 4 words,
// [rows / 8][words / 4][8 rows][4 words]. So a warp that loads one unit of each of 8 rows from 4
// adjacent units reads 512 contiguous bytes; row-major, the same load was 8 pieces of 64 bytes,
// and a Mixtral decode layer took 3-7.5% longer (decisions/025). Every load of plane
// words is of one unit or part of one (w % 4 == 0 for 16 bytes, w even for 8).
// tiled(w): word w of a row, counted in words from its unit 0.
__host__ __device__ __forceinline__ constexpr int tiled(int w) { return (w & 3) + ((w >> 2) << 5); }

// Bytes from the start of a plane to unit 0 of `row`.
__device__ __forceinline__ i64 row_start(int row, int words) {
    return 4 * ((i64)(row >> 3) * 8 * words + (row & 7) * 4);
}

// Where one plane of one block row lies: its words [0, split) from p0, the rest from p1, word w
// at tiled(w) from either (a row's group crosses at most one slab boundary: slabs are at least as
// large as a group of rows of a plane, bitplanes.group_bytes).
struct RowPtr {
    const u32* p0;
    const u32* p1;  // set back by the bytes from unit 0 to the boundary, so word w is p1[tiled(w)]
    int split;
};

// (first: the plane's first slab-map entry)
__device__ __forceinline__ RowPtr row_ptr_at(const Paged& g, int first, int row, int words) {
    const i64 off = row_start(row, words);
    const i64 mask = (1LL << g.slab_shift) - 1, left = (mask + 1) - (off & mask);
    const int entry = first + (int)(off >> g.slab_shift);
    RowPtr rp;
    rp.p0 = (const u32*)(g.arena + ((i64)__ldg(g.slab_map + entry) << g.slab_shift) + (off & mask));
    rp.split = (int)min((i64)words, 4 * ((left + 127) >> 7));  // the row's units are 128 bytes apart
    rp.p1 = rp.split < words
        ? (const u32*)(g.arena + ((i64)__ldg(g.slab_map + entry + 1) << g.slab_shift) - left)
        : rp.p0;
    return rp;
}

__device__ __forceinline__ int plane_entry(const Paged& g, int block, int plane) {
    return __ldg(g.slab_off + block * g.max_bits + plane);
}

__device__ __forceinline__ RowPtr row_ptr(const Paged& g, int block, int plane, int row, int words) {
    return row_ptr_at(g, plane_entry(g, block, plane), row, words);
}

// Where word w of a row's plane lies, on whichever side of its page split.
__device__ __forceinline__ const u32* word_ptr(const RowPtr& rp, int w) {
    return (w < rp.split ? rp.p0 : rp.p1) + tiled(w);
}

__device__ __forceinline__ u32 word_at(const RowPtr& rp, int w) { return __ldg(word_ptr(rp, w)); }

// ---- decoding labels straight into tensor-core fragments ------------------------------------
//
// A CTA computes 16 rows of one block for up to 8*NT tokens of one slot with mma.m16n8k16 (fp16
// in, fp32 accumulate); its 4 warps split the columns and add their results in shared memory.
// Lane (g, t) = (lane / 4, lane % 4) holds rows g and g + 8 of the A fragment. The mma sums over
// any 16 columns as long as A and B agree, so each lane feeds the A fragment from its own plane
// words: per iteration it loads words w, w + 1 (w = 8 * it + 2t) of its two rows, and its k-step
// s of word w covers columns 32w + (s >> 1) + 16(s & 1) + {0, 4, 8, 12}. Activations are stored in
// that order ("fragment order", see `fragment_order` in fused_moe.py), so the B fragment of a
// step is one 8-byte piece and the two steps of one `c` are one 16-byte load.

// Nibble k (k = 0..7) of the result holds, in bit q (q < N), bit C + 4k of plane word P[TOP - q]:
// for a fixed column phase C, the labels of columns C, C + 4, ..., C + 28, one shift and one
// masked OR per plane (a plane word holds bit B-1-p of 32 consecutive columns' labels).
template <int C, int TOP, int N>
__device__ __forceinline__ u32 gather(const u32 (&P)[8]) {
    u32 s = 0;
    #pragma unroll
    for (int q = 0; q < N; ++q) {
        const u32 v = P[TOP - q];
        const int d = C - q;
        s |= (d >= 0 ? v >> d : v << -d) & (0x11111111u << q);
    }
    return s;
}

// Register tables for widths <= 4: L[0..1] the low bytes of entries 0..7, L[2..3] their high
// bytes, L[4..7] the same for entries 8..15. One PRMT looks up four 3-bit labels at once.
__device__ __forceinline__ void lut_from(const unsigned short* tbl, int B, u32 (&L)[8]) {
    u32 W[8];
    #pragma unroll
    for (int i = 0; i < 8; ++i) W[i] = 2 * i < (1 << B) ? *(const u32*)(tbl + 2 * i) : 0u;
    L[0] = prmt(W[0], W[1], 0x6420);
    L[1] = prmt(W[2], W[3], 0x6420);
    L[2] = prmt(W[0], W[1], 0x7531);
    L[3] = prmt(W[2], W[3], 0x7531);
    L[4] = prmt(W[4], W[5], 0x6420);
    L[5] = prmt(W[6], W[7], 0x6420);
    L[6] = prmt(W[4], W[5], 0x7531);
    L[7] = prmt(W[6], W[7], 0x7531);
}

// Four 3-bit labels (nibbles of s, bit 3 clear) -> two half2: (label 0, 1), (label 2, 3).
__device__ __forceinline__ void lut8(const u32 (&L)[8], u32 s, u32& h0, u32& h1) {
    const u32 lo = prmt(L[0], L[1], s), hi = prmt(L[2], L[3], s);
    h0 = prmt(lo, hi, 0x5140);
    h1 = prmt(lo, hi, 0x7362);
}

// Four 4-bit labels: low three bits in s (bit 3 clear), the top bit chooses the table half
// through q (nibble k = k + 4 * top bit).
__device__ __forceinline__ void lut16(const u32 (&L)[8], u32 s, u32 q, u32& h0, u32& h1) {
    const u32 lo = prmt(prmt(L[0], L[1], s), prmt(L[4], L[5], s), q);
    const u32 hi = prmt(prmt(L[2], L[3], s), prmt(L[6], L[7], s), q);
    h0 = prmt(lo, hi, 0x5140);
    h1 = prmt(lo, hi, 0x7362);
}

// Where row r's entries start in its shared-memory table (`Stage::tbl[r]`, 128 words), for the
// widths read from there (5-8). A 5-bit table takes 16 words, i.e. 16 of the 32 banks, the same
// 16 in every row: odd rows keep theirs 16 words on, so that the 8 rows one shared load meets use
// all 32 banks (Nsight Compute, Mixtral: 4.1 -> 3.0 wavefronts a load). Wider tables cover every
// bank already. Tried and not kept (decisions/033): a copy of each row a lane (one
// bank a lane, no conflicts) cost more integer work than it saved; labels as bytes (a PRMT an
// index, `decode`'s BYTES) were 0-9% faster at 6-8 bits but made the one-token lookup kernels
// spill, 4% slower on Qwen3-MoE at 4 bits: the prefill kernels take them, and the one-n-tile
// lookup at 5 bits (`mma_word`).
__host__ __device__ constexpr int table_shift(int B, int row) { return B == 5 ? (row & 1) << 5 : 0; }

// (tests/test_kernels.py replays gather / lut_from / lut8 / lut16 / decode / table_shift in Python
// on the CPU.)
// The A-fragment halves of column phase C of one row's plane words: A[0], A[1] for k-step 2C
// (columns C + {0, 4} and C + {8, 12}), A[2], A[3] for step 2C + 1 (the same plus 16). BYTES
// (widths 5-8; the prefill kernels): the labels turned into bytes, one PRMT a table index. tbl is
// `Stage::tbl` of row g or g + 8, g = lane / 4, as in every caller: `table_shift` takes g's parity.
template <int B, int C, bool BYTES = false>
__device__ __forceinline__ void decode(const u32 (&P)[8], const u32 (&L)[8],
                                       const unsigned short* tbl, u32 (&A)[4]) {
#ifdef PWCTL_LOAD_ONLY
    // Timing probe, never built by pwctl: the kernels' loads and mma with no lookup (wrong results).
    // nvcc -DPWCTL_LOAD_ONLY ... -cubin, then PWCTL_CUBIN=FILE pwctl bench --kernels (decisions/006).
    if constexpr (B <= 4) {
        const u32 v = (P[0] ^ P[1]) ^ (P[2] ^ P[3]) ^ L[C];
        A[0] = v, A[1] = v + 1u, A[2] = v + 2u, A[3] = v + 3u;
    } else
#endif
    if constexpr (B <= 3) {
        const u32 s = gather<C, B - 1, B>(P);
        lut8(L, s, A[0], A[1]);
        lut8(L, s >> 16, A[2], A[3]);
    } else if constexpr (B == 4) {
        // low three bits from planes 3..1; the top bit (plane 0) goes straight to bit 2 of the
        // half-choosing selector q (nibble k = k + 4 * top bit)
        const u32 m = gather<C, 3, 3>(P);
        const u32 q = ((C >= 2 ? P[0] >> (C - 2) : P[0] << (2 - C)) & 0x44444444u) | 0x32103210u;
        lut16(L, m, q, A[0], A[1]);
        lut16(L, m >> 16, q >> 16, A[2], A[3]);
    } else {  // wider: shared-memory table, label = hi nibble (planes 0..B-5) : lo nibble
        const u32 lo = gather<C, B - 1, 4>(P), hi = gather<C, B - 5, B - 4>(P);
        tbl += table_shift(B, threadIdx.x >> 2);  // the parity of g: the same for row g + 8
        if constexpr (BYTES) {  // even labels k in ev, odd in od (byte j: labels 2j, 2j + 1)
            const u32 ev = (lo & 0x0F0F0F0Fu) | ((hi << 4) & 0xF0F0F0F0u);
            const u32 od = ((lo >> 4) & 0x0F0F0F0Fu) | (hi & 0xF0F0F0F0u);
            #pragma unroll
            for (int j = 0; j < 4; ++j)
                A[j] = prmt(tbl[prmt(ev, 0u, 0x4440u + j)], tbl[prmt(od, 0u, 0x4440u + j)], 0x5410u);
        } else {
            u32 v[8];
            #pragma unroll
            for (int k = 0; k < 8; ++k) v[k] = tbl[((lo >> (4 * k)) & 15u) | (((hi >> (4 * k)) & 15u) << 4)];
            #pragma unroll
            for (int j = 0; j < 4; ++j) A[j] = v[2 * j] | (v[2 * j + 1] << 16);
        }
    }
}

__device__ __forceinline__ void mma16816(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The A fragments (mma.m16n8k16 register order) of k-steps 2C and 2C + 1 of one plane word:
// rows g (P0) and g + 8 (P1), column phase C (see `decode`).
template <int B, int C, bool BYTES = false>
__device__ __forceinline__ void decode_frags(const u32 (&P0)[8], const u32 (&P1)[8],
                                             const u32 (&L0)[8], const u32 (&L1)[8],
                                             const unsigned short* tbl0, const unsigned short* tbl1,
                                             u32 (&a)[2][4]) {
    u32 A0[4], A1[4];
    decode<B, C, BYTES>(P0, L0, tbl0, A0);
    decode<B, C, BYTES>(P1, L1, tbl1, A1);
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        a[h][0] = A0[2 * h], a[h][1] = A1[2 * h];
        a[h][2] = A0[2 * h + 1], a[h][3] = A1[2 * h + 1];
    }
}

#define WARPS 4
#define ROWS 16
#define MAX_TABLE 256  // 2^max_bits, max_bits <= 8

// What a CTA prepares for one block before its warps stream it: per (row, plane) the pages of
// the row, per row its table at the block's width.
struct Stage {
    RowPtr ptr[ROWS * 8];
    unsigned short tbl[ROWS][MAX_TABLE];
};

// Where the table words of row r came from (`restage` moves them on): kept in the row's unused
// upper half, so only for widths up to 4 (16 entries of 256). A separate array (31.9 -> 33.9 KB a
// CTA) moved `p1b3`'s 6 CTAs an SM to the next shared-memory carveout, which left ~28 KB of L1
// instead of ~60, and it ran 4% slower (Mixtral, 3 bits, 1 token; decisions/024).
#define KEEPS_SOURCES 4
__device__ __forceinline__ const u32** table_sources(Stage& st, int r) {
    return (const u32**)(st.tbl[r] + MAX_TABLE / 2);
}

// Where word i of `row`'s table at width B lies in plane B - 1's chunk [bits | tables].
__device__ __forceinline__ i64 table_off(i64 bits_nbytes, int row, int rpt, int B, int i) {
    return bits_nbytes + (i64)(row / rpt) * (2 << B) + 4 * i;
}

// The block row (from the tile's first) that tile row r reads when the tile has nrows rows: rows
// past the end read a row of the tile's last group, the same row of it (computed and dropped), so
// that each group's rows stay one group of the plane (`popc_rows` reads them from row 0's
// pointers; the rows past the block's end up to a whole group are stored, as label 0).
__device__ __forceinline__ int staged_row(int r, int nrows) {
    return r < nrows ? r : ((nrows - 1) & ~7) + (r & 7);
}

// Fill `st` for rows [row0, row0 + 16) of `block` at width B (rows past the end: `staged_row`;
// the tables' rows repeat the last row). Threads first, first + stride, ... take part; no barrier.
// Returns whether every (row, plane) this thread staged lies in one slab.
__device__ bool stage(const Paged& g, int block, int B, i64 bits_nbytes, int words, int rpt,
                      int row0, int nrows, Stage& st, int first, int stride) {
    bool flat = true;
    for (int e = first; e < ROWS * B; e += stride) {
        const int r = e / B, p = e % B;
        st.ptr[r * 8 + p] = row_ptr(g, block, p, row0 + staged_row(r, nrows), words);
        flat = flat && st.ptr[r * 8 + p].split >= words;
    }
    const int per_row = max(1, (1 << B) / 2);  // u32 words of one row's table
    for (int e = first; e < ROWS * per_row; e += stride) {
        const int r = e / per_row, i = e % per_row;
        const i64 off = table_off(bits_nbytes, row0 + min(r, nrows - 1), rpt, B, i);
        const u32* src = (const u32*)paged(g, block, B - 1, off);
        *(u32*)(st.tbl[r] + 2 * i + table_shift(B, r)) = __ldg(src);
    }
    return flat;
}

// `stage` for two (block, rows) at once, into st[0] and st[1] (`count` 1: st[0] only): gate's and
// up's rows of a tile, or two tiles of one block (`stage_down`). A thread's loads for both go out
// together, the slab offsets and then the slab-map entries of its pointer and its table word,
// where two `stage` calls, each a loop of pointers and then one of tables, waited for 8 dependent
// loads one after another: 1.7 us of the ~3 us a one-token Qwen3-MoE gate_up CTA staged for
// after its wait, with L2 cold or warm (decisions/028). Both (block, rows) are real,
// nrows >= 1: with count 1 the second repeats the first (its loads are made, its stores are not).
// keep: where each table word came from, for `restage` (widths up to KEEPS_SOURCES); those tables
// come by cp.async, as restage's do (the caller waits for them: `tables_landed`).
__device__ bool stage_two(const Paged& g, const int (&block)[2], const int (&B)[2],
                          i64 bits_nbytes, int words, int rpt, const int (&row0)[2],
                          const int (&nrows)[2], int count, Stage (&st)[2], bool keep) {
    int per_row[2], n = 0;
    #pragma unroll
    for (int m = 0; m < 2; ++m) {
        per_row[m] = max(1, (1 << B[m]) / 2);  // u32 words of one row's table
        if (m < count) n = max(n, ROWS * max(B[m], per_row[m]));
    }
    bool flat = true;
    for (int e = threadIdx.x; e < n; e += blockDim.x) {
        // element e of each: pointer (row r, plane p), table word i of row rt. Every load is
        // issued whether or not the element exists (clamped to one that does): a load behind a
        // branch waits for the one before it
        int r[2], p[2], rt[2], i[2], fp[2], ft[2];
        #pragma unroll
        for (int m = 0; m < 2; ++m) {
            r[m] = min(e / B[m], ROWS - 1), p[m] = e % B[m];
            rt[m] = min(e / per_row[m], ROWS - 1), i[m] = e % per_row[m];
            fp[m] = plane_entry(g, block[m], p[m]);
            ft[m] = plane_entry(g, block[m], B[m] - 1);
        }
#ifdef PWCTL_STAMPS_CHAIN  // once this thread's quotients by the run-time widths and rpt are
        // known (keep: the popc gate_up's staging, whose stamps these are)
        if (keep)
            STAMP_AFTER(0, 6, r[0] + p[0] + rt[0] + i[0] + r[1] + p[1] + rt[1] + i[1] +
                                  (row0[0] + min(rt[0], nrows[0] - 1)) / rpt +
                                  (row0[1] + min(rt[1], nrows[1] - 1)) / rpt);
#endif
        RowPtr rp[2];
        const u32* src[2];
        #pragma unroll
        for (int m = 0; m < 2; ++m) {
            rp[m] = row_ptr_at(g, fp[m], row0[m] + staged_row(r[m], nrows[m]), words);
            const i64 off =
                table_off(bits_nbytes, row0[m] + min(rt[m], nrows[m] - 1), rpt, B[m], i[m]);
            src[m] = (const u32*)paged_at(g, ft[m], off);
        }
        #pragma unroll
        for (int m = 0; m < 2; ++m) {
            if (m >= count) break;
            if (e < ROWS * B[m]) {
                st[m].ptr[r[m] * 8 + p[m]] = rp[m];
                flat = flat && rp[m].split >= words;
            }
            if (e < ROWS * per_row[m]) {
                unsigned short* dst = st[m].tbl[rt[m]] + 2 * i[m] + table_shift(B[m], rt[m]);
                if (keep && B[m] <= KEEPS_SOURCES) {
                    table_sources(st[m], rt[m])[i[m]] = src[m];
                    copy_word_async(dst, src[m]);
                } else {
                    *(u32*)dst = __ldg(src[m]);
                }
            }
        }
    }
    if (keep) asm volatile("cp.async.commit_group;" ::: "memory");
    return flat;
}

// Move `st` from rows [row0 - ROWS, row0) of `block` (every row in the block, staged keeping the
// tables' sources, B <= KEEPS_SOURCES) on to [row0, row0 + ROWS), all in the block too. A (row,
// plane) whose new row lies in the slab its old row began in moves on by ROWS rows with no load
// (the pager's slabs hold whole tiles: a Mixtral plane's 256 KB slab holds 32); any other is
// staged afresh.
// The tables come by cp.async: the fold waits for them (`tables_landed`), so their latency hides
// behind the streaming, where a `stage` that loads them waits on a chain of 5 loads first (2.8
// us of a ~16 us Mixtral CTA, all of it on the kernel's critical path: decisions/024;
// now a first staging keeping sources copies them so too). No barrier; no flatness
// either (`stage`'s, for the lookup, which a block this narrow never takes).
__device__ void restage(const Paged& g, int block, int B, i64 bits_nbytes, int words, int rpt,
                        int row0, Stage& st) {
    const i64 step = ROWS * 4LL * words, span = 4 * tiled(words - 1) + 4;  // ROWS: whole groups
    for (int e = threadIdx.x; e < ROWS * B; e += blockDim.x) {
        const int r = e / B, p = e % B;
        const i64 off = row_start(row0 + r, words);
        RowPtr& rp = st.ptr[r * 8 + p];
        if ((off - step) >> g.slab_shift == (off + span - 1) >> g.slab_shift) {
            rp.p0 += ROWS * words;
            rp.p1 = rp.p0, rp.split = words;
        } else {
            rp = row_ptr(g, block, p, row0 + r, words);
        }
    }
    const int per_row = max(1, (1 << B) / 2);
    for (int e = threadIdx.x; e < ROWS * per_row; e += blockDim.x) {
        const int r = e / per_row, i = e % per_row;
        const i64 off = table_off(bits_nbytes, row0 + r, rpt, B, i);
        const i64 was = table_off(bits_nbytes, row0 - ROWS + r, rpt, B, i);
        const u32*& src = table_sources(st, r)[i];
        src = was >> g.slab_shift == off >> g.slab_shift ? src + (off - was) / 4
                                                         : (const u32*)paged(g, block, B - 1, off);
        copy_word_async(st.tbl[r] + 2 * i + table_shift(B, r), src);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
}

// restage's tables are in shared memory, for every thread. Every thread of the CTA calls it.
__device__ __forceinline__ void tables_landed() {
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();
}

// Plane words w, w + 1 (w even) of one row (zeros past the row): one 8-byte load a plane, as a
// row is whole 16-byte units (docs/FORMAT.md) and the two words lie in one.
template <int B>
__device__ __forceinline__ void load_words(const RowPtr* rp, int w, int words, u32 (&P0)[8],
                                           u32 (&P1)[8]) {
    #pragma unroll
    for (int p = 0; p < 8; ++p) P0[p] = P1[p] = 0u;
    if (w >= words) return;
    #pragma unroll
    for (int p = 0; p < B; ++p) {
        const uint2 v = __ldg((const uint2*)word_ptr(rp[p], w));
        P0[p] = v.x;
        P1[p] = v.y;
    }
}

// Word w of rows g and g + 8, every plane (zeros past the row). FLAT: no staged row crosses a
// slab edge, so each row's plane words are one array and a load needs no page choice.
template <int B, bool FLAT>
__device__ __forceinline__ void load_word(const RowPtr* r0, const RowPtr* r1, int w, int words,
                                          u32 (&P0)[8], u32 (&P1)[8]) {
    const bool in = w < words;
    #pragma unroll
    for (int p = 0; p < 8; ++p) {
        P0[p] = p < B && in ? (FLAT ? __ldg(r0[p].p0 + tiled(w)) : word_at(r0[p], w)) : 0u;
        P1[p] = p < B && in ? (FLAT ? __ldg(r1[p].p0 + tiled(w)) : word_at(r1[p], w)) : 0u;
    }
}

// The eight k-steps of one word w of rows g (P0) and g + 8 (P1), for every live n-tile.
// One n-tile at 5 bits decodes labels as bytes (BYTES): no spill there now, and calls of 1-2
// tokens 3-10% faster on the Qwen shapes, 2% on Mixtral's 2 tokens. At 6 bits it was 2-7% faster
// on Mixtral and Qwen1.5-MoE and 3% slower on Qwen3-MoE; at 8 bits 4.5% faster on Mixtral and
// 1-10% slower on the Qwen shapes; in the larger tiles, within 1% (decisions/033).
template <int B, int NT>
__device__ __forceinline__ void mma_word(const u32 (&P0)[8], const u32 (&P1)[8], const u32 (&L0)[8],
                                         const u32 (&L1)[8], const Stage& st, int w, int wpad,
                                         const uint4* xf, const int (&xrow)[NT], int live,
                                         float (&acc)[NT][4]) {
    const int g = (threadIdx.x & 31) >> 2;
#define PHASE(C)                                                                                  \
    {                                                                                             \
        u32 A0[4], A1[4];                                                                         \
        decode<B, C, NT == 1 && B == 5>(P0, L0, st.tbl[g], A0);                                   \
        decode<B, C, NT == 1 && B == 5>(P1, L1, st.tbl[g + 8], A1);                               \
        _Pragma("unroll") for (int nt = 0; nt < NT; ++nt) {                                       \
            if (NT > 2 && nt >= live) break; /* n-tiles past the slot's tokens */                 \
            const uint4 bx = xrow[nt] >= 0 ? __ldg(xf + ((i64)xrow[nt] * wpad + w) * 4 + C)       \
                                           : make_uint4(0u, 0u, 0u, 0u);                          \
            mma16816(acc[nt], A0[0], A1[0], A0[1], A1[1], bx.x, bx.y);                            \
            mma16816(acc[nt], A0[2], A1[2], A0[3], A1[3], bx.z, bx.w);                            \
        }                                                                                         \
    }
    PHASE(0) PHASE(1) PHASE(2) PHASE(3)
#undef PHASE
}

// acc[nt] += this warp's share of W[rows] x^T for the tokens whose fragment-order rows are
// xrow[nt] (-1: no token), W read at width B <= 4 from the staged block.
//
// Lane t takes words w = 8 it + t + 4u (u = 0, 1) of iteration it: the four lanes of a row read
// 16 contiguous bytes of a plane. Loads roll one iteration ahead without extra registers: as soon
// as word u of this iteration is decoded, its registers are refilled with word u of the next, so
// a load has half an iteration of decoding to arrive.
template <int B, int NT, bool FLAT>
__device__ __forceinline__ void mma_rows(const Stage& st, int words, int wpad, const uint4* xf,
                         const int (&xrow)[NT], int live, int part, int parts,
                         float (&acc)[NT][4]) {
    // the column iterations are shared by `parts` warps: those of a unit times the CTAs of a
    // k-split (`part`: this warp's place among them)
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    u32 L0[8], L1[8];
    lut_from(st.tbl[g], B, L0);
    lut_from(st.tbl[g + 8], B, L1);
    const RowPtr *r0 = st.ptr + g * 8, *r1 = st.ptr + (g + 8) * 8;
    const int iters = (words + 7) / 8, step = parts;
    int it = part;
    u32 Pa0[8], Pa1[8], Pb0[8], Pb1[8];  // words u = 0 (a) and 1 (b) of rows g, g + 8
    load_word<B, FLAT>(r0, r1, 8 * it + t, words, Pa0, Pa1);
    load_word<B, FLAT>(r0, r1, 8 * it + t + 4, words, Pb0, Pb1);
    for (; it < iters; it += step) {
        const int w = 8 * it + t;
        mma_word<B, NT>(Pa0, Pa1, L0, L1, st, w, wpad, xf, xrow, live, acc);
        load_word<B, FLAT>(r0, r1, w + 8 * step, words, Pa0, Pa1);
        mma_word<B, NT>(Pb0, Pb1, L0, L1, st, w + 4, wpad, xf, xrow, live, acc);
        load_word<B, FLAT>(r0, r1, w + 4 + 8 * step, words, Pb0, Pb1);
    }
}

// The same for widths 5-8 (tables in shared memory): lane t takes words 8 it + 2t and + 1, both
// loaded at the top of the iteration (rolling them would hold 4B words a lane across the loop, and
// the kernel's register count is that of its widest path).
template <int B, int NT>
__device__ __forceinline__ void mma_rows_wide(const Stage& st, int words, int wpad, const uint4* xf,
                              const int (&xrow)[NT], int live, int part, int parts,
                              float (&acc)[NT][4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const u32 L[8] = {};  // unused: the lookups read the shared-memory table
    const int iters = (words + 7) / 8;
    for (int it = part; it < iters; it += parts) {
        const int w = 8 * it + 2 * t;
        u32 P[2][2][8];  // [row g / g + 8][word w / w + 1][plane]
        load_words<B>(st.ptr + g * 8, w, words, P[0][0], P[0][1]);
        load_words<B>(st.ptr + (g + 8) * 8, w, words, P[1][0], P[1][1]);
        mma_word<B, NT>(P[0][0], P[1][0], L, L, st, w, wpad, xf, xrow, live, acc);
        mma_word<B, NT>(P[0][1], P[1][1], L, L, st, w + 1, wpad, xf, xrow, live, acc);
    }
}

// A slot takes the loop of the smallest compiled tile that holds its tokens (a launch's NT fits
// its largest possible slot; most are smaller), so empty n-tiles cost no mma. The choice is made
// once, outside the loop: mma_word's skip past a slot's tokens, compiled into the 2-tile loop
// too, made it slower than the dead mma it saved (decisions/031).
template <int NT>
__device__ __forceinline__ void mma_tier(const Stage& st, int B, bool flat, int words, int wpad,
                         const uint4* xf, const int (&xrow)[NT], int live, int part,
                         int parts, float (&acc)[NT][4]) {
    if constexpr (NT > 1) {
        if (live <= NT / 2) {
            mma_tier<NT / 2>(st, B, flat, words, wpad, xf,
                             reinterpret_cast<const int(&)[NT / 2]>(xrow), live, part, parts,
                             reinterpret_cast<float(&)[NT / 2][4]>(acc));
            return;
        }
    }
    switch (B) {
#define CASE(W)                                                                                   \
    case W:                                                                                       \
        if (flat) mma_rows<W, NT, true>(st, words, wpad, xf, xrow, live, part, parts, acc);       \
        else mma_rows<W, NT, false>(st, words, wpad, xf, xrow, live, part, parts, acc);           \
        break;
        CASE(1) CASE(2) CASE(3) CASE(4)
#undef CASE
#define CASE(W) case W: mma_rows_wide<W, NT>(st, words, wpad, xf, xrow, live, part, parts, acc); break;
        CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
    }
}

template <int NT>
__device__ __forceinline__ void mma_block(const Stage& st, int B, bool flat, int words, int wpad,
                          const uint4* xf, const int (&xrow)[NT], int live, int part,
                          int parts, float (&acc)[NT][4]) {
    #pragma unroll
    for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
    mma_tier<NT>(st, B, flat, words, wpad, xf, xrow, live, part, parts, acc);
}

struct Slots {
    const int* expert;  // [n_slots]: expert of the slot (its row in block_ids)
    const int* lo;      // [n_slots]: first pair of the slot
    const int* hi;      // [n_slots]: one past its last pair
    const int* token;   // [pairs]: token of each pair (pairs sorted by slot)
    const float* weight;  // [pairs]: combine weight of each pair
    const int* block_ids;  // [experts (+ shared), 3]: block of gate, up, down
    int n_ids;             // block_ids' rows
};

// (__fdividef: a plain division checks its operands and branches to a slow path; for v -> -inf the
// divisor is inf and the result 0, silu's limit)
__device__ __forceinline__ float silu(float v) { return __fdividef(v, 1.f + __expf(-v)); }

// h[pair, row] = silu(gate) * up, stored in fragment order for the down projection. Rows past I
// up to the padded width get zeros, so down never reads memory nobody wrote.
__device__ __forceinline__ void store_h(unsigned short* hp, int pair, int row, int I, int wpad,
                                        float gate, float up) {
    if (row >= 32 * wpad) return;
    const int col = row & 31;
    const i64 off = (i64)(row >> 5) * 32 + (2 * (col & 3) + (col >> 4)) * 4 + ((col >> 2) & 3);
    hp[(i64)pair * wpad * 32 + off] = f2h(row < I ? silu(gate) * up : 0.f);
}

// Where a CTA is: blockIdx.x = row tile, `slot` = its slot in its group (*_ENTRY: blockIdx.y less
// the routed slots for the shared expert's), blockIdx.z: k-split of down.
struct Tile {
    int slot, lo, T, base, row0;  // base: the pass's first token of the slot (prefill)
    int live;                     // decode: n-tiles that hold a token of the slot
};

__device__ __forceinline__ Tile tile_of(const Slots& s, int rows_per_cta, int slot, int tile) {
    Tile c;
    c.slot = slot;
    c.lo = __ldg(s.lo + c.slot);
    c.T = __ldg(s.hi + c.slot) - c.lo;
    c.base = 0;
    c.row0 = tile * rows_per_cta;
    c.live = (c.T + 7) / 8;  // a launch's NT fits its largest possible slot; most slots are smaller
    return c;
}

// A gate_up CTA's work: halves [a, b) of its group's tiles (tile `at`, slot at / tiles, is halves
// 2 at and 2 at + 1, which take alternate chunks of its columns). On the per-tile grid, one tile.
// One-token calls of more tiles than a wave run a persistent grid instead (GATE_UP_ENTRY's RUN,
// a wave of CTAs, `runs` of them routed): CTA j takes the j-th of `runs` equal shares of the routed
// tiles' halves, so that every CTA gets the same work to within a half (a Mixtral layer's 1792
// tiles on 528 CTAs: 6 or 7 halves), and each tile after its first stages without a chain of
// loads (`restage`); the CTAs after them share the shared expert's tiles the same way. A share
// may begin or end in the middle of a tile, whose halves then meet in split_join.
struct Run {
    int a, b;   // halves [a, b)
    int j;      // this CTA's share (persistent grid); its first tile's scratch is j's, its last j + 1's
    int tiles;  // tiles a slot
};

// Where a tile computed in two halves meets (split_join): a scratch a share, the one that begins
// in the tile.
struct Split {
    float* sum;   // [runs + 1][2 halves][2 * ROWS]: each half's gate and up rows
    int* ticket;  // [runs + 1]: halves done; the second half resets it to 0
};

// A gate_up tile's place and what its end needs (split_join, store_h). The persistent grid keeps
// it in shared memory across the streaming: held in registers with the share's bounds, it took
// `gate_up_p1` from 127 registers to 128 and 20 bytes of spills, reloaded after the streaming
// (which has likely evicted them from L1 and L2), and a CTA a tile ran 4% slower (Mixtral, 4
// bits, one token; decisions/024).
struct TileEnd {
    int lo, row0;  // the tile's pair and first row
    int kz, kn;    // this CTA's half of the columns, and the halves (1: a whole tile)
    int idx;       // the tile's scratch in Split
};

// The warps' partial sums, added in shared memory 4 n-tiles at a time. The warps form units of
// `parts` warps that split one m-tile's columns (4 parts: one unit; 2 parts: two m-tiles side by
// side). Thread (warp w, lane l) ends with fragment register w of lane l, i.e. row (l / 4) +
// 8 (w / 2), token 2 (l % 4) + (w % 2) of each n-tile, of unit u in sum[u][nt].
#define RED_TILES 4
#define RED_FLOATS (WARPS * RED_TILES * 4 * 32)  // a CTA's `red`
template <int NT>
__device__ void reduce_units(const float (&acc)[NT][4], float* red, int parts, float (&sum)[2][NT]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    #pragma unroll
    for (int n0 = 0; n0 < NT; n0 += RED_TILES) {
        __syncthreads();  // the previous group (or caller) is done with red
        #pragma unroll
        for (int nt = n0; nt < min(NT, n0 + RED_TILES); ++nt)
            #pragma unroll
            for (int r = 0; r < 4; ++r) red[((warp * RED_TILES + nt - n0) * 4 + r) * 32 + lane] = acc[nt][r];
        __syncthreads();
        #pragma unroll
        for (int nt = n0; nt < min(NT, n0 + RED_TILES); ++nt) {
            float s0 = 0.f, s1 = 0.f;  // not sum[w / parts]: a run-time index would spill sum
            #pragma unroll
            for (int w = 0; w < WARPS; ++w) {
                const float v = red[((w * RED_TILES + nt - n0) * 4 + warp) * 32 + lane];
                if (w < parts) s0 += v;
                else s1 += v;
            }
            sum[0][nt] = s0;
            sum[1][nt] = s1;
        }
    }
}

struct PopcX;  // x's pieces for the one-token kernels (below); the lookup kernels ignore them

// Before its wait a gate_up CTA pulls into L2 what staging chases after it: the block ids, widths,
// slab offsets and slab-map entries of one row of block_ids (CTA j: row j), 4 of the 5 dependent
// loads before a tile's first plane word, each a miss when a layer runs cold (as in a model's
// step: the other layers' planes pass through L2 between two of this one's). The router has not
// chosen the experts yet, so every row's: ~20 KB of lines a Mixtral layer, ~100 KB a Qwen3-MoE.
__device__ void prefetch_ids(const Paged& g, const Slots& s) {
    const int j = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    if (j >= s.n_ids || threadIdx.x >= 96) return;
    const int lane = threadIdx.x & 31, b = __ldg(s.block_ids + 3 * j + (threadIdx.x >> 5));
    const int* off = g.slab_off + (i64)b * g.max_bits;
    if (lane == 0) prefetch_l2(g.width + b);
    // the block's planes' entries lie together (the last plane's first only: the array may end
    // there, and that plane is read at width max_bits alone)
    const int first = __ldg(off), last = __ldg(off + g.max_bits - 1) + 1;
    for (int e = (first & ~31) + 32 * lane; e < last; e += 32 * 32)
        prefetch_l2(g.slab_map + e);
}

// Stage rows [row0, row0 + nrows) of expert e's gate (st[0]) and up (st[1]) blocks, their widths
// out in wg, wu; ends with a barrier. Returns whether every staged row is flat (`stage`).
__device__ __forceinline__ bool stage_gate_up(const Paged& g, const Slots& s, int e,
                                              i64 bits_nbytes, int words, int rpt, int row0,
                                              int nrows, Stage (&st)[2], int& wg, int& wu,
                                              bool keep = false) {
    const int b[2] = {__ldg(s.block_ids + 3 * e), __ldg(s.block_ids + 3 * e + 1)};
    wg = __ldg(g.width + b[0]), wu = __ldg(g.width + b[1]);
    STAMP_AFTER(0, 5, wg + wu);
    const int B[2] = {wg, wu}, r0[2] = {row0, row0}, nr[2] = {nrows, nrows};
    const bool flat = stage_two(g, b, B, bits_nbytes, words, rpt, r0, nr, 2, st, keep);
    STAMP_AFTER(0, 3, (size_t)st[0].ptr[0].p0 + (size_t)st[1].ptr[0].p0);
    return __syncthreads_and(flat);
}

// Stage the `units` 16-row tiles from row0 of expert e's down block (a tile past H is neither
// staged nor streamed), its width out in wd; ends with a barrier. Returns `stage`'s flatness.
__device__ __forceinline__ bool stage_down(const Paged& g, const Slots& s, int e, i64 bits_nbytes,
                                           int words, int rpt, int row0, int units, int H,
                                           Stage (&st)[2], int& wd) {
    const int bd = __ldg(s.block_ids + 3 * e + 2);
    wd = __ldg(g.width + bd);
    // (row0 < H: the caller's)
    const int count = units == 2 && row0 + ROWS < H ? 2 : 1, second = row0 + ROWS * (count - 1);
    const int b[2] = {bd, bd}, B[2] = {wd, wd}, r0[2] = {row0, second};
    const int nr[2] = {min(ROWS, H - row0), min(ROWS, H - second)};
    const bool flat = stage_two(g, b, B, bits_nbytes, words, rpt, r0, nr, count, st, false);
    return __syncthreads_and(flat);
}

// h[pair] = silu(gate x) * up x in fragment order (`store_h`), for the down projection: the CTA's
// 16 rows for tile c of a slot (also the few-token popc kernels' slots of several tokens).
template <int NT>
__device__ __forceinline__ void gate_up_tile(const Paged& g, const Slots& s, const Tile& c,
                                             Stage (&st)[2], float (&red)[RED_FLOATS],
                                             const uint4* xf, unsigned short* hp, int I,
                                             int words_in, int wpad_in, int wpad_out,
                                             i64 bits_nbytes, int rpt) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int e = __ldg(s.expert + c.slot), nrows = min(ROWS, I - c.row0);
    float gs[NT], us[NT];
    if (nrows > 0) {
        int xrow[NT];
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const int j = c.base + 8 * nt + (lane >> 2);
            xrow[nt] = j < c.T ? __ldg(s.token + c.lo + j) : -1;
        }
        int wg, wu;
        const bool flat = stage_gate_up(g, s, e, bits_nbytes, words_in, rpt, c.row0, nrows, st, wg, wu);
        STAMP(0, 2);
        // gate, then up, each on all 4 warps (running them side by side on 2 warps each was
        // 10-20% slower on Mixtral and no faster on Qwen3-MoE); one copy of the
        // loops for both blocks (two inlined copies spilled the second's accumulators)
        #pragma unroll 1
        for (int m = 0; m < 2; ++m) {
            float acc[NT][4], sum[2][NT];
            mma_block<NT>(st[m], m ? wu : wg, flat, words_in, wpad_in, xf, xrow, c.live, warp, WARPS, acc);
            STAMP(0, 3 + 2 * m);
            reduce_units<NT>(acc, red, WARPS, sum);
            STAMP(0, 4 + 2 * m);
            #pragma unroll
            for (int nt = 0; nt < NT; ++nt) (m ? us : gs)[nt] = sum[0][nt];
        }
    }
    const int row = c.row0 + (lane >> 2) + 8 * (warp >> 1);
    #pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const int j = c.base + 8 * nt + 2 * (lane & 3) + (warp & 1);
        if (j < c.T) store_h(hp, c.lo + j, row, I, wpad_out, gs[nt], us[nt]);
    }
}

template <int NT>
__device__ void gate_up(Paged g, Slots s, Run run, const uint4* xf, unsigned short* hp, int I,
                        int words_in, int wpad_in, int wpad_out, i64 bits_nbytes, int rpt,
                        const PopcX*, Split) {
    __shared__ Stage st[2];
    __shared__ float red[RED_FLOATS];
    STAMP(0, 0);
    prefetch_ids(g, s);
    wait_previous();  // the slots and x come from decode_prep (or h's buffer is still being read)
    start_next();     // down may launch and stage while this grid runs
    STAMP(0, 1);
    const int at = run.a / 2;  // one tile a CTA
    const Tile c = tile_of(s, ROWS, at / run.tiles, at % run.tiles);
    if (c.base >= c.T) return;
    gate_up_tile<NT>(g, s, c, st, red, xf, hp, I, words_in, wpad_in, wpad_out, bits_nbytes, rpt);
    STAMP(0, 7);
}

// out[token] += weight * (down h[pair]) for every pair of a slot (fp32 atomics, so the columns may
// also be split over kn CTAs; this one is kz). `units` m-tiles a CTA: 1 (16 rows, 4 warps on its columns)
// or, for short rows, 2 (rows [row0, row0 + 16) and the 16 after, 2 warps each), so that warps
// have columns to stream.
template <int NT>
__device__ __forceinline__ void down_tile(const Paged& g, const Slots& s, const Tile& c, int kz,
                                          int kn, Stage (&st)[2], float (&red)[RED_FLOATS],
                                          const uint4* hp, float* out, int H, int words_in,
                                          int wpad_in, i64 bits_nbytes, int rpt, int units) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int parts = WARPS / units, unit = warp / parts;
    const int e = __ldg(s.expert + c.slot);
    int xrow[NT];
    #pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const int j = c.base + 8 * nt + (lane >> 2);
        xrow[nt] = j < c.T ? c.lo + j : -1;
    }
    int wd;
    const bool flat = stage_down(g, s, e, bits_nbytes, words_in, rpt, c.row0, units, H, st, wd);
    STAMP(1, 2);
    // everything above read what was final before gate_up started (slots, descriptors); h is not
    wait_previous();
    STAMP(1, 1);
    float acc[NT][4] = {}, sum[2][NT];  // acc stays zero for a tile past H
    if (c.row0 + ROWS * unit < H)
        mma_block<NT>(st[unit], wd, flat, words_in, wpad_in, hp, xrow, c.live,
                      kz * parts + warp % parts, kn * parts, acc);
    STAMP(1, 3);
    reduce_units<NT>(acc, red, parts, sum);
    STAMP(1, 4);
    #pragma unroll
    for (int u = 0; u < 2; ++u) {
        const int row = c.row0 + ROWS * u + (lane >> 2) + 8 * (warp >> 1);
        if (u >= units || row >= H) break;
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const int j = c.base + 8 * nt + 2 * (lane & 3) + (warp & 1);
            if (j < c.T)
                atomicAdd(out + (i64)__ldg(s.token + c.lo + j) * H + row, __ldg(s.weight + c.lo + j) * sum[u][nt]);
        }
    }
}

template <int NT>
__device__ void down(Paged g, Slots s, int slot, int tile, int kz, int kn, const uint4* hp,
                     float* out, int H, int words_in, int wpad_in, i64 bits_nbytes, int rpt,
                     int units, const PopcX*) {
    __shared__ Stage st[2];
    __shared__ float red[RED_FLOATS];
    STAMP(1, 0);
    const Tile c = tile_of(s, ROWS * units, slot, tile);
    if (c.base >= c.T || c.row0 >= H) return;
    down_tile<NT>(g, s, c, kz, kn, st, red, hp, out, H, words_in, wpad_in, bits_nbytes, rpt, units);
    STAMP(1, 7);
}

// ---- one-token decode on binary tensor cores ---------------------------------------------------
//
// With one token a slot, mma.m16n8k16 spends 7 of its 8 columns on nothing and the lookup's
// integer work bounds the kernels (docs/KERNELS.md). These kernels (`gate_up_p1`, `down_p1` and
// their 3-bit build `*_p1b3`, for the one-token calls FusedMoE._x_pieces picks) do no lookup. A row's table T at width B is
// written in the multilinear basis of its label bits: T[label] = sum over plane subsets S of c_S * prod_{p in
// S} bit_p (c_S: Moebius sums of T), so
//     y[r] = sum_S c_S[r] * (AND of r's planes in S) . x,
// and with x in 16-bit two's-complement fixed point q = round(x / sx), each (AND_S) . q is an exact
// integer that mma.m16n8k256 .and.popc adds up: A = q's 16 bit planes (rows) over 256 columns,
// B = AND_S of 8 weight rows (columns). A warp issues 2^B - 1 mma a k-step (8 rows x 256
// columns); a lane 2^B - B - 1 LOP3 per 32 of its weights, against ~100 integer operations for
// the lookup at 4 bits.
//
// Columns go in k-steps of 256: first full 16-word chunks (two k-steps; lane t holds words
// 16c + 4t .. + 3 of its row, one 16-byte load a plane), then 8-word k-steps (lane t: words
// 8j + 2t, + 1). `step_word` gives lane t's first word of a k-step, its second is the next.
// x (the token's activations for gate_up: `x_piece` in the prep launch; each pair's h for down:
// `popc_planes`) is quantized once per call, per piece of at most POPC_STEPS k-steps with the
// piece's own scale, into the A fragments in global memory (PopcX); the lanes fold their integer sums into fp64 after each
// piece (the two's-complement planes of a lane's two x bit planes cancel against other lanes' by
// up to 2^15 / |x|, too much for fp32). pwctl/runtime/popc.py is the CPU twin.
#define POPC_STEPS 32
static_assert(POPC_STEPS <= 32, "popc_fold sums a piece's k-step sums a lane a k-step");

__device__ __forceinline__ int step_word(int ks, int chunks, int t) {
    return ks < 2 * chunks ? 16 * (ks >> 1) + 4 * t + 2 * (ks & 1)
                           : 16 * chunks + 8 * (ks - 2 * chunks) + 2 * t;
}

// k-steps of a row of `words` words (words % 4 == 0)
__device__ __forceinline__ int popc_steps(int words) {
    return 2 * (words / 16) + (words % 16 + 7) / 8;
}

struct PopcX {  // one piece of one row of x (popc.PIECE_BYTES)
    uint4 a[POPC_STEPS][32];  // [k-step][lane]: planes g, g + 8 at the step's two words
    int ksum[POPC_STEPS];     // sum of q over each k-step (the empty subset's term)
    float sx;                 // the piece's scale: x = sx * q
    int pad[3];
};

__device__ __forceinline__ int popc_pieces(int words) {
    return (popc_steps(words) + POPC_STEPS - 1) / POPC_STEPS;
}

// Piece `pc` of one row into PopcX, word z of each k-step's 8 (POPC_SPLIT CTAs share a piece: one
// CTA doing all 8 words' ballots took 16 us on one SM, Nsight Compute, decisions/023). `at(w)`: the
// row's value at column 32 w + lane (w < words; words past the row read the last one, and a load
// must not sit behind a branch). Warp i takes the piece's k-steps i, i + warps,
// ... (SPW at most: SPW x warps >= the piece's k-steps), every load in flight at once, for the
// piece's scale; then it turns word z of each of its k-steps into planes. Steps past the row are
// neither built nor read. A warp's instructions are the cost (each waits ~10 cycles on the last
// with a few warps an SM: Nsight Compute, decisions/023), so no warp takes more steps than it must.
template <int SPW, class At>
__device__ void popc_piece_of(At at, int words, int pc, int z, PopcX* dst, bool store = true,
                              bool stamped = false) {
    __shared__ float amax;
    const int ks = popc_steps(words), chunks = words / 16, k0 = pc * POPC_STEPS;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    if (threadIdx.x == 0) amax = 0.f;
    float v[SPW][8], m = 0.f;
    #pragma unroll
    for (int j = 0; j < SPW; ++j) {
        const int i = warp + j * warps, step = k0 + i;
        if (i >= POPC_STEPS || step >= ks) break;  // warp-uniform; nobody reads past the row
        #pragma unroll
        for (int h = 0; h < 8; ++h) {  // word h % 2 of lane t = h / 2 of the k-step
            // every word loaded, past the row from its last word, so that the 8 loads go out
            // together: under `w < words` each waited on the one before (8 L2 round trips,
            // 3 us of popc_planes' 4.3 on Mixtral; decisions/023)
            const int w = step_word(step, chunks, h >> 1) + (h & 1);
            const float a = at(min(w, words - 1));
            v[j][h] = w < words ? a : 0.f;
            m = fmaxf(m, fabsf(v[j][h]));
        }
    }
    #pragma unroll
    for (int d = 16; d > 0; d >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, d));
    if (stamped && store) STAMP(3, 2);  // (popc_planes' phases: the warp's loads are in)
    __syncthreads();
    if (lane == 0) atomicMax((int*)&amax, __float_as_int(m));  // m >= 0: ints order as floats
    __syncthreads();
    if (stamped && store) STAMP(3, 3);
    const float inv = amax > 0.f ? 32767.f / amax : 0.f;
    #pragma unroll
    for (int j = 0; j < SPW; ++j) {
        const int i = warp + j * warps;
        if (i >= POPC_STEPS || k0 + i >= ks) break;
        float mine_v = 0.f;
        #pragma unroll
        for (int h = 0; h < 8; ++h)
            if (h == z) mine_v = v[j][h];
        const int q = __float2int_rn(mine_v * inv);
        u32 mine = 0;
        #pragma unroll
        for (int k = 0; k < 16; ++k) {
            const u32 b = __ballot_sync(0xffffffffu, (q >> k) & 1);
            if (lane == k) mine = b;
        }
        // plane `lane` of word (t, h) = z: lane (lane % 8, t) of the k-step, register 2h + lane / 8
        if (store && lane < 16)
            ((u32*)&dst->a[i][4 * (lane & 7) + (z >> 1)])[2 * (z & 1) + (lane >> 3)] = mine;
        if (z == 0) {  // the k-step's sum of q, once
            int s = 0;
            #pragma unroll
            for (int h = 0; h < 8; ++h) s += __float2int_rn(v[j][h] * inv);
            #pragma unroll
            for (int d = 16; d > 0; d >>= 1) s += __shfl_xor_sync(0xffffffffu, s, d);
            if (store && lane == 0) dst->ksum[i] = s;
        }
    }
    if (store && z == 0 && threadIdx.x == 0) dst->sx = amax / 32767.f;  // the piece's scale
}

// Each pair's h (fragment-order fp16 rows, from gate_up) into its pieces: piece blockIdx.x of row
// blockIdx.y, word blockIdx.z of each k-step; rows past `rows` are the second group's (the shared
// expert's h). A warp a k-step of the longest piece (the launcher sizes the block). x's pieces are
// built in the launch that prepares the call (`x_piece`).
#define POPC_THREADS 1024
#define POPC_SPLIT 8  // kernels.POPC_SPLIT: a k-step's 8 words
#if WANT(popc_planes)
extern "C" __global__ void __launch_bounds__(POPC_THREADS) popc_planes(
    const unsigned short* src, int wpad, int words, int rows, PopcX* dst,
    const unsigned short* t_src, int t_wpad, int t_words, PopcX* t_dst) {
    STAMP(3, 0);
    // down may launch and stage now, while gate_up runs: triggered after this grid's wait, its
    // CTAs entered only once gate_up had ended, and staged on the critical path (Qwen3-MoE, one
    // token, popc: 30.4 -> 27.8 us at 3 bits; decisions/012)
    start_next();
    int row = blockIdx.y;
    if (row >= rows) row -= rows, src = t_src, wpad = t_wpad, words = t_words, dst = t_dst;
    const int pieces = popc_pieces(words);
    if ((int)blockIdx.x >= pieces) return;
    // column `lane` of a word in fragment order: store_h's position, written as it ran on the
    // GPU (sharing store_h's expression changes either kernel's code)
    const int lane = threadIdx.x & 31;
    const int pos = 8 * (lane & 3) + 4 * (lane >> 4) + ((lane >> 2) & 3);
    src += (i64)row * wpad * 32;
    // Two passes over one copy of the build: the first, before the wait, reads h as it stands
    // and stores nothing (its values are dropped), so that what the build needs besides h (its
    // instructions, h's pages) is at hand when h lands; the second builds. The loads after the
    // wait took 1.5-2.0 us on Mixtral, 0.85 with the first pass (decisions/023)
    #pragma unroll 1
    for (int pass = 0; pass < 2; ++pass) {
        if (pass == 1) {
            wait_previous();  // h from gate_up
            __syncthreads();  // (the first pass's scale read before the second resets it)
            STAMP(3, 1);
        }
        popc_piece_of<1>([&](int w) { return h2f(src[32 * w + pos]); }, words, blockIdx.x,
                         blockIdx.z, dst + (i64)row * pieces + blockIdx.x, pass == 1, true);
    }
    STAMP(3, 7);
}
#endif

// Block b of a prep launch's x-piece blocks (256 threads): piece, token and word z as
// `popc_planes`'s grid numbers them, from row-major fp16 x [T, H] (words: the gate rows').
#define PREP_THREADS 256
__device__ void x_piece(const unsigned short* x, int T, int H, int words, PopcX* px, int b) {
    const int z = b % POPC_SPLIT, row = b / POPC_SPLIT % T, pc = b / POPC_SPLIT / T;
    const int lane = threadIdx.x & 31, pieces = popc_pieces(words);
    const unsigned short* xr = x + (i64)row * H;
    popc_piece_of<POPC_STEPS * 32 / PREP_THREADS>(
        [&](int w) {  // loaded at a column inside the row either way (popc_piece_of)
            const float v = h2f(xr[min(32 * w + lane, H - 1)]);
            return 32 * w + lane < H ? v : 0.f;
        },
        words, pc, z, px + (i64)row * pieces + pc);
}

__device__ __forceinline__ void mma_popc(int (&d)[4], const uint4& a, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k256.row.col.s32.b1.b1.s32.and.popc {%0,%1,%2,%3}, "
        "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b0), "r"(b1));
}

template <int B, int S>
__device__ __forceinline__ u32 subset_and(const u32 (&w)[B]) {
    u32 v = 0xffffffffu;
    #pragma unroll
    for (int p = 0; p < B; ++p)
        if (S >> p & 1) v &= w[p];
    return v;
}

// The integer sums of the lane's rows over one k-step (a0, lo0, hi0) or, TWO, a chunk's two, for
// every subset S != {}: the mma gives x planes g (d[0], d[1]: rows 2t, 2t + 1) and g + 8 (d[2],
// d[3]). With R = 4 registers a subset, acc[S] is that fragment. With R = 2 the two planes are
// combined after the chunk, acc[S][r] = d[r] + k8 d[2 + r] with k8 = +-256 (x's top plane is
// negative), and the fold multiplies by 2^g (exact: a piece's |acc| <= 32 * 256 * 257 < 2^22).
// Half the registers across the loop for two integer operations a subset and chunk (popc_regs
// says which builds take it).
template <int B, int R, bool TWO, int S = 1, int NS>
__device__ __forceinline__ void popc_step(int (&acc)[NS][R], int k8, const uint4& a0,
                                          const u32 (&lo0)[B], const u32 (&hi0)[B],
                                          const uint4& a1, const u32 (&lo1)[B],
                                          const u32 (&hi1)[B]) {
    if constexpr (S < (1 << B)) {
        if constexpr (R == 4) {
            static_assert(!TWO, "R = 4 takes one k-step a call");
            mma_popc(acc[S], a0, subset_and<B, S>(lo0), subset_and<B, S>(hi0));
        } else {
            int d[4] = {acc[S][0], acc[S][1], 0, 0};
            mma_popc(d, a0, subset_and<B, S>(lo0), subset_and<B, S>(hi0));
            if constexpr (TWO) mma_popc(d, a1, subset_and<B, S>(lo1), subset_and<B, S>(hi1));
            acc[S][0] = d[0] + k8 * d[2];
            acc[S][1] = d[1] + k8 * d[3];
        }
        popc_step<B, R, TWO, S + 1>(acc, k8, a0, lo0, hi0, a1, lo1, hi1);
    }
}

// A warp's share of k-steps [k0, k1) (k0 even) for 8 rows: lane (g, t) reads row g's planes;
// px: the piece that starts at k-step `base`. Work units are full chunks, then single 8-word
// k-steps; the warp takes units part, part + parts, ... of the piece.
// rp: 8 plane pointers, the lane's row's words `at` on from theirs (`lane_rows`). HOLD: rows that
// lie in one slab stream from pointers held in registers (below).
template <int B, int R, bool HOLD, int NS>
__device__ void popc_rows(const RowPtr* rp, int at, int words, int k0, int k1, int base, int part,
                          int parts, const PopcX* px, int (&acc)[NS][R]) {
    const int lane = threadIdx.x & 31, t = lane & 3, chunks = words / 16;
    const int k8 = lane >> 2 == 7 ? -256 : 256;  // R = 2: x plane g + 8's weight against g's
    const int u_end = min(chunks, k1 / 2);
#ifdef PWCTL_POPC_NO_STREAM  // timing probe, never built by pwctl: no plane loads, no mma
    return;
#endif
    // Loads at the top of each chunk: a chunk in flight a warp. Measured slower on the H200
    // (decisions/019): the next chunk in registers too (3 CTAs an SM), L2 prefetches
    // 2 or 4 chunks ahead, a 4-stage cp.async ring in shared memory.
    // row_of(p, w): where words w .. w + 3 of plane p lie (w % 4 == 0: one side of a split)
    const auto stream = [&](auto row_of) {
        const auto quad = [&](int p, int w) { return __ldg((const uint4*)row_of(p, w)); };
        for (int u = k0 / 2 + part; u < u_end; u += parts) {
            uint4 q[B];
            #pragma unroll
            for (int p = 0; p < B; ++p) q[p] = quad(p, 16 * u + 4 * t);
            if constexpr (R == 4) {  // a k-step a call, as the code was before R = 2: a rewrite
                // with unchanged registers made the 4-bit kernels 4% slower (120.5 -> 125.5 us)
                #pragma unroll
                for (int s = 0; s < 2; ++s) {
                    u32 lo[B], hi[B];
                    #pragma unroll
                    for (int p = 0; p < B; ++p)
                        lo[p] = s ? q[p].z : q[p].x, hi[p] = s ? q[p].w : q[p].y;
                    const uint4 a = __ldg(&px->a[2 * u + s - base][lane]);
                    popc_step<B, R, false>(acc, k8, a, lo, hi, a, lo, hi);
                }
            } else {
                u32 lo[2][B], hi[2][B];
                #pragma unroll
                for (int p = 0; p < B; ++p)
                    lo[0][p] = q[p].x, hi[0][p] = q[p].y, lo[1][p] = q[p].z, hi[1][p] = q[p].w;
                popc_step<B, R, true>(acc, k8, __ldg(&px->a[2 * u - base][lane]), lo[0], hi[0],
                                      __ldg(&px->a[2 * u + 1 - base][lane]), lo[1], hi[1]);
            }
        }
        // 8-word k-steps past the full chunks (the piece's part of them), 8-byte loads
        const int first = max(k0, 2 * chunks);
        for (int ks = first + part; ks < k1; ks += parts) {
            const int w = step_word(ks, chunks, t);
            u32 lo[B], hi[B];
            #pragma unroll
            for (int p = 0; p < B; ++p) {
                const uint2 v = w < words ? __ldg((const uint2*)row_of(p, w)) : make_uint2(0u, 0u);
                lo[p] = v.x, hi[p] = v.y;
            }
            const uint4 a = __ldg(&px->a[ks - base][lane]);
            popc_step<B, R, false>(acc, k8, a, lo, hi, a, lo, hi);
        }
    };
    // HOLD (`hold_rows`): rows that lie in one slab (every row of a Mixtral gate or up block: its
    // groups tile the slabs) stream from pointers held in registers. Read from shared memory at
    // each chunk, the one-token 4-bit gate_up's own rows' pointers meet in 4-way bank conflicts
    // (Mixtral 4 bits, one token: 93.3 -> 91.7 us held there, 90.5 held in every 4-bit build;
    // decisions/026). Otherwise, and for rows that straddle a slab edge, the side is
    // chosen at each load.
    const volatile RowPtr* vr = rp;
    bool flat = HOLD;
    #pragma unroll
    for (int p = 0; p < B; ++p) flat = flat && vr[p].split >= words;
    if (HOLD && __all_sync(0xffffffffu, flat)) {
        const u32* row[B];
        #pragma unroll
        for (int p = 0; p < B; ++p) row[p] = vr[p].p0 + at;
        stream([&](int p, int w) { return row[p] + tiled(w); });
    } else {
        stream([&](int p, int w) {
            const volatile RowPtr& r = vr[p];
            return (w < r.split ? r.p0 : r.p1) + at + tiled(w);
        });
    }
}

// c_S of one row's table at width B: S a plane subset (bit p: plane p, which holds label bit
// B - 1 - p, so a subset's label is its bits reversed), the Moebius transform in registers, fp32.
// Computed where the fold needs them, after the streaming: in a CTA's prologue they cost 13 us of
// a Mixtral layer's gate_up (decisions/019).
__host__ __device__ constexpr int reversed(int v, int bits) {
    int r = 0;
    for (int i = 0; i < bits; ++i) r |= ((v >> i) & 1) << (bits - 1 - i);
    return r;
}

template <int B>
__device__ __forceinline__ void row_coef(const unsigned short* tbl, float (&c)[1 << B]) {
    #pragma unroll
    for (int S = 0; S < (1 << B); ++S) c[S] = h2f(tbl[reversed(S, B)]);
    #pragma unroll
    for (int p = 0; p < B; ++p)
        #pragma unroll
        for (int S = 0; S < (1 << B); ++S)
            if (S >> p & 1) c[S] -= c[S ^ (1 << p)];
}

// The same for the 8 rows of a group at once, into coef[row][S] (16 a row), the warp's lanes
// sharing the work: lane (r, q) takes row r's subsets E q .. E q + E - 1 and the transform's
// steps over the bits of q by shuffles, where with `row_coef` the 8 lanes of a row pair repeat
// its transform. Fewer instructions, a longer chain: the few-token 3-bit build takes it (Mixtral,
// 2 tokens: 7% faster), and the others were 2-9% slower with it (the fold was 5-7% of a one-token
// Mixtral layer, most of it the coefficients: decisions/026).
template <int B>
__device__ __forceinline__ void group_coefs(const unsigned short (*tbl)[MAX_TABLE], float* coef) {
    constexpr int N = 1 << B, E = N >= 4 ? N / 4 : 1, LB = E == 4 ? 2 : E == 2 ? 1 : 0;
    const int lane = threadIdx.x & 31, r = lane >> 2, q = lane & 3;
    float c[E];
    #pragma unroll
    for (int e = 0; e < E; ++e) {
        const int S = E * q + e;
        c[e] = S < N ? h2f(tbl[r][reversed(S, B)]) : 0.f;  // (B = 1: lanes q = 2, 3 idle)
    }
    #pragma unroll
    for (int p = 0; p < LB; ++p)  // S's bits within the lane
        #pragma unroll
        for (int e = 0; e < E; ++e)
            if (e >> p & 1) c[e] -= c[e ^ (1 << p)];
    #pragma unroll
    for (int k = 0; k < B - LB; ++k)  // S's bits LB + k: bit k of q, the lane's neighbours
        #pragma unroll
        for (int e = 0; e < E; ++e) {
            const float o = __shfl_xor_sync(0xffffffffu, c[e], 1 << k);
            if (q >> k & 1) c[e] -= o;
        }
    __syncwarp();  // every lane has read the last group's
    #pragma unroll
    for (int e = 0; e < E; ++e)
        if (E * q + e < N) coef[16 * r + E * q + e] = c[e];
    __syncwarp();
}

// The integer sums of k-steps [i0, i1) of a piece into the lane's fp64 partials f[0] (row 2t of
// its 8-row group, whose tables are tbl), f[1] (row 2t + 1): acc[S] as popc_step leaves it. The
// empty subset's term goes in once a row: lanes g = 0 of the `first` warp. COOP: coefficients by
// `group_coefs`, in coef (the warp's scratch, 128 floats), else by `row_coef`.
template <int B, int R, bool COOP, int NS>
__device__ __forceinline__ void popc_fold(int (&acc)[NS][R], const unsigned short (*tbl)[MAX_TABLE],
                                          const PopcX* px, int i0, int i1, bool first,
                                          double (&f)[2], float* coef) {
#ifdef PWCTL_PROBE_NOFOLD  // timing probe, never built by pwctl: the sums, not the fold
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        int v = 0;
        #pragma unroll
        for (int S = 1; S < (1 << B); ++S) v += acc[S][r] + (R == 4 ? acc[S][2 + r] : 0);
        f[r] += v;
    }
    return;
#endif
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int wg = 1 << g, w8 = g == 7 ? -32768 : 1 << (g + 8);
    int q = 0;
    if (first) {  // a lane a k-step (i1 - i0 <= POPC_STEPS = 32): one load, not a chain of them
        q = i0 + lane < i1 ? __ldg(&px->ksum[i0 + lane]) : 0;
        q = __reduce_add_sync(0xffffffffu, q);
        q = g == 0 ? q : 0;
    }
    const double sx = __ldg(&px->sx);
    if constexpr (COOP) group_coefs<B>(tbl, coef);
    #pragma unroll
    for (int r = 0; r < 2; ++r) {  // one row's coefficients in registers at a time
        float own[1 << B] = {};
        if constexpr (!COOP) row_coef<B>(tbl[2 * t + r] + table_shift(B, r), own);  // (row parity r)
#ifdef PWCTL_PROBE_NOCOEF  // timing probe, never built by pwctl: no tables, no Moebius transform
        const auto c = [&](int S) { return 1.f + S * r; };
#else
        const auto c = [&](int S) { return COOP ? coef[16 * (2 * t + r) + S] : own[S]; };
#endif
        double v = (double)c(0) * q;
        #pragma unroll
        for (int S = 1; S < (1 << B); ++S) {
            int n;
            if constexpr (R == 4) n = wg * acc[S][r] + w8 * acc[S][2 + r];
            else n = wg * acc[S][r];  // x plane g + 8 is in already
            v += (double)c(S) * (double)n;
        }
        f[r] += sx * v;
    }
}

// A warp's scratch for the fold's coefficients (`group_coefs`) in its CTA's `red` (16-byte
// aligned), past the floats `popc_rows_sum` adds there (WARPS x 2 ROWS).
__device__ __forceinline__ float* fold_scratch(float* red) {
    return red + 2 * WARPS * ROWS + 128 * (threadIdx.x >> 5);
}
static_assert(RED_FLOATS >= 2 * WARPS * ROWS + 128 * WARPS, "red holds the fold's coefficients");

// Run-time width -> template: one piece of one 8-row group (B <= MAXB). landing: the tables are
// on their way (`restage`, or `stage_two` keeping sources; every thread of the CTA passes here
// with it). COOP, coef: `popc_fold`'s.
template <int MAXB, int R, bool HOLD, bool COOP>
__device__ __forceinline__ void popc_piece(int B, const RowPtr* rp, int at,
                                           const unsigned short (*tbl)[MAX_TABLE],
                                           int words, int k0, int k1, int base, int part,
                                           int parts, const PopcX* px, double (&f)[2],
                                           float* coef, bool landing = false) {
    int acc[1 << MAXB][R] = {};  // a subset of the MAXB planes each (acc[0] unused)
    switch (B) {
#define POPC_CASE(W)                                                                              \
    case W:                                                                                       \
        if constexpr (W <= MAXB) {                                                                \
            popc_rows<W, R, HOLD>(rp, at, words, k0, k1, base, part, parts, px, acc);            \
            if (landing) tables_landed();                                                         \
            popc_fold<W, R, COOP>(acc, tbl, px, k0 - base, k1 - base, part == 0, f, coef);        \
        }                                                                                         \
        break;
        POPC_CASE(1) POPC_CASE(2) POPC_CASE(3) POPC_CASE(4) POPC_CASE(5)
#undef POPC_CASE
    }
}

// The warp's partials of 8-row group `grp` summed over its lanes into out[8 grp .. + 7].
__device__ __forceinline__ void popc_warp_rows(double (&f)[2], int grp, float* out) {
    const int lane = threadIdx.x & 31;
    #pragma unroll
    for (int d = 4; d < 32; d <<= 1) {
        f[0] += __shfl_xor_sync(0xffffffffu, f[0], d);
        f[1] += __shfl_xor_sync(0xffffffffu, f[1], d);
    }
    if (lane < 4) {
        out[8 * grp + 2 * lane] = (float)f[0];
        out[8 * grp + 2 * lane + 1] = (float)f[1];
    }
}

// The lanes' partials of 8-row group `grp` (rows 8 grp .. + 7 of the CTA) summed over lanes and
// over the `parts` warps that split its columns: rows[r] for the CTA's rows. Barrier at the end.
__device__ void popc_rows_sum(double (&f)[2], int grp, int part, float (*red)[32], float* rows,
                              int nrows) {
    popc_warp_rows(f, grp, red[part]);
    __syncthreads();
    const int parts = WARPS * 8 / nrows;  // warps per 8-row group
    if (threadIdx.x < nrows) {
        float v = 0.f;
        for (int p = 0; p < parts; ++p) v += red[p][threadIdx.x];
        rows[threadIdx.x] = v;
    }
    __syncthreads();
}

// A split tile's halves meet here. Each leaves its rows in `sum`; the second to arrive adds the
// first's into `rows` (true: it stores h) and resets the ticket for the next call.
__device__ bool split_join(const Split& sp, const TileEnd& c, float (&rows)[2][ROWS]) {
    __shared__ int last;
    float* mine = sp.sum + ((i64)c.idx * 2 + c.kz) * 2 * ROWS;
    const float* other = sp.sum + ((i64)c.idx * 2 + (c.kz ^ 1)) * 2 * ROWS;
    if (threadIdx.x < 2 * ROWS) mine[threadIdx.x] = rows[threadIdx.x / ROWS][threadIdx.x % ROWS];
    __threadfence();  // the rows before the ticket
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(sp.ticket + c.idx, 1) == 1;
    __syncthreads();
    if (!last) return false;
    __threadfence();  // the other half's rows after its ticket
    if (threadIdx.x < 2 * ROWS)
        rows[threadIdx.x / ROWS][threadIdx.x % ROWS] += __ldcg(other + threadIdx.x);
    if (threadIdx.x == 0) sp.ticket[c.idx] = 0;
    __syncthreads();
    return true;
}

// Registers a subset holds across the loop (popc_step): 2 where that buys a CTA an SM, the
// one-token 3-bit build (6 CTAs an SM against 5: Mixtral 3 bits, one token, 93.9 -> 90.2 us);
// elsewhere the fragment's 4 (the 4-bit builds were 1.5-2% slower with 2 at 4 CTAs and spilled at
// 5; `pnb3` at 6 CTAs was 3% slower in the routed 4-token call; decisions/021).
__host__ __device__ constexpr int popc_regs(int maxb, bool few) {
    return maxb != 4 && !few ? 2 : 4;  // (the 5-bit build's 31 subsets: 2 registers a subset)
}

// Which builds fold with `group_coefs` (popc_fold's COOP): the few-token one up to 3 bits.
__host__ __device__ constexpr bool coop_fold(int maxb, bool few) { return maxb <= 3 && few; }

// Which builds stream rows in one slab from pointers held in registers (popc_rows' HOLD): the
// 4-bit ones; the builds up to 3 bits spilled with them.
__host__ __device__ constexpr bool hold_rows(int maxb) { return maxb == 4; }

// The plane pointers popc_rows reads for 8-row group `grp` of a tile: the group's row 0's, which
// every lane reads at once (a tiled group's rows share their split: row g's words are 4 g on, and
// `stage` keeps a group's pointers within one group of the plane past the tile's rows too);
// OWN: each lane its own row's, which meet in 4-way bank conflicts (so `popc_rows` holds them in
// registers, HOLD, for rows in one slab). The one-token 4-bit gate_up takes OWN: the other form
// left it 64 bytes of spills in the fold and 2.5% slower, where the rest gained 1-4%
// (decisions/025).
template <bool OWN>
__device__ __forceinline__ const RowPtr* lane_rows(const Stage& st, int grp) {
    return st.ptr + (8 * grp + (OWN ? (threadIdx.x & 31) >> 2 : 0)) * 8;
}

// gate_up for one-token slots: the CTA's 16 rows of gate and up, then h as `gate_up` stores it.
// px: x's pieces (popc_planes), a row per token. Blocks wider than MAXB bits take `mma_block` (the
// lookup) on the fragment-order x. MAXB = 4: `gate_up_p1`; MAXB = 3: `gate_up_p1b3`, whose
// accumulators take a quarter of the registers (7 subsets, popc_regs), so that 6 CTAs an SM fit
// instead of 4 (the launcher takes it when no block of the layer is wider than 3 bits: more warps
// an SM are more loads in flight, decisions/021).
template <int MAXB, bool FEW>
__device__ void gate_up_popc(Paged g, Slots s, Run run, const uint4* xf, unsigned short* hp, int I,
                             int words_in, int wpad_in, int wpad_out, i64 bits_nbytes, int rpt,
                             const PopcX* px, Split sp) {
    __shared__ Stage st[2];
    __shared__ __align__(16) float red[RED_FLOATS];
    __shared__ float rows[2][ROWS];
    __shared__ Run share;  // read where needed: held in registers across the streaming, it spilled
    // by tile parity: a tile's end is read before the next tile but one stages (a barrier), and
    // only then does thread 0 write that tile's
    __shared__ TileEnd ends[2];
    STAMP(0, 0);
    if constexpr (!FEW)
        if (threadIdx.x == 0) share = run;
    prefetch_ids(g, s);
    wait_previous();  // the slots and x's pieces come from the prep launch
    start_next();
    if constexpr (!FEW) __syncthreads();
    STAMP(0, 1);
    // FEW grids hold a tile a CTA (the loop runs once, and the compiler knows it): their state
    // stays in registers, as before the shares (read from shared memory it cost `pnb3` 1-14%)
    const auto last = [&] { return FEW ? run.a + 2 : share.b; };
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int wg = 0, wu = 0;  // the widths of the blocks st holds
    for (int h = FEW ? run.a : share.a; h < last();) {
        const int at = h >> 1, kz = h & 1, kn = kz == 0 && h + 2 <= last() ? 1 : 2;
        // a tile after the share's first stays in st's block (every share walks its tiles in order)
        const bool after = !FEW && at > share.a >> 1;
        h += kn == 1 ? 2 : 1;
        const int tiles = FEW ? run.tiles : share.tiles;
        const Tile c = tile_of(s, ROWS, at / tiles, at % tiles);
        const int e = __ldg(s.expert + c.slot);  // (out with the slot's bounds, not after them)
        if (c.T <= 0) continue;
        // FEW (`gate_up_pn`: calls of up to POPC_MAX_TOKENS tokens; one tile a CTA): a slot of
        // several tokens takes the lookup, whose work does not grow with tokens as the binary
        // mma's does. Compiled out of the one-token build: there it took 8 bytes of stack (121
        // against 117-118 us, one run)
        if constexpr (FEW)
            if (c.T > 1) {
                gate_up_tile<1>(g, s, c, st, red, xf, hp, I, words_in, wpad_in, wpad_out,
                                bits_nbytes, rpt);
                continue;  // FEW grids hold a tile a CTA: nothing to restage after it
            }
        const int nrows = min(ROWS, I - c.row0);
        if (nrows <= 0) {  // a tile of h's padding columns: zeros
            if (threadIdx.x < ROWS) store_h(hp, c.lo, c.row0 + threadIdx.x, I, wpad_out, 0.f, 0.f);
            continue;
        }
        TileEnd end{c.lo, c.row0, kz, kn, (FEW ? run.j : share.j) + 1 - kz};
        if constexpr (!FEW)  // (a tile a CTA: in registers, as it fits there)
            if (threadIdx.x == 0) ends[at & 1] = end;
        const int token = __ldg(s.token + c.lo);
        STAMP_AFTER(0, 4, e);
        // the next tile of the block st holds (tile at - 1, which is full when this one is and
        // shares its slot), its sources kept: no chain
        const bool moved = after && c.row0 > 0 && nrows == ROWS &&
                           max(wg, wu) <= min(MAXB, KEEPS_SOURCES);
        bool flat = true;  // (only the lookup asks, and a moved tile's blocks never take it)
        if (moved) {
            restage(g, __ldg(s.block_ids + 3 * e), wg, bits_nbytes, words_in, rpt, c.row0, st[0]);
            restage(g, __ldg(s.block_ids + 3 * e + 1), wu, bits_nbytes, words_in, rpt, c.row0,
                    st[1]);
            __syncthreads();
        } else {
            flat = stage_gate_up(g, s, e, bits_nbytes, words_in, rpt, c.row0, nrows, st, wg, wu,
                                 true);
        }
        STAMP(0, 2);
        const int ks = popc_steps(words_in);
        const PopcX* x = px + (i64)token * popc_pieces(words_in);
        const int grp = warp & 1;
        constexpr int R = popc_regs(MAXB, FEW);
        constexpr bool OWN = MAXB == 4 && !FEW;  // (lane_rows)
        constexpr bool HOLD = hold_rows(MAXB), COOP = coop_fold(MAXB, FEW);
        if (max(wg, wu) <= MAXB) {
            // gate on warps 0-1, up on 2-3 (8-row group warp % 2), each warp every chunk of its
            // rows in the tile's share: one fold a warp and tile, one barrier. Gate then up on all
            // 4 warps (a column half a warp, a fold every 4 chunks, 4 barriers) was 6% slower at
            // one token (decisions/026). A split tile's halves take alternate chunks.
            const int m = warp >> 1;
            double f[2] = {};
            for (int k0 = 0, i = 0; k0 < ks; k0 += POPC_STEPS, ++i)
                popc_piece<MAXB, R, HOLD, COOP>(m ? wu : wg, lane_rows<OWN>(st[m], grp),
                                                OWN ? 0 : lane & ~3, st[m].tbl + 8 * grp, words_in,
                                                k0, min(ks, k0 + POPC_STEPS), k0, kz, kn, x + i, f,
                                                fold_scratch(red), i == 0);
#ifndef PWCTL_STAMPS_CHAIN
            STAMP(0, 3);
#endif
            popc_warp_rows(f, grp, rows[m]);
            __syncthreads();
#ifndef PWCTL_STAMPS_CHAIN  // (phase 6 stamps stage_two's quotients there)
            STAMP(0, 6);
#endif
        } else {
            // a block wider than MAXB: both by the lookup (token 0 of n-tile 0 is fragment register
            // w of lanes 4i), which reads every width; a popc path beside the one above for the
            // narrower block spilled 40 bytes
            tables_landed();  // (a block of up to KEEPS_SOURCES bits staged its tables by cp.async)
            const int kpart = kz * 2 + (warp >> 1), kparts = 2 * kn;
            int xrow[1] = {lane >> 2 == 0 ? token : -1};
            #pragma unroll 1
            for (int m = 0; m < 2; ++m) {
                float acc[1][4], sum[2][1];
                mma_block<1>(st[m], m ? wu : wg, flat, words_in, wpad_in, xf, xrow, 1,
                             (kpart >> 1) * WARPS + warp, kparts / 2 * WARPS, acc);
                reduce_units<1>(acc, red, WARPS, sum);
                if ((lane & 3) == 0 && (warp & 1) == 0)
                    rows[m][(lane >> 2) + 8 * (warp >> 1)] = sum[0][0];
                __syncthreads();
            }
        }
        if constexpr (!FEW) end = ends[((h - 1) >> 1) & 1];  // this tile's (h has moved on)
        if (end.kn > 1 && !split_join(sp, end, rows))
            continue;  // the other half stores h
        if (threadIdx.x < ROWS)
            store_h(hp, end.lo, end.row0 + threadIdx.x, I, wpad_out, rows[0][threadIdx.x],
                    rows[1][threadIdx.x]);
    }
    STAMP(0, 7);
}

// Chunks a warp of down_popc pulls into L2 before its wait: 2 took 0.5-1.5 us off one-token
// layers, 1 less, 8 (a Qwen warp's whole slice) nothing (decisions/027).
#define DOWN_PREFETCH_CHUNKS 2

// Before its wait a down_popc warp pulls into L2 the first `n` chunks it streams after it (units
// u0, u0 + step, ... below u_end, `popc_rows`' order): a chunk of an 8-row group's plane is 4
// lines of 128 bytes (docs/FORMAT.md, tiled), so 4 wd lanes a chunk. rp: the group's row 0.
__device__ void prefetch_chunks(const RowPtr* rp, int wd, int words, int u0, int u_end, int step,
                                int n) {
    for (int l = threadIdx.x & 31; l < 4 * wd * n; l += 32) {
        const int q = l & 3, p = (l >> 2) % wd, u = u0 + (l >> 2) / wd * step;
        if (u < u_end) prefetch_l2(word_ptr(rp[p], 16 * u + 4 * q));
    }
}

// down for one-token slots: `units` m-tiles of 16 rows (8-row groups over the warps, which
// split the columns when there are fewer groups than warps), columns split kn ways (this CTA:
// kz). hpx: h's pieces (popc_planes), a row per pair. Blocks wider than MAXB: the lookup.
template <int MAXB, bool FEW>
__device__ void down_popc(Paged g, Slots s, int slot, int tile, int kz, int kn, const uint4* hp,
                          float* out, int H, int words_in, int wpad_in, i64 bits_nbytes, int rpt,
                          int units, const PopcX* hpx) {
    __shared__ Stage st[2];
    __shared__ __align__(16) float red[RED_FLOATS];
    __shared__ float rows[2 * ROWS];
    STAMP(1, 0);
    const Tile c = tile_of(s, ROWS * units, slot, tile);
    if (c.T <= 0 || c.row0 >= H) return;
    if constexpr (FEW)  // as in gate_up_popc: the lookup, on h from gate_up_tile
        if (c.T > 1)
            return down_tile<1>(g, s, c, kz, kn, st, red, hp, out, H, words_in, wpad_in,
                                bits_nbytes, rpt, units);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int e = __ldg(s.expert + c.slot);
    int wd;
    const bool flat = stage_down(g, s, e, bits_nbytes, words_in, rpt, c.row0, units, H, st, wd);
    STAMP(1, 2);
    const int nrows = ROWS * units;
    if (wd <= MAXB) {
        const int groups = 2 * units, parts = WARPS / groups;
        const int grp = warp % groups, part = warp / groups, unit = grp >> 1;
        const RowPtr* rp = lane_rows<false>(st[unit], grp & 1);
        const int ks = popc_steps(words_in);
        const int per = ((ks + kn - 1) / kn + 1) & ~1;  // even: a slice starts on a full chunk
        const int lo = min(ks, kz * per), hi = min(ks, lo + per);
        const PopcX* x = hpx + (i64)c.lo * popc_pieces(words_in);
        constexpr int R = popc_regs(MAXB, FEW);
        constexpr bool HOLD = hold_rows(MAXB), COOP = coop_fold(MAXB, FEW);
        if (c.row0 + ROWS * unit < H)
            prefetch_chunks(rp, wd, words_in, lo / 2 + part, min(words_in / 16, hi / 2), parts,
                            DOWN_PREFETCH_CHUNKS);
        wait_previous();  // h's pieces come from popc_planes
        STAMP(1, 1);
        double f[2] = {};
        if (c.row0 + ROWS * unit < H)
            for (int k0 = lo; k0 < hi;) {  // the slice's parts of the pieces it meets
                const int i = k0 / POPC_STEPS, k1 = min(hi, (i + 1) * POPC_STEPS);
                popc_piece<MAXB, R, HOLD, COOP>(wd, rp, lane & ~3, st[unit].tbl + 8 * (grp & 1),
                                                words_in, k0, k1, i * POPC_STEPS, part, parts,
                                                x + i, f, fold_scratch(red));
                k0 = k1;
            }
        STAMP(1, 3);
        popc_rows_sum(f, grp, part, (float (*)[2 * ROWS])red, rows, nrows);
        STAMP(1, 4);
    } else {  // the lookup, as `down` does it for n-tile 0
        const int parts = WARPS / units, unit = warp / parts;
        int xrow[1] = {lane >> 2 == 0 ? c.lo : -1};
        wait_previous();
        float acc[1][4] = {}, sum[2][1];
        if (c.row0 + ROWS * unit < H)
            mma_block<1>(st[unit], wd, flat, words_in, wpad_in, hp, xrow, 1,
                         kz * parts + warp % parts, kn * parts, acc);
        reduce_units<1>(acc, red, parts, sum);
        if ((lane & 3) == 0 && (warp & 1) == 0)
            for (int u = 0; u < units; ++u) rows[ROWS * u + (lane >> 2) + 8 * (warp >> 1)] = sum[u][0];
        __syncthreads();
    }
    if (threadIdx.x < nrows && c.row0 + threadIdx.x < H)
        atomicAdd(out + (i64)__ldg(s.token + c.lo) * H + c.row0 + threadIdx.x,
                  __ldg(s.weight + c.lo) * rows[threadIdx.x]);
    STAMP(1, 7);
}

// ---- prefill: decode once into shared memory, multiply with every token -----------------------
//
// A CTA owns 4 m-tiles (gate_up: 2 of gate and the same 2 of up, 32 rows; down: 4, 64 rows) and
// up to 128 tokens of one slot. Per 8-word chunk of columns, warp q decodes m-tile q exactly as
// the decode kernels do (same lanes, same k-steps) into shared memory; then every warp multiplies
// all 4 m-tiles with its own 4 n-tiles (a B fragment serves 4 m-tiles, an A fragment 4 n-tiles).
// Two chunk buffers: decoding chunk i + 1 (ALU) overlaps the mma of chunk i (tensor cores).
// Measured on the H200 and not kept: 8 warps of 2 n-tiles each, plane words and B fragments
// loaded a step ahead.
#define PF_WARPS 4
#define PF_NTW 4   // n-tiles per warp
#define PF_TOKENS (8 * PF_NTW * PF_WARPS)  // tokens per pass: 128
#define PF_STEPS 16  // mma k-steps per chunk: 2 words x 4 phases x 2 halves

struct Prefill {
    Stage st[PF_WARPS];                   // warp q's m-tile
    uint4 a[2][PF_WARPS][PF_STEPS][32];   // A fragments of a chunk: [buffer][m-tile][k-step][lane]
};

template <int B>
__device__ void decode_chunk(const Stage& st, int it, int words, uint4 (&a)[PF_STEPS][32]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    u32 L0[8], L1[8];
    if constexpr (B <= 4) {
        lut_from(st.tbl[g], B, L0);
        lut_from(st.tbl[g + 8], B, L1);
    }
    u32 P[2][2][8];
    const int w = 8 * it + 2 * t;
    load_words<B>(st.ptr + g * 8, w, words, P[0][0], P[0][1]);
    load_words<B>(st.ptr + (g + 8) * 8, w, words, P[1][0], P[1][1]);
    #pragma unroll
    for (int u = 0; u < 2; ++u) {
#define PHASE(C)                                                                                  \
        {                                                                                         \
            u32 A0[4], A1[4];                                                                     \
            decode<B, C, true>(P[0][u], L0, st.tbl[g], A0);                                       \
            decode<B, C, true>(P[1][u], L1, st.tbl[g + 8], A1);                                   \
            a[(4 * u + C) * 2][lane] = make_uint4(A0[0], A1[0], A0[1], A1[1]);                    \
            a[(4 * u + C) * 2 + 1][lane] = make_uint4(A0[2], A1[2], A0[3], A1[3]);                \
        }
        PHASE(0) PHASE(1) PHASE(2) PHASE(3)
#undef PHASE
    }
}

// live: the m-tile has a row in range (else it was never staged, and its fragments are zeros).
__device__ void decode_chunk_any(const Stage& st, int B, bool live, int it, int words,
                                 uint4 (&a)[PF_STEPS][32]) {
    if (!live) {
        const int lane = threadIdx.x & 31;
        for (int k = 0; k < PF_STEPS; ++k) a[k][lane] = make_uint4(0u, 0u, 0u, 0u);
        return;
    }
    switch (B) {
#define CASE(W) case W: decode_chunk<W>(st, it, words, a); break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
    }
}

// acc[m][j] = W[m-tile m] x^T for n-tile (warp + 4j) of the pass, over all columns. The m-tiles
// are staged in sm.st by the caller (warp q: m-tile q, width wq, live: any row in range). ntok:
// the pass's tokens; xrow: each lane's activation row per n-tile, lanes past the pass's tokens
// naming a live one (finite; the output columns they make are never stored).
__device__ void prefill_mma(Prefill& sm, int wq, bool live, int words, int wpad, const uint4* xf,
                            const int (&xrow)[PF_NTW], int ntok, float (&acc)[4][PF_NTW][4]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, t = lane & 3;
    const int iters = (words + 7) / 8;
    #pragma unroll
    for (int m = 0; m < 4; ++m)
        #pragma unroll
        for (int j = 0; j < PF_NTW; ++j) acc[m][j][0] = acc[m][j][1] = acc[m][j][2] = acc[m][j][3] = 0.f;
    // n-tiles of this warp that hold a token: a prefix, warp-uniform (empty ones skip their mma)
    int live_j = 0;
    const uint4* xb[PF_NTW];
    #pragma unroll
    for (int j = 0; j < PF_NTW; ++j) {
        live_j += 8 * (warp + PF_WARPS * j) < ntok ? 1 : 0;
        xb[j] = xf + (i64)xrow[j] * wpad * 4 + 8 * t;
    }
    decode_chunk_any(sm.st[warp], wq, live, 0, words, sm.a[0][warp]);
    __syncthreads();
    for (int it = 0; it < iters; ++it) {
        if (it + 1 < iters) decode_chunk_any(sm.st[warp], wq, live, it + 1, words, sm.a[(it + 1) & 1][warp]);
        const uint4 (*a)[PF_STEPS][32] = sm.a[it & 1];
        // k-step pair s (= 4u + c) takes B piece 4u + c of the lane's words 8it + 2t, 8it + 2t + 1.
        // The mma run m-tiles innermost, so no two adjacent mma share an accumulator (7-10% faster
        // than n-tiles innermost; loading the next pair's B ahead as well measured slower)
        #pragma unroll
        for (int s = 0; s < PF_STEPS / 2; ++s) {
            uint4 b[PF_NTW];
            #pragma unroll
            for (int j = 0; j < PF_NTW; ++j) b[j] = __ldg(xb[j] + 32 * it + s);
            uint4 af[2][4];  // [k-step 2s + h][m-tile]
            #pragma unroll
            for (int m = 0; m < 4; ++m) {
                af[0][m] = a[m][2 * s][lane];
                af[1][m] = a[m][2 * s + 1][lane];
            }
            #pragma unroll
            for (int h = 0; h < 2; ++h)
                #pragma unroll
                for (int j = 0; j < PF_NTW; ++j)
                    if (j < live_j)
                        #pragma unroll
                        for (int m = 0; m < 4; ++m) {
                            const uint4 f = af[h][m];
                            mma16816(acc[m][j], f.x, f.y, f.z, f.w, h ? b[j].z : b[j].x, h ? b[j].w : b[j].y);
                        }
        }
        __syncthreads();
    }
}

__device__ __forceinline__ void check_smem(unsigned need) {
    unsigned have;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(have));
    if (have < need) __trap();  // the launcher's size (kernels.PREFILL_SMEM) is out of date
}

// The kernel's dynamic shared memory as a T (the launcher sized it: kernels.PREFILL*_SMEM).
template <class T>
__device__ __forceinline__ T& shared_as() {
    extern __shared__ __align__(16) unsigned char smem[];
    check_smem(sizeof(T));
    return *reinterpret_cast<T*>(smem);
}

// Pass and tile of a prefill CTA: blockIdx.x = row tile * passes + pass (passes fastest).
__device__ __forceinline__ Tile prefill_tile(const Slots& s, int passes, int rows_per_cta) {
    Tile c;
    c.slot = blockIdx.y;
    c.lo = __ldg(s.lo + c.slot);
    c.T = __ldg(s.hi + c.slot) - c.lo;
    c.base = (blockIdx.x % passes) * PF_TOKENS;
    c.row0 = (blockIdx.x / passes) * rows_per_cta;
    return c;
}

// The token of the slot (0 = its first) whose activation row a lane reads in n-tile j of the
// pass; lanes past the pass's tokens read its first one (see `prefill_mma`).
__device__ __forceinline__ int pass_token(const Tile& c, int j) {
    const int k = c.base + 8 * ((threadIdx.x >> 5) + PF_WARPS * j) + ((threadIdx.x & 31) >> 2);
    return k < c.T ? k : c.base;
}

// gate_up for prefill: 32 rows (warps 0, 1: gate rows 0-15, 16-31; warps 2, 3: up), then h
// as in `gate_up`. Dynamic shared memory: sizeof(Prefill).
__device__ void gate_up_prefill(Paged g, Slots s, const uint4* xf, unsigned short* hp, int I,
                                int words_in, int wpad_in, int wpad_out, i64 bits_nbytes, int rpt,
                                int passes) {
    Prefill& sm = shared_as<Prefill>();
    const Tile c = prefill_tile(s, passes, 2 * ROWS);
    if (c.base >= c.T) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int e = __ldg(s.expert + c.slot);
    const int block = __ldg(s.block_ids + 3 * e + (warp >> 1)), wq = __ldg(g.width + block);
    const int mrow0 = c.row0 + ROWS * (warp & 1), nrows = min(ROWS, I - mrow0);
    if (nrows > 0) stage(g, block, wq, bits_nbytes, words_in, rpt, mrow0, nrows, sm.st[warp], lane, 32);
    __syncwarp();
    int xrow[PF_NTW];
    #pragma unroll
    for (int j = 0; j < PF_NTW; ++j) xrow[j] = __ldg(s.token + c.lo + pass_token(c, j));
    float acc[4][PF_NTW][4];
    prefill_mma(sm, wq, nrows > 0, words_in, wpad_in, xf, xrow, c.T - c.base, acc);
    #pragma unroll
    for (int mt = 0; mt < 2; ++mt)
        #pragma unroll
        for (int j = 0; j < PF_NTW; ++j)
            #pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int row = c.row0 + ROWS * mt + (lane >> 2) + 8 * (r >> 1);
                const int k = c.base + 8 * (warp + PF_WARPS * j) + 2 * (lane & 3) + (r & 1);
                if (k < c.T) store_h(hp, c.lo + k, row, I, wpad_out, acc[mt][j][r], acc[2 + mt][j][r]);
            }
}

// down for prefill: 64 rows (warp q: rows 16q..16q+15), out[token] += weight * (down h).
__device__ void down_prefill(Paged g, Slots s, const uint4* hp, float* out, int H, int words_in,
                             int wpad_in, i64 bits_nbytes, int rpt, int passes) {
    Prefill& sm = shared_as<Prefill>();
    const Tile c = prefill_tile(s, passes, 4 * ROWS);
    if (c.base >= c.T || c.row0 >= H) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int e = __ldg(s.expert + c.slot);
    const int block = __ldg(s.block_ids + 3 * e + 2), wq = __ldg(g.width + block);
    const int mrow0 = c.row0 + ROWS * warp, nrows = min(ROWS, H - mrow0);
    if (nrows > 0) stage(g, block, wq, bits_nbytes, words_in, rpt, mrow0, nrows, sm.st[warp], lane, 32);
    __syncwarp();
    int xrow[PF_NTW];
    #pragma unroll
    for (int j = 0; j < PF_NTW; ++j) xrow[j] = c.lo + pass_token(c, j);
    float acc[4][PF_NTW][4];
    prefill_mma(sm, wq, nrows > 0, words_in, wpad_in, hp, xrow, c.T - c.base, acc);
    #pragma unroll
    for (int mt = 0; mt < 4; ++mt)
        #pragma unroll
        for (int j = 0; j < PF_NTW; ++j)
            #pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int row = c.row0 + ROWS * mt + (lane >> 2) + 8 * (r >> 1);
                const int k = c.base + 8 * (warp + PF_WARPS * j) + 2 * (lane & 3) + (r & 1);
                if (k < c.T && row < H)
                    atomicAdd(out + (i64)__ldg(s.token + c.lo + k) * H + row, __ldg(s.weight + c.lo + k) * acc[mt][j][r]);
            }
}

// ---- prefill on sm_90a: warpgroup mma straight from decoded registers ------------------------
//
// A CTA is one warpgroup (4 warps) and owns 64 rows (gate_up: warps 0, 1 gate rows r0..r0+31,
// warps 2, 3 the same rows of up; down: 64 rows) and up to 128 tokens of one slot. Warp q decodes
// its m-tile exactly as the decode kernels do, and those registers are the A operand of
// wgmma.m64n128k16: a warpgroup's register A fragment is four mma.m16n8k16 A fragments, warp q
// holding rows 16q..16q+15. The tokens (B) come from shared memory, bulk-copied from token
// tiles (`token_tiles`; fused_moe.wgmma_tiles is the reference): 128 tokens of one (slot, pass),
// columns in "wgmma order" (per 256-column chunk and k-step, the 16 columns whose weights the
// lanes' A registers hold), laid out exactly as shared memory holds them, so a half-chunk is one
// linear 32 KB copy. The work goes by half-chunks (8 k-steps, one plane word a lane and row): the
// warps decode half-chunk i + 1 into one of two A register sets while the tensor cores run
// half-chunk i from the other, and B is double-buffered the same way. Plane words come through a
// shared-memory ring 3 chunks ahead (widths 1-4, flat rows) or registers a chunk ahead.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WG_TOKENS 128                // tokens of a pass: the wgmma's N
#define WG_GROUPS (WG_TOKENS / 8)    // 8-token core-matrix groups
#define WG_KSTEPS 8                  // k-steps of a half-chunk
static_assert(WG_TOKENS == PF_TOKENS, "one tile plan (plan_tiles) serves both prefills");

struct PrefillWG {
    Stage st[4];  // warp q's m-tile
    // B of a half-chunk as K-major core matrices (8 tokens x 8 columns, 128 contiguous bytes):
    // [buffer][k-step][token group][columns 0-7 / 8-15][token]
    uint4 b[2][WG_KSTEPS][WG_GROUPS][2][8];
    unsigned long long full[2];  // mbarriers: buffer u's bulk copy has landed (one arrival a use)
};

// mbarrier helpers for the B buffers' bulk copies.
__device__ __forceinline__ void mbar_init(void* bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_u32(bar)), "r"(count)
                 : "memory");
}
__device__ __forceinline__ void mbar_wait(void* bar, u32 parity) {
    u32 done = 0;
    while (!done)
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;"
                     " selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(smem_u32(bar)), "r"(parity) : "memory");
}

// Shared-memory matrix descriptor of one k-step of B: no swizzle, the next 8 columns 128 bytes on
// (leading byte offset), the next 8 tokens 256 bytes on (stride byte offset).
__device__ __forceinline__ unsigned long long b_desc(const void* p) {
    return (unsigned long long)((smem_u32(p) & 0x3FFFF) >> 4) | (8ull << 16) | (16ull << 32);
}

// d += A B for one k-step: A the warpgroup's register fragments, B 128 tokens from shared memory.
__device__ __forceinline__ void wgmma_n128(float (&d)[64], const u32 (&a)[4],
                                           unsigned long long desc) {
#define D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]),         \
              "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
// PWCTL_PREFILL_N = 32 or 64: a timing probe, never built by pwctl (wrong results): an N-token
// wgmma on the tile's first tokens and B copies of N tokens' bytes, what a narrower tile for a
// slot's few tokens could save at most (decisions/018)
#if PWCTL_PREFILL_N == 32
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
        "{%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
        : D8(0), D8(8)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
    return;
#elif PWCTL_PREFILL_N == 64
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
        : D8(0), D8(8), D8(16), D8(24)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
    return;
#endif
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "{%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
        : D8(0), D8(8), D8(16), D8(24), D8(32), D8(40), D8(48), D8(56)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
#undef D8
}

__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N>  // until at most N committed groups of this warpgroup are still running
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");
}

// Keeps an A register set allocated until here (after the wait that retired its wgmma): the
// compiler cannot see that an issued wgmma still reads them.
__device__ __forceinline__ void hold(const u32 (&A)[WG_KSTEPS][4]) {
    #pragma unroll
    for (int s = 0; s < WG_KSTEPS; ++s)
        asm volatile("" :: "r"(A[s][0]), "r"(A[s][1]), "r"(A[s][2]), "r"(A[s][3]));
}

// Half-chunk hc of the pass's token tile into B buffer `buf`: the tile holds it as shared memory
// does, so it is one 32 KB bulk copy (Hopper's copy engine), issued by thread 0 and awaited by
// every thread on the buffer's mbarrier. Its completion is tracked apart from any plane loads, and
// no thread spends registers or issue slots on it.
__device__ __forceinline__ void load_b(PrefillWG& sm, int buf, const unsigned short* tile, int hc) {
    if (threadIdx.x != 0) return;
#ifdef PWCTL_PREFILL_N  // timing probe (wgmma_n128): B copies of N tokens' bytes
    const u32 bar = smem_u32(&sm.full[buf]), bytes = sizeof(sm.b[0]) * PWCTL_PREFILL_N / 128;
#else
    const u32 bar = smem_u32(&sm.full[buf]), bytes = sizeof(sm.b[0]);
#endif
#ifdef PWCTL_PREFILL_NO_B  // timing probe, never built by pwctl: B stays whatever it was
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
#else
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes)
                 : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
        :: "r"(smem_u32(&sm.b[buf][0][0][0][0])), "l"(tile + (i64)hc * (bytes / 2)), "r"(bytes),
           "r"(bar) : "memory");
#endif
}

// Where column `col` of token n (0..127) of a tile lies: wgmma order (position 256 it + 16 s + k
// of the row, the inverse of fused_moe.wgmma_order) in the shared-memory layout of `PrefillWG::b`,
// one half-chunk (128 positions) after another.
__device__ __forceinline__ i64 tile_pos(int n, int col) {
    const int w = col >> 5, c = col & 31, j = (c >> 2) & 3;
    const int k = 2 * ((w & 7) >> 1) + (j & 1) + 8 * (j >> 1), s = 2 * (c & 3) + (c >> 4);
    const int hc = 2 * (w >> 3) + (w & 1);
    return (i64)hc * 16384 + s * 2048 + (n >> 3) * 128 + (k >> 3) * 64 + (n & 7) * 8 + (k & 7);
}

// Plane word w of rows g, g + 8 at the warp's width (zeros for a dead m-tile). flat: no staged
// row of the CTA crosses a slab edge (see `load_word`).
__device__ __forceinline__ void wg_load(const Stage& st, int B, bool live, bool flat, int w,
                                        int words, u32 (&P0)[8], u32 (&P1)[8]) {
    const int g = (threadIdx.x & 31) >> 2;
    const RowPtr *r0 = st.ptr + g * 8, *r1 = st.ptr + (g + 8) * 8;
    switch (live ? B : 0) {
#define CASE(W)                                                                                   \
    case W:                                                                                       \
        if (flat) load_word<W, true>(r0, r1, w, words, P0, P1);                                   \
        else load_word<W, false>(r0, r1, w, words, P0, P1);                                       \
        break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
        default:
            #pragma unroll
            for (int p = 0; p < 8; ++p) P0[p] = P1[p] = 0u;
    }
}

// The A fragments of the 8 k-steps of one plane word (rows g in P0, g + 8 in P1).
template <int B>
__device__ __forceinline__ void decode_word(const u32 (&P0)[8], const u32 (&P1)[8],
                                            const u32 (&L0)[8], const u32 (&L1)[8], const Stage& st,
                                            u32 (&A)[WG_KSTEPS][4]) {
    const int g = (threadIdx.x & 31) >> 2;
    u32 f[4][2][4];  // [phase C][k-step 2C + h]
    decode_frags<B, 0, true>(P0, P1, L0, L1, st.tbl[g], st.tbl[g + 8], f[0]);
    decode_frags<B, 1, true>(P0, P1, L0, L1, st.tbl[g], st.tbl[g + 8], f[1]);
    decode_frags<B, 2, true>(P0, P1, L0, L1, st.tbl[g], st.tbl[g + 8], f[2]);
    decode_frags<B, 3, true>(P0, P1, L0, L1, st.tbl[g], st.tbl[g + 8], f[3]);
    #pragma unroll
    for (int s = 0; s < WG_KSTEPS; ++s)
        #pragma unroll
        for (int j = 0; j < 4; ++j) A[s][j] = f[s >> 1][s & 1][j];
}

__device__ __forceinline__ void wg_decode(const Stage& st, int B, bool live, const u32 (&P0)[8],
                                          const u32 (&P1)[8], const u32 (&L0)[8],
                                          const u32 (&L1)[8], u32 (&A)[WG_KSTEPS][4]) {
    switch (live ? B : 0) {
#define CASE(W) case W: decode_word<W>(P0, P1, L0, L1, st, A); break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
        default:
            #pragma unroll
            for (int s = 0; s < WG_KSTEPS; ++s) A[s][0] = A[s][1] = A[s][2] = A[s][3] = 0u;
    }
}

// What one warp streams: its m-tile (staged at width B; live: a row in range) and the pass's
// token tile.
struct WgJob {
    int B;
    bool live, flat;
    bool uniform;  // every warp of the CTA reads the same width (down always; gate_up mostly)
    int words;  // the row's plane words up to the job's last chunk
    int c0;     // the job's first chunk (8 plane words; down's stream-K shares start mid-row)
    const unsigned short* tile;
#ifdef PWCTL_STAMPS
    int kind;  // the kernel's STAMP kind: 0 gate_up, 1 down
#endif
};

// Plane loads and decode of a half-chunk at width B and flatness FLAT fixed at compile time, or,
// for B = 0, chosen per warp at run time (gate and up at different widths). A dead m-tile loads
// zeros (no words); its rows are never stored.
template <int B, bool FLAT>
__device__ __forceinline__ void wg_load_at(const Stage& st, const WgJob& job, int w, u32 (&P0)[8],
                                           u32 (&P1)[8]) {
#ifdef PWCTL_PREFILL_NO_PLANES  // timing probe, never built by pwctl: words from the lane, no loads
    #pragma unroll
    for (int p = 0; p < 8; ++p) P0[p] = w * 0x9e3779b9u + p, P1[p] = P0[p] ^ threadIdx.x;
    return;
#endif
    if constexpr (B == 0) {
        wg_load(st, job.B, job.live, job.flat, w, job.words, P0, P1);
    } else {
        const int g = (threadIdx.x & 31) >> 2;
        const int words = job.live ? job.words : 0;
        load_word<B, FLAT>(st.ptr + g * 8, st.ptr + (g + 8) * 8, w, words, P0, P1);
    }
}

// Plane words w, w + 1 (w even) of rows g, g + 8: into P*a and P*b. FLAT rows (`wg_job`: every
// staged row of the CTA in one slab) take one 8-byte load a (row, plane); others two word loads.
template <int B, bool FLAT>
__device__ __forceinline__ void wg_load_pair(const Stage& st, const WgJob& job, int w,
                                             u32 (&Pa0)[8], u32 (&Pa1)[8], u32 (&Pb0)[8],
                                             u32 (&Pb1)[8]) {
#ifndef PWCTL_PREFILL_NO_PLANES
    if constexpr (B > 0 && FLAT) {
        const int g = (threadIdx.x & 31) >> 2;
        const RowPtr *r0 = st.ptr + g * 8, *r1 = st.ptr + (g + 8) * 8;
        const bool in = job.live && w < job.words;
        #pragma unroll
        for (int p = 0; p < 8; ++p) {
            const uint2 z = make_uint2(0u, 0u);
            const uint2 v0 = p < B && in ? __ldg((const uint2*)(r0[p].p0 + tiled(w))) : z;
            const uint2 v1 = p < B && in ? __ldg((const uint2*)(r1[p].p0 + tiled(w))) : z;
            Pa0[p] = v0.x, Pb0[p] = v0.y, Pa1[p] = v1.x, Pb1[p] = v1.y;
        }
        return;
    }
#endif
    wg_load_at<B, FLAT>(st, job, w, Pa0, Pa1);
    wg_load_at<B, FLAT>(st, job, w + 1, Pb0, Pb1);
}

template <int B>
__device__ __forceinline__ void wg_decode_at(const Stage& st, const WgJob& job, const u32 (&P0)[8],
                                             const u32 (&P1)[8], const u32 (&L0)[8],
                                             const u32 (&L1)[8], u32 (&A)[WG_KSTEPS][4]) {
    if constexpr (B == 0) wg_decode(st, job.B, job.live, P0, P1, L0, L1, A);
    else decode_word<B>(P0, P1, L0, L1, st, A);
}

// The sm_90a prefill streams a block's planes with few warps an SM (2 CTAs of 4), so each plane
// word waits on DRAM latency; from L2 it comes sooner. Every 4 chunks (8 units of each row: 8
// 128-byte lines of a tiled group, one unit of its 8 rows each), each lane asks L2 for one of the
// lines PF_AHEAD chunks on of its groups (rows g, g + 8: unit g of those 8) and planes t, t + 4
// (B: the m-tile's width). Measured (decisions/014, row-major planes: a line a row):
// Mixtral 7-19% faster, the Qwen shapes 1-5%. Also asking for the first lines at a tile's start,
// or 8 chunks ahead, was no better. The same prefetch made the decode kernels 1-7% slower and the
// mma.sync prefill (timed on the H200) 3x slower: they have none.
#define PF_AHEAD 4
__device__ __forceinline__ void prefetch_ahead(const Stage& st, int B, int words, int it) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int w = 8 * (it + PF_AHEAD) + 4 * g;
    if ((it & 3) || w >= words) return;
    #pragma unroll
    for (int p = t; p < 8; p += 4) {
        if (p >= B) break;
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const RowPtr rp = st.ptr[(g + 8 * h) * 8 + p];
            prefetch_l2(word_ptr(rp, w));
        }
    }
}

// Widths 1-4 on flat rows stream their plane words through a ring in shared memory instead of
// registers: RING_SLOTS chunks a warp, in the warp's table space (a width-4 table lives in
// registers, `lut_from`, once the loop starts). Each chunk is copied with `cp.async` RING_SLOTS - 1
// chunks ahead, so a plane word has ~6 half-chunks to arrive where a register load had one.
// A slot is [plane][row 0-15][8 words]; a lane reads rows g, g + 8 (rows g and g + 4 of a warp's
// read share banks: two-way conflicts).
#define RING_SLOTS 4
template <int B, bool FLAT>
constexpr bool kRing = B >= 1 && B <= 4 && FLAT;

// Where chunk c's slot of the warp's ring starts (shared-memory address).
template <int B>
__device__ __forceinline__ u32 ring_slot(const Stage& st, int c) {
    return smem_u32(&st.tbl[0][0]) + (c % RING_SLOTS) * (512 * B);
}

// Copy chunk c of the warp's 16 rows into its slot (lane: row lane / 2, words 4 (lane % 2) on),
// then commit a cp.async group (an empty one past the last chunk or for a dead m-tile).
template <int B>
__device__ __forceinline__ void ring_fill(const Stage& st, const WgJob& job, int c) {
    const int lane = threadIdx.x & 31, r = lane >> 1, h = lane & 1, w = 8 * c + 4 * h;
    const u32 dst = ring_slot<B>(st, c) + 32 * r + 16 * h;
    if (job.live && w < job.words) {  // (a row is whole 16-byte units)
        #pragma unroll
        for (int p = 0; p < B; ++p)
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
                         :: "r"(dst + 512 * p), "l"(st.ptr[r * 8 + p].p0 + tiled(w)) : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
}

// Word 2t + U of chunk c, rows g (P0) and g + 8 (P1), from the ring (zeros for a dead m-tile).
template <int B>
__device__ __forceinline__ void ring_read(const Stage& st, const WgJob& job, int c, int U,
                                          u32 (&P0)[8], u32 (&P1)[8]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const u32 at = ring_slot<B>(st, c) + 32 * g + 4 * (2 * t + U);
    #pragma unroll
    for (int p = 0; p < 8; ++p) {
        P0[p] = P1[p] = 0u;
        if (p < B && job.live) {
            asm volatile("ld.shared.u32 %0, [%1];" : "=r"(P0[p]) : "r"(at + 512 * p));
            asm volatile("ld.shared.u32 %0, [%1];" : "=r"(P1[p]) : "r"(at + 512 * p + 256));
        }
    }
}

// At chunk c's start: wait for its copies (RING_SLOTS - 2 newer groups may still run), and refill
// the slot chunk c - 1 used (every lane read it before the warp barrier) with chunk c + 3.
template <int B>
__device__ __forceinline__ void ring_next(const Stage& st, const WgJob& job, int c) {
    asm volatile("cp.async.wait_group %0;" :: "n"(RING_SLOTS - 2) : "memory");
    __syncwarp();
    ring_fill<B>(st, job, c + RING_SLOTS - 1);
}

// One half-chunk: decode word U of the lane's chunk into A (overlapping the previous
// half-chunk's wgmma); after word 1, load both words of the lane's next chunk (one 8-byte load a
// row and plane); wait for this half-chunk's B, issue its 8 wgmma, retire the previous
// half-chunk's (then `other`, its A set, is free) and start copying the next half-chunk's B into
// the buffer that frees.
template <int B, bool FLAT, int U>
__device__ __forceinline__ void wg_half(PrefillWG& sm, const WgJob& job, int hc, int halves,
                                        const u32 (&L0)[8], const u32 (&L1)[8], u32 (&Pa0)[8],
                                        u32 (&Pa1)[8], u32 (&Pb0)[8], u32 (&Pb1)[8],
                                        u32 (&A)[WG_KSTEPS][4], const u32 (&other)[WG_KSTEPS][4],
                                        float (&d)[64]) {
    const Stage& st = sm.st[threadIdx.x >> 5];
    if constexpr (kRing<B, FLAT>) {
        if (U == 0) ring_next<B>(st, job, hc / 2);
        ring_read<B>(st, job, hc / 2, U, Pa0, Pa1);
        wg_decode_at<B>(st, job, Pa0, Pa1, L0, L1, A);
    } else if (U == 0) {
        if (job.live) prefetch_ahead(st, B == 0 ? job.B : B, job.words, hc / 2);
        wg_decode_at<B>(st, job, Pa0, Pa1, L0, L1, A);
    } else {
        wg_decode_at<B>(st, job, Pb0, Pb1, L0, L1, A);
        wg_load_pair<B, FLAT>(st, job, 8 * (hc / 2 + 1) + 2 * (threadIdx.x & 3), Pa0, Pa1, Pb0,
                              Pb1);
    }
    mbar_wait(&sm.full[U], (hc / 2) & 1);  // buffer U's copy for chunk hc / 2 (wg_job's phase)
    wgmma_fence();
    const unsigned long long desc = b_desc(&sm.b[U][0][0][0][0]);
    #pragma unroll
    for (int s = 0; s < WG_KSTEPS; ++s)  // the descriptor counts 16-byte units
        wgmma_n128(d, A[s], desc + s * (sizeof(sm.b[0][0]) >> 4));
    wgmma_commit();
    wgmma_wait<1>();
    hold(other);
    if (hc + 1 < halves) load_b(sm, U ^ 1, job.tile, hc + 1);
}

// d = W[64 rows] x^T for the 128 tokens of the job's tile, over its chunks' columns, at width B
// (0: each warp's own, chosen per half-chunk). Lane (g, t) of warp q ends with row
// 16q + g + 8(r / 2), token 8j + 2t + (r % 2) in d[4j + r].
template <int B, bool FLAT>
__device__ __forceinline__ void prefill_wg_at(PrefillWG& sm, const WgJob& job, float (&d)[64]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const Stage& st = sm.st[threadIdx.x >> 5];
    u32 L0[8], L1[8];
    lut_from(st.tbl[g], min(job.B, 4), L0);
    lut_from(st.tbl[g + 8], min(job.B, 4), L1);
    const int halves = 2 * ((job.words + 7) / 8);
    u32 Pa0[8], Pa1[8], Pb0[8], Pb1[8];  // word 8 it + 2t + u of rows g, g + 8: u = 0 (a), 1 (b)
    if constexpr (kRing<B, FLAT>) {
        __syncwarp();  // every lane has its table in registers: the ring may overwrite it
        #pragma unroll
        for (int c = 0; c < RING_SLOTS - 1; ++c) ring_fill<B>(st, job, job.c0 + c);
    } else {
        wg_load_pair<B, FLAT>(st, job, 8 * job.c0 + 2 * t, Pa0, Pa1, Pb0, Pb1);
    }
    #pragma unroll
    for (int i = 0; i < 64; ++i) d[i] = 0.f;
    u32 Aa[WG_KSTEPS][4], Ab[WG_KSTEPS][4];
    #pragma unroll
    for (int s = 0; s < WG_KSTEPS; ++s) Ab[s][0] = Ab[s][1] = Ab[s][2] = Ab[s][3] = 0u;
    STAMP(job.kind, 4);
    for (int hc = 2 * job.c0; hc < halves; hc += 2) {
        wg_half<B, FLAT, 0>(sm, job, hc, halves, L0, L1, Pa0, Pa1, Pb0, Pb1, Aa, Ab, d);
        if (hc == 2 * job.c0) STAMP(job.kind, 5);
        wg_half<B, FLAT, 1>(sm, job, hc + 1, halves, L0, L1, Pa0, Pa1, Pb0, Pb1, Ab, Aa, d);
        if (hc == 2 * job.c0) STAMP(job.kind, 6);
    }
    wgmma_wait<0>();
    hold(Ab);
    #pragma unroll
    for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}

// (Everything from the kernel entry down to here is inlined: a call boundary anywhere around the
// wgmma makes ptxas serialize them, warning C7510.)
// One loop per (width, flatness) when the CTA's warps share a width: the compiler then schedules
// loads and decode across a whole half-chunk, and the hot loop is short. Mixed widths: the loop
// that switches per half-chunk.
__device__ __forceinline__ void prefill_wg(PrefillWG& sm, const WgJob& job, float (&d)[64]) {
    if (!job.uniform) return prefill_wg_at<0, false>(sm, job, d);
    switch (job.B) {
#define CASE(W)                                                                                   \
    case W:                                                                                       \
        if (job.flat) prefill_wg_at<W, true>(sm, job, d);                                         \
        else prefill_wg_at<W, false>(sm, job, d);                                                 \
        break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
    }
}

// Row tile `rt` of token tile `tile`: tile_info[tile] = (slot, pass), slot -1 past the last tile
// (the launcher sizes the grid by a bound: no host sync).
__device__ __forceinline__ Tile wg_tile(const Slots& s, const int* tile_info, int tile, int rt,
                                        int rows_per_cta) {
    Tile c;
    c.slot = __ldg(tile_info + 2 * tile);
    c.row0 = rt * rows_per_cta;
    c.base = WG_TOKENS * __ldg(tile_info + 2 * tile + 1);
    c.lo = c.slot < 0 ? 0 : __ldg(s.lo + c.slot);
    c.T = c.slot < 0 ? 0 : __ldg(s.hi + c.slot) - c.lo;
    return c;
}

// Chunks [c0, c1) of a row (c1 = WHOLE_ROW: to its end); `phases`: the phases B's mbarriers
// completed in the CTA's earlier jobs (down's stream-K shares; each buffer completes as many).
struct Chunks {
    int c0, c1, phases;
};
#define WHOLE_ROW (1 << 27)

// The phases B's mbarriers have completed after a job of chunks `ch` (wg_job).
__device__ __forceinline__ int phases_after(Chunks ch) {
    return ch.phases + ((ch.phases - ch.c0) & 1) + ch.c1 - ch.c0;
}

// Stage warp q's m-tile (rows mrow0..+15 of `block`) and describe the CTA's job: token tile
// `tile` over chunks `ch`. The CTA's first job (ch.phases = 0) sets up B's mbarriers; a later
// one must follow a barrier behind the last one's wgmma. Chunk c's copies wait on parity c & 1
// (wg_half), so where the phases so far and c0 differ in parity, one arrival completes an empty
// phase of each buffer first: the loop keeps no parity of its own (a register more made ptxas
// serialize down's wgmma, C7512).
__device__ __forceinline__ WgJob wg_job(PrefillWG& sm, const Paged& g, int block, int mrow0,
                                        int rows, i64 bits_nbytes, int words, int rpt,
                                        const unsigned short* tiles, int tile, Chunks ch, int wpad,
                                        bool uniform) {
    const int warp = threadIdx.x >> 5, nrows = min(ROWS, rows - mrow0);
    WgJob job;
    job.B = __ldg(g.width + block);
    job.uniform = uniform;
    job.live = nrows > 0;
    job.words = ch.c1 == WHOLE_ROW ? words : min(words, 8 * ch.c1);
    job.c0 = ch.c0;
    job.tile = tiles + (i64)tile * WG_TOKENS * 32 * wpad;
    bool flat = true;
    if (job.live)
        flat = stage(g, block, job.B, bits_nbytes, words, rpt, mrow0, nrows, sm.st[warp],
                     threadIdx.x & 31, 32);
    if (threadIdx.x == 0) {  // B's mbarriers, visible to every thread after the barrier below
        if (ch.phases == 0) {
            mbar_init(&sm.full[0], 1);
            mbar_init(&sm.full[1], 1);
            asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        }
        if ((ch.phases - ch.c0) & 1)
            for (int u = 0; u < 2; ++u)
                asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(smem_u32(&sm.full[u]))
                             : "memory");
        load_b(sm, 0, job.tile, 2 * ch.c0);  // the first half-chunk of B lands while the CTA stages
    }
    job.flat = __syncthreads_and(flat);
    return job;
}

// h = silu(gate x) * up x for the 128 tokens of a tile, into the same tile of h (down_prefill_wg's
// B): 32 rows, warps 0, 1 gate, warps 2, 3 up. Gate and up warps swap half their sums through
// shared memory, so that each warp forms h for 64 of the tile's tokens (before: the gate warps
// formed all 128 while the up warps sat idle at the CTA's end).
__device__ __forceinline__ void gate_up_prefill_wg(Paged g, Slots s, const unsigned short* x,
                                                   unsigned short* hp, int I, int words_in,
                                                   int wpad_in, int wpad_out, i64 bits_nbytes,
                                                   int rpt, const int* tile_info) {
    PrefillWG& sm = shared_as<PrefillWG>();
    STAMP(0, 0);
    const Tile c = wg_tile(s, tile_info, blockIdx.y, blockIdx.x, 2 * ROWS);
    if (c.base >= c.T) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int e = __ldg(s.expert + c.slot), block = __ldg(s.block_ids + 3 * e + (warp >> 1));
    const int mrow0 = c.row0 + ROWS * (warp & 1);
    const int wg = __ldg(g.width + __ldg(s.block_ids + 3 * e));
    const bool uniform = wg == __ldg(g.width + __ldg(s.block_ids + 3 * e + 1));  // gate, up
    const Chunks all{0, WHOLE_ROW, 0};
    WgJob job = wg_job(sm, g, block, mrow0, I, bits_nbytes, words_in, rpt, x, blockIdx.y, all,
                       wpad_in, uniform);
    STAMP_KIND(job, 0);
    STAMP(0, 2);
    float d[64];
    prefill_wg(sm, job, d);
    STAMP(0, 3);
    __syncthreads();  // every warp is past its last wgmma: B's buffers are free
    // warp w (gate: tokens 0-63, d[0..31]; up: tokens 64-127, d[32..63]) hands the other half to
    // its partner w ^ 2, which holds the same rows of the other projection
    const bool gate = warp < 2;
    float* swap = reinterpret_cast<float*>(&sm.b[0][0][0][0][0]);  // [warp][32][lane]
    #pragma unroll
    for (int i = 0; i < 32; ++i) swap[(warp * 32 + i) * 32 + lane] = gate ? d[32 + i] : d[i];
    __syncthreads();
    const float* other = swap + (warp ^ 2) * 32 * 32 + lane;
    const int ntok = c.T - c.base, row0 = mrow0 + (lane >> 2), half = gate ? 0 : 64;
    unsigned short* h = hp + (i64)blockIdx.y * WG_TOKENS * 32 * wpad_out;
    // Rows r and r + 4 (r % 8 < 4) of a token are adjacent in h's tile (`tile_pos`), and lanes
    // l, l ^ 16 hold them: the two lanes swap one token's value so that each stores a pair.
    const bool low = !(lane & 16);
    #pragma unroll
    for (int i = 0; i < 32; i += 2) {
        u32 v[2];  // tokens k, k + 1 of this lane's row (rows past I: zeros, so down reads none)
        #pragma unroll
        for (int u = 0; u < 2; ++u) {
            const float mine = gate ? d[i + u] : d[32 + i + u], theirs = other[(i + u) * 32];
            const int row = row0 + 8 * (((i + u) & 3) >> 1);
            v[u] = row < I ? f2h(silu(gate ? mine : theirs) * (gate ? theirs : mine)) : 0u;
        }
        const u32 got = __shfl_xor_sync(0xffffffffu, low ? v[1] : v[0], 16);
        const int k = half + 8 * (i >> 2) + 2 * (lane & 3) + (low ? 0 : 1);
        const int row = row0 + 8 * ((i & 3) >> 1) - (low ? 0 : 4);
        if (k < ntok && row < 32 * wpad_out)
            *reinterpret_cast<u32*>(h + tile_pos(k, row)) = low ? v[0] | got << 16 : got | v[1] << 16;
    }
    STAMP(0, 7);
}

// One job of down: 64 rows of tile `tile` (warp q: rows 16q..16q+15) over chunks `ch` of their
// columns, out[token] += weight * (down h) for the tile's tokens.
__device__ __forceinline__ void down_prefill_job(PrefillWG& sm, const Paged& g, const Slots& s,
                                                 const unsigned short* hp, float* out, int H,
                                                 int words_in, int wpad_in, i64 bits_nbytes,
                                                 int rpt, const Tile& c, int tile, Chunks ch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int e = __ldg(s.expert + c.slot), block = __ldg(s.block_ids + 3 * e + 2);
    const int mrow0 = c.row0 + ROWS * warp;
    WgJob job = wg_job(sm, g, block, mrow0, H, bits_nbytes, words_in, rpt, hp, tile, ch, wpad_in,
                       true);
    STAMP_KIND(job, 1);
    STAMP(1, 2);
    float d[64];
    prefill_wg(sm, job, d);
    STAMP(1, 3);
    const int ntok = c.T - c.base, row0 = mrow0 + (lane >> 2);
    // Rows r, r + 1 (r even) of a token are adjacent in `out` (H is even: the launcher takes the
    // mma.sync prefill otherwise), and lanes l, l ^ 4 hold them: the two lanes swap one token's
    // value so that each adds a pair (one vector reduction).
    const bool low = !(lane & 4);
    #pragma unroll
    for (int i = 0; i < 64; i += 2) {
        const float got = __shfl_xor_sync(0xffffffffu, low ? d[i + 1] : d[i], 4);
        const int k = 8 * (i >> 2) + 2 * (lane & 3) + (low ? 0 : 1);
        const int row = row0 + 8 * ((i & 3) >> 1) - (low ? 0 : 1);
        if (k < ntok && row < H) {
            const int pair = c.lo + c.base + k;
            const float w = __ldg(s.weight + pair);
            float* at = out + (i64)__ldg(s.token + pair) * H + row;
            asm volatile("red.global.add.v2.f32 [%0], {%1, %2};"
                         :: "l"(at), "f"(w * (low ? d[i] : got)), "f"(w * (low ? got : d[i + 1]))
                         : "memory");
        }
    }
    STAMP(1, 7);
}

// down's work is units (token tile, row tile of 64 rows), unit = tile * row_tiles + row tile, of
// `chunks` chunks (8 plane words of a row) each; a CTA's span is a range of chunks in unit order.
// sk = 0: CTA (x, y) takes unit (y, x) whole. sk > 0 (a wave of CTAs; the launcher's rule: long
// rows, e.g. Mixtral's 56 chunks), a 1-D grid: of the N units of the plan's live tiles, CTAs
// b < D = (N / sk) sk take unit b whole, and when the N - D units left would fill at most half
// a wave, the next sk CTAs take equal shares of their chunks (at most half a unit each; else
// those units go whole too). One CTA a unit left them to run as a partial wave at the end: Mixtral at
// 512 tokens, 832 units on 264 CTAs, took 4 waves' time for 3.15 waves' work (decisions/017).
// A share may end or begin inside a unit: its partial sums are added as a whole
// unit's are (atomics, which down needs anyway).
struct Span {
    int lo, hi;
};

__device__ __forceinline__ Span down_span(const int* tile_info, int tiles, int row_tiles,
                                          int chunks, int sk) {
    if (sk == 0) {
        const int u = blockIdx.y * row_tiles + blockIdx.x;
        return Span{u * chunks, (u + 1) * chunks};
    }
    // a plan ends with a dead tile whose pass is the count of live tiles (plan_tiles)
    const int n = __ldg(tile_info + 2 * tiles - 1) * row_tiles, b = blockIdx.x;
    const int d = 2 * (n % sk) > sk ? n : n / sk * sk;
    if (b < d) return Span{b * chunks, (b + 1) * chunks};
    if (b - d >= sk) return Span{0, 0};
    const i64 rest = (i64)(n - d) * chunks;
    return Span{d * chunks + (int)((b - d) * rest / sk), d * chunks + (int)((b - d + 1) * rest / sk)};
}

// Job k (0 or 1) of the CTA's span, which covers at most two: the end of one unit and the start
// of the next. Each job computes the span anew from opaque copies of the arguments, so that
// nothing of it is held in registers across the first job's loop (a loop over jobs, or 3 more
// live registers, made ptxas serialize the wgmma: C7512).
__device__ __forceinline__ void down_prefill_part(PrefillWG& sm, const Paged& g, const Slots& s,
                                                  const unsigned short* hp, float* out, int H,
                                                  int words_in, int wpad_in, i64 bits_nbytes,
                                                  int rpt, const int* tile_info, int sk,
                                                  int row_tiles, int tiles, int k) {
    asm volatile("" : "+r"(words_in), "+r"(row_tiles), "+r"(tiles), "+r"(sk), "+l"(tile_info));
    const int chunks = (words_in + 7) / 8;
    const Span span = down_span(tile_info, tiles, row_tiles, chunks, sk);
    const int unit0 = span.lo / chunks, mid = min(span.hi, (unit0 + 1) * chunks);
    const Chunks first{span.lo - unit0 * chunks, mid - unit0 * chunks, 0};
    if (k == 1 && mid >= span.hi) return;
    const int unit = unit0 + k;
    const Chunks ch = k == 0 ? first : Chunks{0, span.hi - unit * chunks, phases_after(first)};
    if (ch.c0 >= ch.c1) return;
    const Tile c = wg_tile(s, tile_info, unit / row_tiles, unit % row_tiles, 4 * ROWS);
    if (c.base >= c.T || c.row0 >= H) return;  // (sk = 0 only: the wave's units are live)
    if (k == 1) __syncthreads();  // every warp is past the first job's wgmma: B is free
    down_prefill_job(sm, g, s, hp, out, H, words_in, wpad_in, bits_nbytes, rpt, c,
                     unit / row_tiles, ch);
}

// out[token] += weight * (down h) for the tokens of h's tiles: each job 64 rows (warp q:
// 16q..16q+15) of one tile over a range of its columns (down_span).
__device__ __forceinline__ void down_prefill_wg(Paged g, Slots s, const unsigned short* hp,
                                                float* out, int H, int words_in, int wpad_in,
                                                i64 bits_nbytes, int rpt, const int* tile_info,
                                                int sk, int row_tiles, int tiles) {
    PrefillWG& sm = shared_as<PrefillWG>();
    STAMP(1, 0);
    down_prefill_part(sm, g, s, hp, out, H, words_in, wpad_in, bits_nbytes, rpt, tile_info, sk,
                      row_tiles, tiles, 0);
    if (sk > 0)
        down_prefill_part(sm, g, s, hp, out, H, words_in, wpad_in, bits_nbytes, rpt, tile_info,
                          sk, row_tiles, tiles, 1);
}
#endif

// Flat kernel parameters (CuPy passes scalars and raw pointers): the descriptor, then the slots.
#define PAGED_ARGS const unsigned char *arena, const int *slab_map, const int *slab_off,             \
                   const int *width, int slab_shift, int max_bits
#define SLOT_ARGS const int *s_expert, const int *s_lo, const int *s_hi, const int *s_token,          \
                  const float *s_weight, const int *block_ids, int n_ids
#define PAGED Paged{arena, slab_map, slab_off, width, slab_shift, max_bits}
#define SLOTS Slots{s_expert, s_lo, s_hi, s_token, s_weight, block_ids, n_ids}

// NT n-tiles of 8 tokens per CTA: 1, 2, 4 and 8 for decode (<= 64 tokens a call; the launcher
// picks NT by the call's token count, a bound on any slot's). BOUNDS: what each measured fastest
// with on the H200 (decisions/031). One n-tile: no CTA floor (80 / 72 registers; a floor of 7,
// i.e. 72 registers for gate_up_n1, ran 5-9% slower at 1-4 tokens). Wider: a floor that leaves
// their registers as they were (96 / 128) but ran 3-9% faster at 16 tokens than none.
//
// One launch covers two groups of slots. Rows blockIdx.y < n_routed are the routed experts'
// slots (blockIdx.x: row tile, blockIdx.z: k-split). The shared expert's slot (its own slots, h
// buffer and shapes: the t_ arguments) has t_tiles row tiles of t_split parts each, numbered
// through the CTAs of the rows after them, so that it streams beside the routed experts instead
// of after them, with a k-split of its own (its rows may be much longer). Without a shared expert
// the launcher passes the routed group twice and n_routed = gridDim.y.
#define SHARED_SLOT_ARGS const int *t_expert, const int *t_lo, const int *t_hi, const int *t_token,   \
                         const float *t_weight
#define SHARED_SLOTS Slots{t_expert, t_lo, t_hi, t_token, t_weight, block_ids, n_ids}
#define WHICH_GROUP                                                                              \
    const bool t = (int)blockIdx.y >= n_routed;                                                  \
    int slot = blockIdx.y, tile = blockIdx.x, kz = blockIdx.z, kn = gridDim.z;                   \
    if (t) {                                                                                     \
        const int at = ((blockIdx.y - n_routed) * gridDim.z + blockIdx.z) * gridDim.x + blockIdx.x; \
        if (at >= t_tiles * t_split) return;                                                     \
        slot = 0, tile = at % t_tiles, kz = at / t_tiles, kn = t_split;                          \
    }
// gate_up's group: WHICH_GROUP's, or with `runs` > 0 (one-token calls: a persistent grid of
// gridDim.x CTAs, one row) the routed tiles' on CTAs [0, runs), the shared expert's on the rest.
#define GATE_UP_GROUP                                                                            \
    const bool t = runs > 0 ? (int)blockIdx.x >= runs : (int)blockIdx.y >= n_routed;           \
    int slot = blockIdx.y, tile = blockIdx.x;                                                    \
    if (t && runs == 0) {                                                                        \
        const int at = (blockIdx.y - n_routed) * gridDim.x + blockIdx.x; /* t_split = 1 */     \
        if (at >= t_tiles) return;                                                               \
        slot = 0, tile = at;                                                                     \
    }
// gate_up's work (Run): the CTA's tile, or with `runs` > 0 the j-th of its group's CTAs' equal
// shares of the group's tiles' halves. The shared expert's shares (a layer whose routed and
// shared tiles fill more than a wave: Qwen1.5-MoE at 4 bits, where one CTA a tile ran 1.4 waves,
// decisions/024) take the scratch indices after the routed ones' [0, runs].
#define RUN                                                                                      \
    const int tiles = t ? t_tiles : 32 * wpad_out / ROWS, at = slot * tiles + tile;              \
    Run run{2 * at, 2 * at + 2, 0, tiles};                                                       \
    if (runs > 0) {                                                                              \
        const int n = t ? gridDim.x - runs : runs, j = t ? blockIdx.x - runs : blockIdx.x;     \
        const i64 halves = 2LL * (t ? 1 : n_routed) * tiles;                                     \
        run = Run{(int)(j * halves / n), (int)((j + 1) * halves / n), t ? runs + 1 + j : j,      \
                  tiles};                                                                        \
    }
#define GATE_UP_ENTRY(NAME, BOUNDS, GATE_UP)                                                      \
    extern "C" __global__ void BOUNDS gate_up_##NAME(                                             \
        PAGED_ARGS, SLOT_ARGS, const uint4* xf, unsigned short* hp, int I, int words_in,         \
        int wpad_in, int wpad_out, i64 bits_nbytes, int rpt, int n_routed, SHARED_SLOT_ARGS,    \
        unsigned short* t_hp, int t_I, int t_wpad_out, i64 t_bits_nbytes, int t_rpt,            \
        int t_tiles, int t_split, const PopcX* px, int runs, float* split_sum,                  \
        int* split_ticket) {                                                                     \
        GATE_UP_GROUP                                                                            \
        (void)t_split; /* 1: gate_up splits no columns on the per-tile grid */                    \
        RUN                                                                                      \
        GATE_UP(PAGED, t ? SHARED_SLOTS : SLOTS, run, xf, t ? t_hp : hp, t ? t_I : I,            \
                words_in, wpad_in, t ? t_wpad_out : wpad_out,                                    \
                t ? t_bits_nbytes : bits_nbytes, t ? t_rpt : rpt, px,                            \
                Split{split_sum, split_ticket});                                                 \
    }
#define DOWN_ENTRY(NAME, BOUNDS, DOWN)                                                            \
    extern "C" __global__ void BOUNDS down_##NAME(                                                \
        PAGED_ARGS, SLOT_ARGS, const uint4* hp, float* out, int H, int words_in, int wpad_in,    \
        i64 bits_nbytes, int rpt, int units, int n_routed, SHARED_SLOT_ARGS, const uint4* t_hp, \
        int t_words_in, int t_wpad_in, i64 t_bits_nbytes, int t_rpt, int t_units, int t_tiles,  \
        int t_split, const PopcX* hpx, const PopcX* t_hpx) {                                     \
        WHICH_GROUP                                                                              \
        DOWN(PAGED, t ? SHARED_SLOTS : SLOTS, slot, tile, kz, kn, t ? t_hp : hp, out, H,         \
             t ? t_words_in : words_in, t ? t_wpad_in : wpad_in,                                 \
             t ? t_bits_nbytes : bits_nbytes, t ? t_rpt : rpt, t ? t_units : units,              \
             t ? t_hpx : hpx);                                                                   \
    }

// Each kernel under its own guard, so that kernels.PARTS may group them as the compile's times
// ask (the parentheses hold a template's commas)
#if WANT(gate_up_n1)
GATE_UP_ENTRY(n1, __launch_bounds__(32 * WARPS), gate_up<1>)
#endif
#if WANT(down_n1)
DOWN_ENTRY(n1, __launch_bounds__(32 * WARPS), down<1>)
#endif
#if WANT(gate_up_n2)
GATE_UP_ENTRY(n2, __launch_bounds__(32 * WARPS, 5), gate_up<2>)
#endif
#if WANT(down_n2)
DOWN_ENTRY(n2, __launch_bounds__(32 * WARPS, 5), down<2>)
#endif
#if WANT(gate_up_n4)
GATE_UP_ENTRY(n4, __launch_bounds__(32 * WARPS, 5), gate_up<4>)
#endif
#if WANT(down_n4)
DOWN_ENTRY(n4, __launch_bounds__(32 * WARPS, 5), down<4>)
#endif
#if WANT(gate_up_n8)
GATE_UP_ENTRY(n8, __launch_bounds__(32 * WARPS, 4), gate_up<8>)
#endif
#if WANT(down_n8)
DOWN_ENTRY(n8, __launch_bounds__(32 * WARPS, 4), down<8>)
#endif
// one-token calls (the binary tensor-core kernels, 128 registers)
#if WANT(gate_up_p1)
GATE_UP_ENTRY(p1, __launch_bounds__(32 * WARPS, 4), (gate_up_popc<4, false>))
#endif
#if WANT(down_p1)
DOWN_ENTRY(p1, __launch_bounds__(32 * WARPS, 4), (down_popc<4, false>))
#endif
// up to 3 bits: 2 registers a subset (popc_regs), 80 registers, 6 CTAs an SM (decisions/021; with 4
// a subset: 96 registers and 5 CTAs, and at 6 it spilled and was slower on Mixtral)
#if WANT(gate_up_p1b3)
GATE_UP_ENTRY(p1b3, __launch_bounds__(32 * WARPS, 6), (gate_up_popc<3, false>))
#endif
#if WANT(down_p1b3)
DOWN_ENTRY(p1b3, __launch_bounds__(32 * WARPS, 6), (down_popc<3, false>))
#endif
// calls of 2..POPC_MAX_TOKENS tokens: one-token slots on the binary mma, the others the lookup
// up to 5 bits: 31 subsets at 2 registers each (popc_regs), for one-token layers with blocks
// wider than 4 bits, whose 5-bit blocks the other builds read by the lookup. 3 CTAs an SM: 168
// registers and ~130 bytes of spills (NVRTC 13, sm_90a); at 4, ~750 bytes; at 2, 252 and none
#ifndef P1B5_CTAS
#define P1B5_CTAS 3
#endif
#if WANT(gate_up_p1b5)
GATE_UP_ENTRY(p1b5, __launch_bounds__(32 * WARPS, P1B5_CTAS), (gate_up_popc<5, false>))
#endif
#if WANT(down_p1b5)
DOWN_ENTRY(p1b5, __launch_bounds__(32 * WARPS, P1B5_CTAS), (down_popc<5, false>))
#endif
#if WANT(gate_up_pn)
GATE_UP_ENTRY(pn, __launch_bounds__(32 * WARPS, 4), (gate_up_popc<4, true>))
#endif
#if WANT(down_pn)
DOWN_ENTRY(pn, __launch_bounds__(32 * WARPS, 4), (down_popc<4, true>))
#endif
#if WANT(gate_up_pnb3)
GATE_UP_ENTRY(pnb3, __launch_bounds__(32 * WARPS, 5), (gate_up_popc<3, true>))
#endif
#if WANT(down_pnb3)
DOWN_ENTRY(pnb3, __launch_bounds__(32 * WARPS, 5), (down_popc<3, true>))
#endif

#if WANT(gate_up_prefill)
extern "C" __global__ void __launch_bounds__(32 * PF_WARPS) gate_up_prefill(
    PAGED_ARGS, SLOT_ARGS, const uint4* xf, unsigned short* hp, int I, int words_in, int wpad_in,
    int wpad_out, i64 bits_nbytes, int rpt, int passes) {
    gate_up_prefill(PAGED, SLOTS, xf, hp, I, words_in, wpad_in, wpad_out, bits_nbytes, rpt, passes);
}
#endif
#if WANT(down_prefill)
extern "C" __global__ void __launch_bounds__(32 * PF_WARPS) down_prefill(
    PAGED_ARGS, SLOT_ARGS, const uint4* hp, float* out, int H, int words_in, int wpad_in,
    i64 bits_nbytes, int rpt, int passes) {
    down_prefill(PAGED, SLOTS, hp, out, H, words_in, wpad_in, bits_nbytes, rpt, passes);
}
#endif

// sm_90a only (the launcher checks the device); elsewhere they compile to a trap.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WG_BODY(call) call;
#else
#define WG_BODY(call) __trap();
#endif
#if WANT(gate_up_prefill_wg)
extern "C" __global__ void __launch_bounds__(128, 2) gate_up_prefill_wg(
    PAGED_ARGS, SLOT_ARGS, const unsigned short* x, unsigned short* hp, int I, int words_in,
    int wpad_in, int wpad_out, i64 bits_nbytes, int rpt, const int* tile_info) {
    WG_BODY(gate_up_prefill_wg(PAGED, SLOTS, x, hp, I, words_in, wpad_in, wpad_out, bits_nbytes,
                               rpt, tile_info))
}
#endif
#if WANT(down_prefill_wg)
extern "C" __global__ void __launch_bounds__(128, 2) down_prefill_wg(
    PAGED_ARGS, SLOT_ARGS, const unsigned short* hp, float* out, int H, int words_in, int wpad_in,
    i64 bits_nbytes, int rpt, const int* tile_info, int sk, int row_tiles, int tiles) {
    WG_BODY(down_prefill_wg(PAGED, SLOTS, hp, out, H, words_in, wpad_in, bits_nbytes, rpt,
                            tile_info, sk, row_tiles, tiles))
}
#endif

// The sm_90a prefill's token tiles in one pass (fused_moe.wgmma_tiles, which gathers, reorders
// and permutes in torch): tile t holds the tokens of pairs pair[128 t ..], each a row of x (fp16
// [T, H]) in wgmma order, laid out as `PrefillWG::b` holds it (the inverse of `tile_pos`). A
// thread writes one 16-byte unit: 8 k of one token's k-step. Tiles past the last real one (slot
// -1 in tile_info) are left unwritten: no CTA reads them.
#if WANT(token_tiles)
extern "C" __global__ void token_tiles(const unsigned short* x, int H, int wpad, const int* token,
                                       const int* s_lo, const int* s_hi, const int* tile_info,
                                       uint4* xt) {
    const int t = blockIdx.y, units = wpad / 4 * 2048;  // half-chunks x (8 x 16 x 2 x 8) units
    const int slot = tile_info[2 * t];
    if (slot < 0) return;
    // the tile's first pair; tokens past the slot's end repeat its last (computed, never stored)
    const int first = s_lo[slot] + PF_TOKENS * tile_info[2 * t + 1], last = s_hi[slot] - 1;
    for (int u = blockIdx.x * blockDim.x + threadIdx.x; u < units; u += gridDim.x * blockDim.x) {
        // unit u = [half-chunk hc][k-step s 8][token group 16][k half 2][token 8]
        const int hc = u >> 11, s = (u >> 8) & 7, kh = (u >> 3) & 1;
        const int n = ((u >> 4) & 15) * 8 + (u & 7);
        const unsigned short* row = x + (i64)token[min(first + n, last)] * H;
        u32 v[4];
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
            u32 two = 0;
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int k = 8 * kh + 2 * i + h, j = (k & 1) + 2 * (k >> 3);
                const int w = 8 * (hc >> 1) + 2 * ((k & 7) >> 1) + (hc & 1);
                const int col = 32 * w + (s >> 1) + 4 * j + 16 * (s & 1);
                two |= (u32)(col < H ? row[col] : (unsigned short)0) << (16 * h);
            }
            v[i] = two;
        }
        xt[(i64)t * units + u] = make_uint4(v[0], v[1], v[2], v[3]);
    }
}
#endif

// Decode-time preparation of one layer call, in one launch (it replaced ~20 small torch kernels,
// then three more launches: decisions/004). Block 0 groups the (token, expert) pairs by expert:
// pairs placed stably (sorted by expert, then by pair), slots listing the active experts in
// increasing order, empty slots after. The other blocks write x (fp16 [T, H]) in fragment order
// (fp16 [T, wpad, 32], zero-padded: fused_moe.fragment_order) and zero the fp32 output the down
// kernels add into. Dynamic shared memory: `experts` ints a grouping warp (kernels.group_smem).
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

#define GROUP_SPLIT 2048  // pairs from which prefill_prep groups with every warp
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

// ------------------------------------------------------------------------------------------------
// Routing in the launch that prepares a decode call (`route_prep`: decode_prep with the router
// folded in). An eager decode is host-bound on the many-expert shapes, and the router was 6-8 more
// small launches (linear, softmax, top-k, normalization, scaling, the shared expert's gate):
// decisions/009.
//
// Every block but x's piece blocks (popc calls) takes a share of the logits (`router_logits`:
// `slices` warps a (token, row) dot product over H in fp32, rounded to fp16 as the reference's
// fp16 linear rounds them; row `experts` is the shared expert's gate when there is one). x's
// fragment-order copy and the output's zeroing go to the piece blocks, or without them to the
// logits blocks. The last logits block to finish (a counter it resets) picks each token's top-k
// in the recipe's order, writes index / weights / the shared gate, and groups the pairs
// (`group_decode`).

__device__ __forceinline__ float hsum2(u32 a, u32 b) {  // a.lo b.lo + a.hi b.hi, fp32
    return h2f(a & 0xffff) * h2f(b & 0xffff) + h2f(a >> 16) * h2f(b >> 16);
}

__device__ __forceinline__ float warp_sum(float v) {
    #pragma unroll
    for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(0xffffffffu, v, d);
    return v;
}

// This warp's share of a dot product of two fp16 rows: uint4s [lo, hi) of them (16-byte aligned
// rows). A lane issues its ROUTE_LOADS pairs of loads before it adds any: with a warp a row and
// two loads in flight, a lane's 8-16 loads were 4-8 round trips, most of route_prep's time.
#define ROUTE_LOADS 4
__device__ float slice_dot(const uint4* a, const uint4* b, int lo, int hi) {
    float s = 0.f;
    for (int i0 = lo + (threadIdx.x & 31); i0 < hi; i0 += 32 * ROUTE_LOADS) {
        uint4 u[ROUTE_LOADS], v[ROUTE_LOADS];
        #pragma unroll
        for (int j = 0; j < ROUTE_LOADS; ++j) {
            const int i = i0 + 32 * j;
            u[j] = i < hi ? __ldg(a + i) : make_uint4(0u, 0u, 0u, 0u);
            v[j] = i < hi ? __ldg(b + i) : make_uint4(0u, 0u, 0u, 0u);
        }
        #pragma unroll
        for (int j = 0; j < ROUTE_LOADS; ++j)
            s += hsum2(u[j].x, v[j].x) + hsum2(u[j].y, v[j].y) + hsum2(u[j].z, v[j].z) + hsum2(u[j].w, v[j].w);
    }
    return warp_sum(s);
}

// Logits row d = (token d / rows, router row d % rows) over H, in fp16 as the reference's fp16
// linear rounds them. `slices` warps of a block (a power of two <= the block's warps) take a
// contiguous share of H each and add up in shared memory in slice order: the same sum on every
// launch. The block's warps take warps / slices rows at a time; every thread of the block calls.
__device__ void router_logits(const unsigned short* x, int T, int H, const unsigned short* gate_w,
                              int experts, const unsigned short* shared_gate_w, int slices,
                              float* logits, int blocks) {
    __shared__ float part[PREP_THREADS / 32];
    const int rows = experts + (shared_gate_w != nullptr), warps = blockDim.x / 32;
    const int wib = threadIdx.x / 32, per = warps / slices, n = H / 8, len = (n + slices - 1) / slices;
    const int sl = wib % slices, lo = sl * len, hi = min(n, lo + len);
    for (int grp = blockIdx.x; grp * per < T * rows; grp += blocks) {
        const int d = grp * per + wib / slices, t = d / rows, e = d % rows;
        float s = 0.f;
        if (d < T * rows) {
            const unsigned short* w = e < experts ? gate_w + (i64)e * H : shared_gate_w;
            s = slice_dot((const uint4*)(x + (i64)t * H), (const uint4*)w, lo, hi);
        }
        if ((threadIdx.x & 31) == 0) part[wib] = s;
        __syncthreads();
        if (threadIdx.x % (32 * slices) == 0 && d < T * rows) {
            float sum = 0.f;
            for (int j = 0; j < slices; ++j) sum += part[wib + j];
            logits[d] = h2f(f2h(sum));
        }
        __syncthreads();  // part is rewritten by the next rows
    }
}

#define ROUTE_MAX_EXPERTS 256
#define ROUTE_PER_LANE (ROUTE_MAX_EXPERTS / 32)
#define NEG_INF __int_as_float(0xff800000)

// atomicAdd at gpu scope with acquire-release order: what this thread (and, through a barrier
// before it, its block) wrote is visible to whoever acquires the value it leaves, and it sees
// what the adds before it released.
__device__ __forceinline__ unsigned add_acq_rel(unsigned* p, unsigned v) {
    unsigned old;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;"
                 : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}

// A logit's key: the order of its fp16 value (router_logits rounds the logits to fp16) in the
// high half, 0xffff - e in the low, so that one u32 max picks the largest logit and, of equal
// ones, the lowest expert. Softmax keeps the logits' order, so the top-k of the probabilities is
// the top-k of the keys (but for two logits within ~1e-7 of each other whose probabilities round
// to one float: they rank by logit here). An absent expert's key is 0, below every real one.
__device__ __forceinline__ unsigned logit_key(float v, int e) {
    const unsigned h = f2h(v + 0.f);  // -0 + 0 = +0: they tie, as in comparisons
    return ((h ^ (h >> 15 ? 0xffffu : 0x8000u)) << 16) | (0xffffu - e);
}
__device__ __forceinline__ float key_logit(unsigned key) {
    const unsigned o = key >> 16;
    return h2f((unsigned short)(o ^ (o >> 15 ? 0x8000u : 0xffffu)));
}
__device__ __forceinline__ int key_expert(unsigned key) { return 0xffff - (int)(key & 0xffffu); }

// The warp's largest key (a tree over the lane's keys, then one REDUX).
__device__ __forceinline__ unsigned warp_max_key(const unsigned (&key)[ROUTE_PER_LANE]) {
    unsigned m[ROUTE_PER_LANE];
    #pragma unroll
    for (int j = 0; j < ROUTE_PER_LANE; ++j) m[j] = key[j];
    #pragma unroll
    for (int d = 1; d < ROUTE_PER_LANE; d <<= 1)
        #pragma unroll
        for (int j = 0; j + d < ROUTE_PER_LANE; j += 2 * d) m[j] = max(m[j], m[j + d]);
    return __reduce_max_sync(0xffffffffu, m[0]);
}

// Token t's top-k from its logits row (one warp): order 0 = softmax over all experts, then top-k
// (renormalized when `norm`); order 1 = top-k of the logits, then softmax over those k. Written to
// index / weights and to copy_index / copy_weights (the same pointers, or a shared-memory copy).
// A round is one REDUX of the lanes' largest keys, 0.11 us: comparing floats and then experts
// took two REDUX and a serial scan a round, 0.33 us, and Qwen3-MoE's top-8 2.6 of its 7.6 us
// prep (decisions/009). Renormalized, the probabilities' common denominator
// cancels, so only weights that are not renormalized wait for softmax's sum.
__device__ void route_token(const float* logits, int experts, int k, int order, int norm,
                            float scaling, i64* index, float* weights, i64* copy_index,
                            float* copy_weights) {
    const int lane = threadIdx.x & 31;
    float v[ROUTE_PER_LANE];
    unsigned key[ROUTE_PER_LANE];
    #pragma unroll
    for (int j = 0; j < ROUTE_PER_LANE; ++j) {
        const int e = lane + 32 * j;
        v[j] = e < experts ? __ldcg(logits + e) : NEG_INF;  // other blocks wrote them: L2
        key[j] = e < experts ? logit_key(v[j], e) : 0u;
    }
    unsigned top = warp_max_key(key);
    const float m = key_logit(top);  // the largest logit
    // softmax's denominator stays in the weights only when they are not renormalized
    const bool divide = order == 1 || norm;
    float s = 0.f;
    if (!divide) {
        #pragma unroll
        for (int j = 0; j < ROUTE_PER_LANE; ++j) s += lane + 32 * j < experts ? expf(v[j] - m) : 0.f;
        s = warp_sum(s);
    }
    STAMP(2, 6);
    float mine = 0.f, total = 0.f;  // lane i keeps round i's exp(logit - m)
    int mine_e = 0;
    for (int i = 0; i < k; ++i) {
        if (i > 0) top = warp_max_key(key);
        #pragma unroll
        for (int j = 0; j < ROUTE_PER_LANE; ++j)
            if (key[j] == top) key[j] = 0u;  // taken (keys are unique)
        const float p = expf(key_logit(top) - m);
        total += p;
        if (lane == i) mine = p, mine_e = key_expert(top);
    }
    if (lane < k) {
        index[lane] = copy_index[lane] = mine_e;
        weights[lane] = copy_weights[lane] = (divide ? mine / total : mine / s) * scaling;
    }
}

#if WANT(route_prep)
extern "C" __global__ void route_prep(const unsigned short* x, int T, int H,
                                      const unsigned short* gate_w, int experts,
                                      const unsigned short* shared_gate_w, int k, int order,
                                      int norm, float scaling, float* logits, unsigned* done,
                                      i64* index, float* weights, float* shared_scale, int slots,
                                      int* token, float* weight, int* s_expert, int* s_lo,
                                      int* s_hi, int wpad, unsigned short* xf, float* out,
                                      int out_n, int words, PopcX* px, int px_blocks, int slices) {
    STAMP(2, 0);
    const int rows = experts + (shared_gate_w != nullptr), warps = blockDim.x / 32;
    const int blocks = gridDim.x - px_blocks;  // the last px_blocks build x's pieces
    // x's pieces and the routing need nothing of each other, so the routing does not wait for the
    // piece blocks (it once did: Mixtral, 1 token, 0.2-0.4 us a layer, decisions/009)
    // x's layout and out's zeroing: by the piece blocks when there are any, which nothing waits
    // for until the grid ends (the last logits block's share was on the routing's path: Mixtral,
    // one token, 1.1 us, decisions/009); else by the logits blocks, before the counter
    // (after it, the last block's share followed the routing: Mixtral's route_prep, 4 blocks, 7.2
    // -> 9.4 us, decisions/009)
    if ((int)blockIdx.x >= blocks) {
        const int b = blockIdx.x - blocks;
        const int first = b * blockDim.x + threadIdx.x;
        lay_out_x<1>(x, T, H, wpad, xf, out, out_n, first, px_blocks * blockDim.x);
        return x_piece(x, T, H, words, px, b);
    }
    router_logits(x, T, H, gate_w, experts, shared_gate_w, slices, logits, blocks);
    STAMP(2, 1);
    if (px_blocks == 0) {
        const int first = blockIdx.x * blockDim.x + threadIdx.x;
        lay_out_x<1>(x, T, H, wpad, xf, out, out_n, first, blocks * blockDim.x);
    }
    STAMP(2, 2);
    // the last logits block to get here routes: every other block's logits are written by then
    // (the counter's add releases this block's logits and acquires the others': two fence.sc
    // around a relaxed add cost ~0.3 us each on the last block's path, decisions/009)
    __shared__ bool last;
    __syncthreads();
    if (threadIdx.x == 0) last = add_acq_rel(done, 1u) == (unsigned)blocks - 1;
    __syncthreads();
    if (!last) return;
    // gate_up's CTAs may launch now (every other block has exited); they wait for this grid to
    // finish. Let in at this grid's start, they sat on the SMs through the router: a one-token
    // Qwen3-MoE layer 35.4 us against 32.8 launched after it; from here 31.9, and no shape slower
    // than either (decisions/012)
    start_next();
    STAMP(2, 3);
    STAMP(2, 5);
    // a call of at most GROUP_FEW pairs hands them to the grouping in shared memory too
    __shared__ i64 few_index[GROUP_FEW];
    __shared__ float few_weights[GROUP_FEW];
    const bool few = T * k <= GROUP_FEW;
    for (int t = threadIdx.x / 32; t < T; t += warps) {
        const i64 at = (i64)t * k;
        route_token(logits + (i64)t * rows, experts, k, order, norm, scaling, index + at,
                    weights + at, few ? few_index + at : index + at, few ? few_weights + at : weights + at);
        if (shared_gate_w != nullptr && (threadIdx.x & 31) == 0) {
            const float g = __ldcg(logits + (i64)t * rows + experts);
            shared_scale[t] = h2f(f2h(1.f / (1.f + expf(-g))));  // an fp16 sigmoid, as torch's
        }
    }
    if (threadIdx.x == 0) *done = 0u;  // for the next launch
    STAMP(2, 4);
    __syncthreads();  // index and weights, written by this block, are visible to it
    group_decode(few ? few_index : index, few ? few_weights : weights, T * k, k, experts, slots,
                 token, weight, s_expert, s_lo, s_hi);
    STAMP(2, 7);
}
#endif
