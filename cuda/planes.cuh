// Paged planes into tensor-core fragments, what the four GEMM families share (lookup and popc
// decode, both prefills): a block row's pages (`Paged`, `RowPtr`), its labels decoded by PRMT
// into mma.m16n8k16 fragments (`decode`), a tile's staging in shared memory (`Stage`), the
// slots of a call and a CTA's place in them (`Slots`, `Tile`) and the kernels' flat parameters.
#ifndef PWCTL_PLANES_CUH
#define PWCTL_PLANES_CUH
#include "common.cuh"

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
#if PROBE(LOAD_ONLY)  // (probes.cuh)
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
#if PROBE(STAMPS_CHAIN)  // once this thread's quotients by the run-time widths and rpt are
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

struct Slots {
    const int* expert;  // [n_slots]: expert of the slot (its row in block_ids)
    const int* lo;      // [n_slots]: first pair of the slot
    const int* hi;      // [n_slots]: one past its last pair
    const int* token;   // [pairs]: token of each pair (pairs sorted by slot)
    const float* weight;  // [pairs]: combine weight of each pair
    const int* block_ids;  // [experts (+ shared), 3]: block of gate, up, down
    int n_ids;             // block_ids' rows
#if PWCTL_EXPERT_BIAS
    // fp16 biases of the routed experts (null: a group without, the shared expert's)
    const unsigned short* bias_gate_up;  // [experts, 2, I]: gate's row, then up's
    const unsigned short* bias_down;     // [experts, H]
#endif
};

// ---- the experts' activation and biases: the program's variant -------------------------------
// A program names both (pwctl/kernels/registry.py `Variant`, written as #defines by build.py), so
// the silu build without biases is the code it always was and the others cost it nothing.
// PWCTL_GLU, h = GLU(gate, up):
#define GLU_SILU 0            // silu(gate) * up
#define GLU_GELU_TANH 1       // gelu_tanh(gate) * up (Gemma-4's gelu_pytorch_tanh)
#define GLU_CLAMPED_SWIGLU 2  // GPT-OSS's, with SWIGLU_ALPHA and SWIGLU_LIMIT
// PWCTL_EXPERT_BIAS: the routed experts' gate / up biases are added before the activation and the
// down bias to each pair's down output before its routing weight multiplies it, as transformers'
// GptOssExperts does (out += w (W_d h + b_d)).
#if !defined(PWCTL_GLU) || !defined(PWCTL_EXPERT_BIAS)
#error "the program names no variant: pwctl.kernels.build writes PWCTL_GLU and PWCTL_EXPERT_BIAS"
#endif

// (__fdividef: a plain division checks its operands and branches to a slow path; for v -> -inf the
// divisor is inf and the result 0, silu's limit)
__device__ __forceinline__ float silu(float v) { return __fdividef(v, 1.f + __expf(-v)); }

#if PWCTL_GLU == GLU_GELU_TANH
// torch's gelu(approximate="tanh"): 0.5 v (1 + tanh(sqrt(2 / pi) (v + 0.044715 v^3)))
__device__ __forceinline__ float gelu_tanh(float v) {
    return 0.5f * v * (1.f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)));
}
#endif

#if PWCTL_GLU == GLU_CLAMPED_SWIGLU
// GPT-OSS: gate clamped to at most the limit, up to [-limit, limit], (up + 1) gate sigmoid(alpha
// gate). Alpha and the limit are compile-time constants of the variant (every GPT-OSS config has
// 1.702 and 7.0): kernel arguments would add two to every gate_up kernel's list, the silu build's
// too, and a variant's program costs nothing until a model asks for it.
__device__ __forceinline__ float clamped_swiglu(float gate, float up) {
    gate = fminf(gate, SWIGLU_LIMIT);
    up = fminf(fmaxf(up, -SWIGLU_LIMIT), SWIGLU_LIMIT);
    return (up + 1.f) * __fdividef(gate, 1.f + __expf(-SWIGLU_ALPHA * gate));
}
#endif

