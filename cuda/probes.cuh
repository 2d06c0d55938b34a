// Timing probes and phase stamps: development builds only, never in a program the runtime
// compiles. One switch, PWCTL_PROBE, names the one a build takes (pwctl.kernels.build
// program_source(..., probe=NAME), tools/kernel-dev/write_program.py); without it every probe
// site below and in the family files compiles to nothing.
//   STAMPS             thread 0 of every CTA writes the global timer and its SM's clock at each
//                      phase of its kernel (kind: 0 gate_up, 1 down, 2 the prep launch, 3
//                      popc_planes; the sm_90a prefill kernels take kinds 0 and 1 too, with phases
//                      of their own), and its SM (tools/kernel-dev/stamp_phases.py reads them)
//   STAMPS_CHAIN       the stamps, the popc gate_up's staging chain: each stamp once the value it
//                      names has arrived (a branch on it)
//   LOAD_ONLY          the width-1-4 lookup becomes one xor: the kernels' loads and mma, wrong
//                      results (decisions/006)
//   POPC_NO_STREAM     the one-token kernels without plane loads or mma
//   POPC_NO_FOLD       the popc kernels' sums, not the fold
//   POPC_NO_COEF       the fold without tables or Moebius transform
//   PREFILL_N32, _N64  an N-token wgmma on a tile's first tokens and B copies of N tokens' bytes:
//                      what a narrower tile could save at most (wrong results; decisions/018)
//   PREFILL_NO_B       the sm_90a prefill without token-tile copies (B stays what it was)
//   PREFILL_NO_PLANES  the sm_90a prefill without plane loads (words from the lane)
#ifndef PWCTL_PROBES_CUH
#define PWCTL_PROBES_CUH

#define PROBE_STAMPS 1
#define PROBE_STAMPS_CHAIN 2
#define PROBE_LOAD_ONLY 3
#define PROBE_POPC_NO_STREAM 4
#define PROBE_POPC_NO_FOLD 5
#define PROBE_POPC_NO_COEF 6
#define PROBE_PREFILL_N32 7
#define PROBE_PREFILL_N64 8
#define PROBE_PREFILL_NO_B 9
#define PROBE_PREFILL_NO_PLANES 10
#ifndef PWCTL_PROBE
#define PWCTL_PROBE 0
#elif PWCTL_PROBE < PROBE_STAMPS || PWCTL_PROBE > PROBE_PREFILL_NO_PLANES
#error "PWCTL_PROBE names no probe of probes.cuh"
#endif
#define PROBE(name) (PWCTL_PROBE == PROBE_##name)
#define PROBE_STAMPING (PROBE(STAMPS) || PROBE(STAMPS_CHAIN))
#define PROBE_PREFILL_TOKENS (PROBE(PREFILL_N32) ? 32 : 64)  // (the PREFILL_N probes)

#define STAMP_CTAS 16384
#if PROBE_STAMPING
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
#define STAMP_FIELD(declaration) declaration
#else
#define STAMP(kind, phase)
#define STAMP_KIND(job, k)
#define STAMP_FIELD(declaration)
#endif
#if PROBE(STAMPS_CHAIN)
#define STAMP_AFTER(kind, phase, v) \
    if ((int)(v) != (int)0x80000001) STAMP(kind, phase)
#else
#define STAMP_AFTER(kind, phase, v)
#endif
#endif  // PWCTL_PROBES_CUH