// h = GLU(gate, up). Macros, as WITH_DOWN_BIAS and STORE_H below: the silu build without biases
// is then the very expression it always was (an inlined call in its place, even an empty one,
// moved the code NVVM made of some kernels: sm_80 cubins compared before and after).
#if PWCTL_GLU == GLU_SILU
#define GLU(gate, up) (silu(gate) * (up))
#elif PWCTL_GLU == GLU_GELU_TANH
#define GLU(gate, up) (gelu_tanh(gate) * (up))
#elif PWCTL_GLU == GLU_CLAMPED_SWIGLU
#define GLU(gate, up) clamped_swiglu(gate, up)
#else
#error "PWCTL_GLU names no activation"
#endif

// Row `row` (< I) of expert e's gate and up with their biases (the bias variant; a group without
// biases, and every other variant, leaves them as they are).
#if PWCTL_EXPERT_BIAS
__device__ __forceinline__ void add_gate_up_bias(const Slots& s, int e, int row, int I, float& gate,
                                                 float& up) {
    if (s.bias_gate_up != nullptr && row < I) {
        const unsigned short* b = s.bias_gate_up + (i64)e * 2 * I + row;
        gate += h2f(__ldg(b));
        up += h2f(__ldg(b + I));
    }
}
#endif

// A down row's sum v of expert e with the expert's bias (the bias variant), added once a pair:
// by the CTA whose columns start the row (`first`; a k-split's other parts add their sums only).
#if PWCTL_EXPERT_BIAS
__device__ __forceinline__ float with_down_bias(const Slots& s, int e, int row, int H, bool first,
                                                float v) {
    if (first && s.bias_down != nullptr) v += h2f(__ldg(s.bias_down + (i64)e * H + row));
    return v;
}
#define WITH_DOWN_BIAS(s, e, row, H, first, v) with_down_bias(s, e, row, H, first, v)
#else
#define WITH_DOWN_BIAS(s, e, row, H, first, v) (v)
#endif

// h[pair, row] = GLU(gate, up), stored in fragment order for the down projection. Rows past I
// up to the padded width get zeros, so down never reads memory nobody wrote.
__device__ __forceinline__ void store_h(unsigned short* hp, int pair, int row, int I, int wpad,
                                        float gate, float up) {
    if (row >= 32 * wpad) return;
    const int col = row & 31;
    const i64 off = (i64)(row >> 5) * 32 + (2 * (col & 3) + (col >> 4)) * 4 + ((col >> 2) & 3);
    hp[(i64)pair * wpad * 32 + off] = f2h(row < I ? GLU(gate, up) : 0.f);
}

// store_h of expert e's h: in the bias variant, its gate and up biases added first.
#if PWCTL_EXPERT_BIAS
__device__ __forceinline__ void store_h_biased(const Slots& s, int e, unsigned short* hp, int pair,
                                               int row, int I, int wpad, float gate, float up) {
    add_gate_up_bias(s, e, row, I, gate, up);
    store_h(hp, pair, row, I, wpad, gate, up);
}
#define STORE_H(s, e, hp, pair, row, I, wpad, gate, up) \
    store_h_biased(s, e, hp, pair, row, I, wpad, gate, up)
#else
#define STORE_H(s, e, hp, pair, row, I, wpad, gate, up) store_h(hp, pair, row, I, wpad, gate, up)
#endif

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

// Flat kernel parameters (CuPy passes scalars and raw pointers): the descriptor, then the slots.
#define PAGED_ARGS const unsigned char *arena, const int *slab_map, const int *slab_off,             \
                   const int *width, int slab_shift, int max_bits
// (the bias variant: the biases' two pointers after the slots'; a group without passes nulls)
#if PWCTL_EXPERT_BIAS
#define BIAS_ARGS , const unsigned short *s_bias_gate_up, const unsigned short *s_bias_down
#define BIAS_FIELDS , s_bias_gate_up, s_bias_down
#define NO_BIAS , nullptr, nullptr
#else
#define BIAS_ARGS
#define BIAS_FIELDS
#define NO_BIAS
#endif
#define SLOT_ARGS const int *s_expert, const int *s_lo, const int *s_hi, const int *s_token,          \
                  const float *s_weight, const int *block_ids, int n_ids BIAS_ARGS
#define PAGED Paged{arena, slab_map, slab_off, width, slab_shift, max_bits}
#define SLOTS Slots{s_expert, s_lo, s_hi, s_token, s_weight, block_ids, n_ids BIAS_FIELDS}
#endif  // PWCTL_PLANES_CUH
