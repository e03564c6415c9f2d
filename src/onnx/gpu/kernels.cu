/* The CUDA C kernels of libinfer's GPU executor for ONNX graphs.
 *
 * One source, two compilers:
 * - NVRTC compiles it for the device (once per device, at the first model that needs it);
 * - tests compile it as C for the host (-DINFER_HOST_EMULATION) into the stand-in CUDA
 *   driver (tests/fixtures/), which runs each launch over its whole grid on the host, so
 *   the executor's use of every kernel is checked against CPU references on machines
 *   without a GPU.
 * So: C that is also valid C++, no templates, no warp intrinsics; block-shared memory and
 * barriers only through K_SHARED and K_SYNC (below), in "cooperative" kernels.
 *
 * Every kernel takes one infer_kargs by value (the same struct in Rust:
 * src/onnx/gpu/kargs.rs). Kernels loop `for (i = first; i < a.n; i += step)` with
 * first = blockIdx.x * blockDim.x + threadIdx.x and step = gridDim.x * blockDim.x, so any
 * 1-D grid covers [0, a.n) (the y and z dimensions are not used), except the cooperative
 * kernels.
 *
 * Cooperative kernels (listed in INFER_COOPERATIVE_KERNELS; today infer_softmax,
 * _layernorm, _argmax, _reduce, _cumsum, _topk) share work between the threads of a
 * block: they declare block-shared arrays with K_SHARED(type, name, count) (a static
 * size; __shared__ on the device) and wait for the whole block with K_SYNC()
 * (__syncthreads). Their rules:
 * - every thread of the block reaches every K_SYNC, the same number of times (a barrier
 *   in divergent code is undefined on a GPU): decide anything that skips a barrier from
 *   values uniform over the block (a.*, blockIdx, blockDim, gridDim, shared memory read
 *   after a barrier);
 * - they are correct for ANY launch geometry: any blockDim (x, y, z; not only powers of
 *   two; the threads are numbered K_TID in [0, K_NT), x fastest) and any grid; a block
 *   works on "tiles" of outputs in a loop `for (t = blockIdx.x; t < tiles; t += gridDim.x)`
 *   with tiles <= a.n, so a block whose blockIdx.x >= a.n does nothing (the emulator skips
 *   it); gridDim.y and .z repeat the work;
 * - a shared array reused by a later reduction must have had a barrier between the last
 *   read of the earlier one and the first write of the later one (k_team_reduce's
 *   callers alternate two buffers).
 * The host emulator runs the threads of each block of a cooperative kernel as coroutines
 * (tests/fixtures/fake_libcuda.c: ucontext, a small stack each): K_SYNC switches to the
 * next thread of the block, in thread order, then in reverse order after the next
 * barrier, and so on (so a missing barrier between one thread's read and another's
 * later write shows whichever thread is the lower), and the block goes past a barrier
 * only when every thread of the block has reached it (a thread that has returned counts
 * as arrived: on a GPU that is undefined, see above). A launch's blocks run one after
 * another on one OS thread, so K_SHARED is a thread-local static there: exactly one
 * block's shared memory. The other kernels run one thread after another, without
 * coroutines (a K_SYNC in a kernel that is not listed aborts the emulator), in thread
 * order on one launch and in reverse order on the next (so a kernel whose threads race
 * for an element shows it).
 *
 * "Strided" kernels decompose i (row-major) over a.dims[0..a.rank) into idx[d]; input
 * k's element is a.off[k] + sum idx[d] * a.strides[k][d], the output's
 * a.ooff + sum idx[d] * a.ostrides[d] (a stride of 0 broadcasts). The others are
 * described above each kernel; offsets and sizes there count elements.
 *
 * Float kernels (infer_unary, _binary, _softmax, _layernorm, _argmax, _reduce, _conv2d,
 * _im2col, _pool2d) read and write every floating-point operand in the element type
 * a.ft (0 f32, 1 f16 = IEEE binary16, 2 bf16) through k_ldf/k_stf, and compute in f32
 * (accumulators too); ArgMax's output stays i64. f16 <-> f32 is the hardware's cvt on
 * the device (inline PTX) and a software conversion on the host that gives the same
 * bits (round to nearest even, subnormals, overflow to inf, NaN -> the canonical NaN
 * 0x7fff / 0x7fffffff, as CUDA's own host fallback); bf16 is software on both (round
 * to nearest even on the f32 bits; NaN -> a quiet NaN of the same sign).
 *
 * NVRTC builds it with no headers at all (only builtins and CUDA's device math); the
 * host build (-DINFER_HOST_EMULATION) uses <math.h>, makes the kernels static functions
 * and adds infer_kernel_table; the stand-in driver gets it by #including this file
 * (tests/fixtures/fake_libcuda.c).
 */

#define INFER_K_MAX_RANK 8
#define INFER_K_MAX_IN 4

typedef struct infer_kargs {
    const void *in[4];            /* device addresses of the inputs (unused: NULL) */
    void *out;                    /* device address of the output */
    long long n;                  /* work items (see each kernel) */
    long long rank;               /* rank of the index space of strided kernels (<= 8) */
    long long dims[8];            /* its dims, row-major */
    long long strides[4][8];      /* element stride of input k along each dim (0 = broadcast) */
    long long off[4];             /* element offset of input k */
    long long ostrides[8];        /* element stride of the output along each dim */
    long long ooff;               /* element offset of the output */
    long long p[16];              /* integer parameters of each kernel */
    float f[4];                   /* float parameters of each kernel */
    long long ft;                 /* float kernels: element type, 0 f32, 1 f16, 2 bf16 */
} infer_kargs;

/* ---- operation codes --------------------------------------------------------------
 * The planner names the same codes in src/onnx/gpu/ops.rs; a test there reads this list. */

/* k_unary's operations (infer_unary's a.p[0], infer_fused's unary instructions); a.f[0], a.f[1]
 * carry LEAKY_RELU, ELU, THRESHOLDED_RELU, CELU and SWISH's alpha, CLIP's bounds, HARD_SIGMOID's
 * alpha and beta, SELU's alpha and gamma, SHRINK's bias and lambd. */
enum infer_unary_op {
    INFER_UNARY_IDENTITY = 0,
    INFER_UNARY_RELU = 1,
    INFER_UNARY_SIGMOID = 2,
    INFER_UNARY_TANH = 3,
    INFER_UNARY_ERF = 4,
    INFER_UNARY_GELU = 5,
    INFER_UNARY_GELU_TANH = 6,
    INFER_UNARY_EXP = 7,
    INFER_UNARY_LOG = 8,
    INFER_UNARY_SQRT = 9,
    INFER_UNARY_NEG = 10,
    INFER_UNARY_ABS = 11,
    INFER_UNARY_RECIPROCAL = 12,
    INFER_UNARY_LEAKY_RELU = 13,
    INFER_UNARY_CLIP = 14,
    INFER_UNARY_FLOOR = 15,
    INFER_UNARY_CEIL = 16,
    INFER_UNARY_SIN = 17,
    INFER_UNARY_COS = 18,
    INFER_UNARY_SOFTPLUS = 19,
    INFER_UNARY_HARD_SIGMOID = 20,
    INFER_UNARY_ELU = 21,
    INFER_UNARY_ROUND = 22,
    INFER_UNARY_SIGN = 23,
    INFER_UNARY_TAN = 24,
    INFER_UNARY_ASIN = 25,
    INFER_UNARY_ACOS = 26,
    INFER_UNARY_ATAN = 27,
    INFER_UNARY_SINH = 28,
    INFER_UNARY_COSH = 29,
    INFER_UNARY_ASINH = 30,
    INFER_UNARY_ACOSH = 31,
    INFER_UNARY_ATANH = 32,
    INFER_UNARY_SOFTSIGN = 33,
    INFER_UNARY_SELU = 34,
    INFER_UNARY_THRESHOLDED_RELU = 35,
    INFER_UNARY_SHRINK = 36,
    INFER_UNARY_MISH = 37,
    INFER_UNARY_HARD_SWISH = 38,
    INFER_UNARY_CELU = 39,
    INFER_UNARY_SWISH = 40,
};

/* k_binary's operations (infer_binary's a.p[0], infer_fused's binary instructions). FMOD keeps
 * the dividend's sign, MOD the divisor's. */
enum infer_binary_op {
    INFER_BINARY_ADD = 0,
    INFER_BINARY_SUB = 1,
    INFER_BINARY_MUL = 2,
    INFER_BINARY_DIV = 3,
    INFER_BINARY_POW = 4,
    INFER_BINARY_MAX = 5,
    INFER_BINARY_MIN = 6,
    INFER_BINARY_PRELU = 7,
    INFER_BINARY_FMOD = 8,
    INFER_BINARY_MOD = 9,
};

/* infer_int's operations (a.p[0]): two operands up to SHR, one from NEG on; CLIP's bounds in
 * a.p[3], a.p[4]. MOD takes the divisor's sign, FMOD the dividend's. */
enum infer_int_op {
    INFER_INT_ADD = 0,
    INFER_INT_SUB = 1,
    INFER_INT_MUL = 2,
    INFER_INT_DIV = 3,
    INFER_INT_POW = 4,
    INFER_INT_MAX = 5,
    INFER_INT_MIN = 6,
    INFER_INT_MOD = 7,
    INFER_INT_FMOD = 8,
    INFER_INT_AND = 9,
    INFER_INT_OR = 10,
    INFER_INT_XOR = 11,
    INFER_INT_SHL = 12,
    INFER_INT_SHR = 13,
    INFER_INT_NEG = 14,
    INFER_INT_ABS = 15,
    INFER_INT_SIGN = 16,
    INFER_INT_NOT = 17,
    INFER_INT_CLIP = 18,
};

/* infer_compare's operations (a.p[0]): two operands up to XOR, one from NOT on. */
enum infer_cmp_op {
    INFER_CMP_EQUAL = 0,
    INFER_CMP_LESS = 1,
    INFER_CMP_GREATER = 2,
    INFER_CMP_LESS_OR_EQUAL = 3,
    INFER_CMP_GREATER_OR_EQUAL = 4,
    INFER_CMP_AND = 5,
    INFER_CMP_OR = 6,
    INFER_CMP_XOR = 7,
    INFER_CMP_NOT = 8,
    INFER_CMP_IS_NAN = 9,
    INFER_CMP_IS_INF = 10,
};

/* infer_reduce's reductions (a.p[2]). */
enum infer_reduce_op {
    INFER_REDUCE_SUM = 0,
    INFER_REDUCE_MEAN = 1,
    INFER_REDUCE_MAX = 2,
    INFER_REDUCE_MIN = 3,
    INFER_REDUCE_PROD = 4,
    INFER_REDUCE_SUM_SQUARE = 5,
    INFER_REDUCE_L2 = 6,
    INFER_REDUCE_L1 = 7,
};

/* The kinds of infer_fused's instructions (bits 8-9). */
enum infer_fused_kind {
    INFER_FUSED_UNARY = 0,
    INFER_FUSED_BINARY = 1,
    INFER_FUSED_BINARY_IMM_B = 2,
    INFER_FUSED_BINARY_IMM_A = 3,
};

/* C checks that only want the ABI (tests/fixtures/kernels_check.c) stop here. */
#ifndef INFER_KARGS_ONLY

/* ---- two compilers ---------------------------------------------------------------- */

#if defined(__CUDACC_RTC__) || defined(__CUDACC__)
/* NVRTC (or nvcc): no headers; math comes from CUDA's device functions. */
#define KERNEL extern "C" __global__
#define DEVFN static __device__ __forceinline__
#define K_FIRST ((long long)blockIdx.x * (long long)blockDim.x + (long long)threadIdx.x)
#define K_STEP ((long long)gridDim.x * (long long)blockDim.x)
#define K_NAN __int_as_float(0x7fc00000)
#define K_INF __int_as_float(0x7f800000)
/* Cooperative kernels: this thread's index in its block (x fastest), the block's thread
 * count, the block's index and the grid's size along x. */
#define K_TID ((int)(threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)))
#define K_NT ((int)(blockDim.x * blockDim.y * blockDim.z))
#define K_BID ((long long)blockIdx.x)
#define K_NBLOCKS ((long long)gridDim.x)
/* The threads of the grid's first y/z slice (kernels that read what they write: the
 * others would race with them). */
#define K_PLANE0                                                                             \
    (blockIdx.y == 0 && blockIdx.z == 0 && threadIdx.y == 0 && threadIdx.z == 0)
#define K_SHARED(type, name, count) __shared__ type name[count]
#define K_SYNC() __syncthreads()
#elif defined(INFER_HOST_EMULATION)
/* A host C compiler, for the stand-in driver: each launch calls the kernel once per
 * (block, thread) of its grid with these thread-local coordinates set (defined by the
 * emulator, which is the only reader of infer_kernel_table); a cooperative kernel's
 * threads of one block as coroutines. */
#include <math.h>
#include <string.h>
struct infer_emu_dim3 {
    unsigned x, y, z;
};
extern __thread struct infer_emu_dim3 infer_emu_blockIdx, infer_emu_blockDim,
    infer_emu_threadIdx, infer_emu_gridDim;
#define KERNEL static
#define DEVFN static inline
#define K_FIRST                                                                              \
    ((long long)infer_emu_blockIdx.x * (long long)infer_emu_blockDim.x +                     \
     (long long)infer_emu_threadIdx.x)
#define K_STEP ((long long)infer_emu_gridDim.x * (long long)infer_emu_blockDim.x)
#define K_NAN ((float)NAN)
#define K_INF ((float)INFINITY)
#define K_TID                                                                                \
    ((int)(infer_emu_threadIdx.x +                                                           \
           infer_emu_blockDim.x *                                                            \
               (infer_emu_threadIdx.y + infer_emu_blockDim.y * infer_emu_threadIdx.z)))
#define K_NT ((int)(infer_emu_blockDim.x * infer_emu_blockDim.y * infer_emu_blockDim.z))
#define K_BID ((long long)infer_emu_blockIdx.x)
#define K_NBLOCKS ((long long)infer_emu_gridDim.x)
#define K_PLANE0                                                                             \
    (infer_emu_blockIdx.y == 0 && infer_emu_blockIdx.z == 0 && infer_emu_threadIdx.y == 0 && \
     infer_emu_threadIdx.z == 0)
/* The blocks of a launch run one after another on one OS thread: a thread-local static
 * is one block's shared memory. The barrier switches to the block's next thread (the
 * emulator runs a cooperative kernel's threads as coroutines). */
#define K_SHARED(type, name, count) static __thread type name[count]
void infer_emu_syncthreads(void);
#define K_SYNC() infer_emu_syncthreads()
#else
#error "kernels.cu: compile with NVRTC, or with -DINFER_HOST_EMULATION for the host"
#endif

#define K_LOOP(i) for (long long i = K_FIRST; i < a.n; i += K_STEP)

/* Every kernel, once: the prototypes below and the emulator's table at the end come from
 * this list. A listed kernel that is not defined leaves the stand-in driver with an
 * undefined symbol (the compiler warns; the library fails to load); one defined but not
 * listed is an unused static function on the host (-Wall warns) and missing from the
 * table (kernels_check.c asks the driver for every kernel by name). */
#define INFER_KERNELS(X)                                                                     \
    X(infer_unary)                                                                           \
    X(infer_binary)                                                                          \
    X(infer_strided_copy)                                                                    \
    X(infer_cast)                                                                            \
    X(infer_softmax)                                                                         \
    X(infer_layernorm)                                                                       \
    X(infer_argmax)                                                                          \
    X(infer_reduce)                                                                          \
    X(infer_gather)                                                                          \
    X(infer_conv2d)                                                                          \
    X(infer_im2col)                                                                          \
    X(infer_pool2d)                                                                          \
    X(infer_fill)                                                                            \
    X(infer_where)                                                                           \
    X(infer_fused)                                                                           \
    X(infer_compare)                                                                         \
    X(infer_pad)                                                                             \
    X(infer_col2im)                                                                          \
    X(infer_resize)                                                                          \
    X(infer_int)                                                                             \
    X(infer_cumsum)                                                                          \
    X(infer_gather_elements)                                                                 \
    X(infer_scatter_elements)                                                                \
    X(infer_topk)                                                                            \
    X(infer_nd)                                                                              \
    X(infer_rope)

/* The cooperative kernels (K_SHARED, K_SYNC; see the top of this file): the emulator runs
 * the threads of their blocks as coroutines (infer_cooperative_kernels at the end). */
#define INFER_COOPERATIVE_KERNELS(X)                                                         \
    X(infer_softmax)                                                                         \
    X(infer_layernorm)                                                                       \
    X(infer_argmax)                                                                          \
    X(infer_reduce)                                                                          \
    X(infer_cumsum)                                                                          \
    X(infer_topk)

#define INFER_DECLARE(k) KERNEL void k(infer_kargs a);
INFER_KERNELS(INFER_DECLARE)
#undef INFER_DECLARE

/* ---- helpers ---------------------------------------------------------------------- */

/* Strided indexing: decomposes i (row-major) over a.dims[0..a.rank) into the element
 * offsets of the first nin inputs (o[k]) and of the output (*oo). 32-bit divisions when
 * the index space allows (the common case: 64-bit ones are many instructions on a GPU). */
#define K_STRIDED_STEP(a, T, rem, nin, o, oo)                                                \
    for (int d_ = (int)(a).rank - 1; d_ >= 0; d_--) {                                        \
        T dim_ = (T)(a).dims[d_];                                                            \
        T q_ = (rem) / dim_;                                                                 \
        long long x_ = (long long)((rem) - q_ * dim_);                                       \
        (rem) = q_;                                                                          \
        (oo) += x_ * (a).ostrides[d_];                                                       \
        for (int k_ = 0; k_ < (nin); k_++)                                                   \
            (o)[k_] += x_ * (a).strides[k_][d_];                                             \
    }
#define K_STRIDED(a, i, nin, o, oo)                                                          \
    do {                                                                                     \
        (oo) = (a).ooff;                                                                     \
        for (int k_ = 0; k_ < (nin); k_++)                                                   \
            (o)[k_] = (a).off[k_];                                                           \
        if ((a).n <= 0xffffffffLL) {                                                         \
            unsigned rem32_ = (unsigned)(i);                                                 \
            K_STRIDED_STEP(a, unsigned, rem32_, nin, o, oo)                                  \
        } else {                                                                             \
            unsigned long long rem64_ = (unsigned long long)(i);                             \
            K_STRIDED_STEP(a, unsigned long long, rem64_, nin, o, oo)                        \
        }                                                                                    \
    } while (0)

/* Copies one element of `size` bytes (1, 2, 4 or 8 as one access; else byte by byte). */
DEVFN void k_copy_elem(void *dst, const void *src, long long size) {
    switch (size) {
    case 1: *(unsigned char *)dst = *(const unsigned char *)src; break;
    case 2: *(unsigned short *)dst = *(const unsigned short *)src; break;
    case 4: *(unsigned int *)dst = *(const unsigned int *)src; break;
    case 8: *(unsigned long long *)dst = *(const unsigned long long *)src; break;
    default:
        for (long long b = 0; b < size; b++)
            ((unsigned char *)dst)[b] = ((const unsigned char *)src)[b];
    }
}

DEVFN void k_store_bits(void *dst, unsigned long long bits, long long size) {
    switch (size) {
    case 1: *(unsigned char *)dst = (unsigned char)bits; break;
    case 2: *(unsigned short *)dst = (unsigned short)bits; break;
    case 4: *(unsigned int *)dst = (unsigned int)bits; break;
    case 8: *(unsigned long long *)dst = bits; break;
    default:
        for (long long b = 0; b < size; b++)
            ((unsigned char *)dst)[b] = (unsigned char)(b < 8 ? bits >> (8 * b) : 0);
    }
}

/* ---- f16 / bf16 storage ----------------------------------------------------------- */

#if defined(__CUDACC_RTC__) || defined(__CUDACC__)
DEVFN unsigned k_f2u(float f) { return __float_as_uint(f); }
DEVFN float k_u2f(unsigned u) { return __uint_as_float(u); }
#else
DEVFN unsigned k_f2u(float f) {
    unsigned u;
    memcpy(&u, &f, sizeof u);
    return u;
}
DEVFN float k_u2f(unsigned u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
#endif

/* IEEE binary16 bits -> f32 (exact; NaN -> 0x7fffffff). */
DEVFN float k_f16_to_f32(unsigned short h) {
#if defined(__CUDACC_RTC__) || defined(__CUDACC__)
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else
    unsigned sign = ((unsigned)h & 0x8000u) << 16, e = ((unsigned)h >> 10) & 0x1fu,
             m = (unsigned)h & 0x3ffu;
    if (e == 0x1fu)
        return k_u2f(m != 0 ? 0x7fffffffu : sign | 0x7f800000u);
    if (e == 0) { /* zero or subnormal: m * 2^-24, exact in f32 */
        float v = (float)m * 5.9604644775390625e-8f;
        return sign != 0 ? -v : v;
    }
    return k_u2f(sign | ((e + 112u) << 23) | (m << 13));
#endif
}

/* f32 -> IEEE binary16 bits, rounded to nearest even (subnormals; overflow to inf;
 * NaN -> 0x7fff). */
DEVFN unsigned short k_f32_to_f16(float f) {
#if defined(__CUDACC_RTC__) || defined(__CUDACC__)
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#else
    unsigned x = k_f2u(f);
    unsigned sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u)
        return (unsigned short)0x7fffu;
    if (ax >= 0x477ff000u) /* >= 65520 (65504 + half its ulp, a tie to even): inf */
        return (unsigned short)(sign | 0x7c00u);
    if (ax >= 0x38800000u) { /* >= 2^-14: normal; rebias the exponent, round 13 bits */
        unsigned m = ax - 0x38000000u;
        return (unsigned short)(sign | ((m + 0xfffu + ((m >> 13) & 1u)) >> 13));
    }
    if (ax < 0x33000000u) /* < 2^-25: rounds to zero */
        return (unsigned short)sign;
    /* subnormal: the significand in units of 2^-24, rounded to nearest even */
    unsigned e = ax >> 23, sig = (ax & 0x7fffffu) | 0x800000u, shift = 126u - e;
    unsigned q = sig >> shift, rem = sig & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u) != 0))
        q++;
    return (unsigned short)(sign | q);
#endif
}

/* bf16 bits -> f32 (exact). */
DEVFN float k_bf16_to_f32(unsigned short b) { return k_u2f((unsigned)b << 16); }

/* f32 -> bf16 bits, rounded to nearest even (overflow to inf; NaN -> a quiet NaN of the
 * same sign). */
DEVFN unsigned short k_f32_to_bf16(float f) {
    unsigned x = k_f2u(f);
    if ((x & 0x7fffffffu) > 0x7f800000u)
        return (unsigned short)((x >> 16) | 0x40u);
    return (unsigned short)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

/* Element i of a float operand of type ft (0 f32, 1 f16, 2 bf16; others read as f32). */
DEVFN float k_ldf(const void *p, long long i, long long ft) {
    if (ft == 1)
        return k_f16_to_f32(((const unsigned short *)p)[i]);
    if (ft == 2)
        return k_bf16_to_f32(((const unsigned short *)p)[i]);
    return ((const float *)p)[i];
}

DEVFN void k_stf(void *p, long long i, long long ft, float v) {
    if (ft == 1)
        ((unsigned short *)p)[i] = k_f32_to_f16(v);
    else if (ft == 2)
        ((unsigned short *)p)[i] = k_f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

/* ---- the operations --------------------------------------------------------------- */

DEVFN float k_unary(long long op, float x, float f0, float f1) {
    switch (op) {
    case INFER_UNARY_IDENTITY: return x;
    case INFER_UNARY_RELU: return x < 0.0f ? 0.0f : x; /* NaN stays NaN */
    case INFER_UNARY_SIGMOID: return 1.0f / (1.0f + expf(-x));
    case INFER_UNARY_TANH: return tanhf(x);
    case INFER_UNARY_ERF: return erff(x);
    case INFER_UNARY_GELU: return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
    case INFER_UNARY_GELU_TANH: {
        float u = 0.79788456080286536f * (x + 0.044715f * x * x * x); /* sqrt(2/pi) */
        return 0.5f * x * (1.0f + tanhf(u));
    }
    case INFER_UNARY_EXP: return expf(x);
    case INFER_UNARY_LOG: return logf(x);
    case INFER_UNARY_SQRT: return sqrtf(x);
    case INFER_UNARY_NEG: return -x;
    case INFER_UNARY_ABS: return fabsf(x);
    case INFER_UNARY_RECIPROCAL: return 1.0f / x;
    case INFER_UNARY_LEAKY_RELU: return x < 0.0f ? f0 * x : x;
    case INFER_UNARY_CLIP: return x < f0 ? f0 : (x > f1 ? f1 : x); /* NaN stays NaN */
    case INFER_UNARY_FLOOR: return floorf(x);
    case INFER_UNARY_CEIL: return ceilf(x);
    case INFER_UNARY_SIN: return sinf(x);
    case INFER_UNARY_COS: return cosf(x);
    case INFER_UNARY_SOFTPLUS: /* log(1 + e^x), without overflow for large x */
        return (x > 0.0f ? x : 0.0f) + log1pf(expf(-fabsf(x)));
    case INFER_UNARY_HARD_SIGMOID: {
        float y = f0 * x + f1;
        return y < 0.0f ? 0.0f : (y > 1.0f ? 1.0f : y);
    }
    case INFER_UNARY_ELU: return x > 0.0f ? x : f0 * expm1f(x);
    case INFER_UNARY_ROUND: return rintf(x); /* halves to even (the default rounding mode) */
    case INFER_UNARY_SIGN: return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : x); /* 0, -0 and NaN stay */
    case INFER_UNARY_TAN: return tanf(x);
    case INFER_UNARY_ASIN: return asinf(x);
    case INFER_UNARY_ACOS: return acosf(x);
    case INFER_UNARY_ATAN: return atanf(x);
    case INFER_UNARY_SINH: return sinhf(x);
    case INFER_UNARY_COSH: return coshf(x);
    case INFER_UNARY_ASINH: return asinhf(x);
    case INFER_UNARY_ACOSH: return acoshf(x);
    case INFER_UNARY_ATANH: return atanhf(x);
    case INFER_UNARY_SOFTSIGN: return x / (1.0f + fabsf(x));
    case INFER_UNARY_SELU: return x > 0.0f ? f1 * x : f1 * (f0 * expf(x) - f0);
    case INFER_UNARY_THRESHOLDED_RELU: return x > f0 ? x : (x != x ? x : 0.0f);
    case INFER_UNARY_SHRINK: return x < -f1 ? x + f0 : (x > f1 ? x - f0 : (x != x ? x : 0.0f));
    case INFER_UNARY_MISH: /* x tanh(softplus(x)) */
        return x * tanhf((x > 0.0f ? x : 0.0f) + log1pf(expf(-fabsf(x))));
    case INFER_UNARY_HARD_SWISH: {
        float h = x / 6.0f + 0.5f;
        return x * (h < 0.0f ? 0.0f : (h > 1.0f ? 1.0f : h));
    }
    case INFER_UNARY_CELU:
        return (x > 0.0f ? x : 0.0f) + fminf(0.0f, f0 * expm1f(x / f0));
    case INFER_UNARY_SWISH: return x / (1.0f + expf(-f0 * x)); /* x sigmoid(alpha x) */
    default: return K_NAN;
    }
}

DEVFN float k_binary(long long op, float x, float y) {
    switch (op) {
    case INFER_BINARY_ADD: return x + y;
    case INFER_BINARY_SUB: return x - y;
    case INFER_BINARY_MUL: return x * y;
    case INFER_BINARY_DIV: return x / y;
    case INFER_BINARY_POW: return powf(x, y);
    case INFER_BINARY_MAX: return x != x ? x : (x > y ? x : y); /* NaN in either wins */
    case INFER_BINARY_MIN: return x != x ? x : (x < y ? x : y);
    case INFER_BINARY_PRELU: return x < 0.0f ? x * y : x;
    case INFER_BINARY_FMOD: return fmodf(x, y); /* the dividend's sign */
    case INFER_BINARY_MOD: { /* the divisor's sign */
        float m = fmodf(x, y);
        return m != 0.0f && ((m < 0.0f) != (y < 0.0f)) ? m + y : m;
    }
    default: return K_NAN;
    }
}

/* ---- the kernels ------------------------------------------------------------------ */

/* Strided; a.p[0] the operation, a.f[0], a.f[1] its parameters. */
KERNEL void infer_unary(infer_kargs a) {
    const void *x = a.in[0];
    void *y = a.out;
    long long ft = a.ft;
    K_LOOP(i) {
        long long o[1], oo;
        K_STRIDED(a, i, 1, o, oo);
        k_stf(y, oo, ft, k_unary(a.p[0], k_ldf(x, o[0], ft), a.f[0], a.f[1]));
    }
}

/* Strided over in0 and in1; a.p[0] the operation. */
KERNEL void infer_binary(infer_kargs a) {
    const void *x = a.in[0];
    const void *w = a.in[1];
    void *y = a.out;
    long long ft = a.ft;
    K_LOOP(i) {
        long long o[2], oo;
        K_STRIDED(a, i, 2, o, oo);
        k_stf(y, oo, ft, k_binary(a.p[0], k_ldf(x, o[0], ft), k_ldf(w, o[1], ft)));
    }
}

/* a.p[1]: element size in bytes. */
KERNEL void infer_strided_copy(infer_kargs a) {
    const unsigned char *x = (const unsigned char *)a.in[0];
    unsigned char *y = (unsigned char *)a.out;
    long long size = a.p[1];
    K_LOOP(i) {
        long long o[1], oo;
        K_STRIDED(a, i, 1, o, oo);
        k_copy_elem(y + oo * size, x + o[0] * size, size);
    }
}

/* Type codes: 0 f32, 1 u8, 2 i8, 3 i32, 4 i64, 5 bool, 6 u16, 7 i16, 8 u32, 9 u64, 10 f64,
 * 11 f16, 12 bf16. To f16/bf16: the value as f32 (a float source's double rounded to
 * f32, an integer converted to f32), then rounded to nearest even. */
KERNEL void infer_cast(infer_kargs a) {
    const void *x = a.in[0];
    void *y = a.out;
    long long from = a.p[1], to = a.p[2];
    K_LOOP(i) {
        /* The value: a double (from f32/f64) or the integer's 64 bits (signed or not). */
        double d = 0.0;
        unsigned long long u = 0;
        int is_float = 0, is_signed = 0;
        switch (from) {
        case 0: d = (double)((const float *)x)[i]; is_float = 1; break;
        case 1: u = ((const unsigned char *)x)[i]; break;
        case 2: u = (unsigned long long)(long long)((const signed char *)x)[i]; is_signed = 1; break;
        case 3: u = (unsigned long long)(long long)((const int *)x)[i]; is_signed = 1; break;
        case 4: u = (unsigned long long)((const long long *)x)[i]; is_signed = 1; break;
        case 5: u = ((const unsigned char *)x)[i] != 0; break;
        case 6: u = ((const unsigned short *)x)[i]; break;
        case 7: u = (unsigned long long)(long long)((const short *)x)[i]; is_signed = 1; break;
        case 8: u = ((const unsigned int *)x)[i]; break;
        case 9: u = ((const unsigned long long *)x)[i]; break;
        case 10: d = ((const double *)x)[i]; is_float = 1; break;
        case 11: d = (double)k_f16_to_f32(((const unsigned short *)x)[i]); is_float = 1; break;
        case 12: d = (double)k_bf16_to_f32(((const unsigned short *)x)[i]); is_float = 1; break;
        default: d = (double)K_NAN; is_float = 1; break;
        }
        if (to == 0) {
            ((float *)y)[i] = is_float ? (float)d : is_signed ? (float)(long long)u : (float)u;
            continue;
        }
        if (to == 11 || to == 12) {
            float v = is_float ? (float)d : is_signed ? (float)(long long)u : (float)u;
            ((unsigned short *)y)[i] = to == 11 ? k_f32_to_f16(v) : k_f32_to_bf16(v);
            continue;
        }
        if (to == 10) {
            ((double *)y)[i] = is_float ? d : is_signed ? (double)(long long)u : (double)u;
            continue;
        }
        if (to == 5) {
            ((unsigned char *)y)[i] = (unsigned char)(is_float ? d != 0.0 : u != 0);
            continue;
        }
        if (is_float) {
            /* Toward zero; NaN -> 0; saturated at the i64 range (u64: at its own range
             * for values >= 2^63); narrower types then keep the low bits. */
            if (d != d)
                u = 0;
            else if (to == 9 && d >= 9223372036854775808.0)
                u = d >= 18446744073709551616.0 ? ~0ULL : (unsigned long long)d;
            else if (d >= 9223372036854775808.0)
                u = 0x7fffffffffffffffULL;
            else if (d <= -9223372036854775808.0)
                u = 0x8000000000000000ULL;
            else
                u = (unsigned long long)(long long)d;
        }
        switch (to) {
        case 1: ((unsigned char *)y)[i] = (unsigned char)u; break;
        case 2: ((signed char *)y)[i] = (signed char)(unsigned char)u; break;
        case 3: ((int *)y)[i] = (int)(unsigned int)u; break;
        case 4: ((long long *)y)[i] = (long long)u; break;
        case 6: ((unsigned short *)y)[i] = (unsigned short)u; break;
        case 7: ((short *)y)[i] = (short)(unsigned short)u; break;
        case 8: ((unsigned int *)y)[i] = (unsigned int)u; break;
        case 9: ((unsigned long long *)y)[i] = u; break;
        default: break;
        }
    }
}

/* ---- cooperative kernels ---------------------------------------------------------- */

/* The most threads of a block the cooperative kernels use (CUDA's limit; threads past it
 * would only join the barriers): the size of their shared arrays. */
#define K_MAX_BLOCK 1024

/* How a cooperative kernel shares out a block: its outputs (each a reduction over `len`
 * elements, `inner` apart) come in tiles of `lanes` consecutive outputs, each worked on
 * by `groups` threads (g = 0 .. groups-1, each taking elements g, g + groups, ...); the
 * block's threads past lanes * groups are idle (g >= groups) and only join the barriers.
 * Loads coalesce either way: where an output's elements are contiguous (inner == 1),
 * consecutive threads take consecutive elements of one output (thread = lane * groups +
 * g); else consecutive threads take the same element of consecutive outputs, which are
 * then contiguous (thread = g * lanes + lane). The thread's slot in a shared array is
 * lane * ls + g * gs, which is its K_TID. Any block size works (not only powers of two);
 * Kernels::launch (src/onnx/gpu/kernels.rs) mirrors this split to size its grids. */
typedef struct k_team {
    int lanes, groups; /* outputs per tile, threads per output */
    int lane, g;       /* this thread's output in the tile and its index among its threads */
    int ls, gs;        /* slot strides of lane and g */
} k_team;

DEVFN k_team k_team_make(long long len, long long inner) {
    k_team t;
    int tid = K_TID, nt = K_NT;
    if (nt > K_MAX_BLOCK)
        nt = K_MAX_BLOCK;
    /* as many threads per output as it has elements, the block's width at most; when the
     * outputs are strided, first enough lanes for the contiguous run of outputs */
    long long lanes = inner < nt ? (inner > 1 ? inner : 1) : nt;
    long long per = nt / lanes;
    t.groups = (int)(len < per ? (len > 1 ? len : 1) : per);
    t.lanes = nt / t.groups;
    if (inner == 1) {
        t.ls = t.groups;
        t.gs = 1;
        t.lane = tid / t.groups;
        t.g = t.lane < t.lanes ? tid - t.lane * t.groups : t.groups;
    } else {
        t.ls = 1;
        t.gs = t.lanes;
        t.lane = tid % t.lanes;
        t.g = tid / t.lanes;
    }
    return t;
}

/* Partial results combined: 0 sums, 1 maxima, 2 minima (a NaN in either wins), 3
 * products. */
DEVFN float k_combine(int how, float x, float y) {
    switch (how) {
    case 1: return y > x || y != y ? y : x;
    case 2: return y < x || y != y ? y : x;
    case 3: return x * y;
    default: return x + y;
    }
}

/* Combines v over the threads of each output of the tile (a tree over g, any number of
 * groups); returns the result to those threads (to idle ones: v). Every thread of the
 * block calls it (barriers, unless groups == 1: then it is v, with no barrier and buf
 * unused). buf: K_MAX_BLOCK floats of shared memory that no thread still reads from an
 * earlier call (a barrier must lie between; callers alternate two buffers). */
DEVFN float k_team_reduce(const k_team *t, float *buf, int how, float v) {
    if (t->groups <= 1)
        return v;
    int tid = K_TID, on = t->g < t->groups;
    if (on)
        buf[tid] = v;
    K_SYNC();
    for (int m = t->groups; m > 1;) {
        int h = (m + 1) / 2; /* groups [h, m) fold into [0, m - h) */
        if (t->g < m - h)
            buf[tid] = k_combine(how, buf[tid], buf[tid + h * t->gs]);
        K_SYNC();
        m = h;
    }
    return on ? buf[t->lane * t->ls] : v;
}

/* Is (v, i) a better partial ArgMax (ArgMin) than (bv, bi)? An index < 0 is none; the
 * values are never NaN; of equal values the lower index wins. */
DEVFN int k_arg_better(int argmin, float v, long long i, float bv, long long bi) {
    if (i < 0)
        return 0;
    if (bi < 0 || (argmin ? v < bv : v > bv))
        return 1;
    return v == bv && i < bi;
}

/* k_team_reduce for (value, index) pairs; returns the index. */
DEVFN long long k_team_argreduce(const k_team *t, float *bv, long long *bi, int argmin,
                                 float v, long long i) {
    if (t->groups <= 1)
        return i;
    int tid = K_TID, on = t->g < t->groups;
    if (on) {
        bv[tid] = v;
        bi[tid] = i;
    }
    K_SYNC();
    for (int m = t->groups; m > 1;) {
        int h = (m + 1) / 2;
        if (t->g < m - h) {
            int p = tid + h * t->gs;
            if (k_arg_better(argmin, bv[p], bi[p], bv[tid], bi[tid])) {
                bv[tid] = bv[p];
                bi[tid] = bi[p];
            }
        }
        K_SYNC();
        m = h;
    }
    return on ? bi[t->lane * t->ls] : i;
}

/* n rows of a.p[0] columns; a.p[1] = 1: LogSoftmax. Cooperative: a k_team output per row
 * (max, then sum of exponentials, then the outputs). */
KERNEL void infer_softmax(infer_kargs a) {
    K_SHARED(float, red, 2 * K_MAX_BLOCK);
    const void *x = a.in[0];
    void *y = a.out;
    long long cols = a.p[0], ft = a.ft;
    int log_softmax = a.p[1] == 1;
    if (cols <= 0)
        return;
    k_team t = k_team_make(cols, 1);
    long long tiles = (a.n + t.lanes - 1) / t.lanes;
    for (long long tile = K_BID; tile < tiles; tile += K_NBLOCKS) {
        long long r = tile * t.lanes + t.lane;
        /* this thread's columns: c0, c0 + groups, ... (none: idle, or past the last row) */
        long long c0 = t.g < t.groups && r < a.n ? t.g : cols, b = r * cols;
        float m = -K_INF;
        for (long long c = c0; c < cols; c += t.groups) {
            float v = k_ldf(x, b + c, ft);
            m = v > m || v != v ? v : m; /* NaN propagates */
        }
        m = k_team_reduce(&t, red, 1, m);
        float s = 0.0f;
        for (long long c = c0; c < cols; c += t.groups)
            s += expf(k_ldf(x, b + c, ft) - m);
        s = k_team_reduce(&t, red + K_MAX_BLOCK, 0, s);
        if (log_softmax) {
            float ls = logf(s);
            for (long long c = c0; c < cols; c += t.groups)
                k_stf(y, b + c, ft, k_ldf(x, b + c, ft) - m - ls);
        } else {
            float inv = 1.0f / s;
            for (long long c = c0; c < cols; c += t.groups)
                k_stf(y, b + c, ft, expf(k_ldf(x, b + c, ft) - m) * inv);
        }
    }
}

/* n rows of a.p[0] columns; in[1] scale, in[2] bias or NULL; eps a.f[0]. a.p[1] = 1:
 * RMSNormalization (no mean: the deviations are the values). in[3] not NULL: also writes
 * each row's mean (0 for RMS) and 1 / sqrt(variance + eps) as f32, at [r] and [n + r] of
 * in[3]. Cooperative: a k_team output per row (mean, then the variance of the deviations,
 * then the outputs). */
KERNEL void infer_layernorm(infer_kargs a) {
    K_SHARED(float, red, 2 * K_MAX_BLOCK);
    const void *x = a.in[0];
    const void *scale = a.in[1];
    const void *bias = a.in[2];
    float *stats = (float *)a.in[3];
    void *y = a.out;
    long long cols = a.p[0], ft = a.ft;
    int rms = a.p[1] == 1;
    if (cols <= 0)
        return;
    k_team t = k_team_make(cols, 1);
    long long tiles = (a.n + t.lanes - 1) / t.lanes;
    for (long long tile = K_BID; tile < tiles; tile += K_NBLOCKS) {
        long long r = tile * t.lanes + t.lane;
        long long c0 = t.g < t.groups && r < a.n ? t.g : cols, b = r * cols;
        float mean = 0.0f;
        if (!rms) {
            for (long long c = c0; c < cols; c += t.groups)
                mean += k_ldf(x, b + c, ft);
            mean = k_team_reduce(&t, red, 0, mean) / (float)cols;
        }
        float var = 0.0f;
        for (long long c = c0; c < cols; c += t.groups) {
            float d = k_ldf(x, b + c, ft) - mean;
            var += d * d;
        }
        var = k_team_reduce(&t, red + K_MAX_BLOCK, 0, var) / (float)cols;
        float inv = 1.0f / sqrtf(var + a.f[0]);
        if (stats != 0 && t.g == 0 && r < a.n) {
            stats[r] = mean;
            stats[a.n + r] = inv;
        }
        for (long long c = c0; c < cols; c += t.groups) {
            float v = (k_ldf(x, b + c, ft) - mean) * inv * k_ldf(scale, c, ft);
            k_stf(y, b + c, ft, bias != 0 ? v + k_ldf(bias, c, ft) : v);
        }
    }
}

/* n = outer * inner; a.p[0] axis size, a.p[1] inner, a.p[2] = 1: ArgMin. i64 output: the
 * first index of the extreme value; NaN never wins (all NaN, or axis 0: index 0).
 * Cooperative: a k_team output per output. */
KERNEL void infer_argmax(infer_kargs a) {
    K_SHARED(float, sv, K_MAX_BLOCK);
    K_SHARED(long long, si, K_MAX_BLOCK);
    const void *x = a.in[0];
    long long *y = (long long *)a.out;
    long long axis = a.p[0], inner = a.p[1], ft = a.ft;
    int argmin = a.p[2] == 1;
    if (inner <= 0)
        return;
    k_team t = k_team_make(axis, inner);
    long long tiles = (a.n + t.lanes - 1) / t.lanes;
    for (long long tile = K_BID; tile < tiles; tile += K_NBLOCKS) {
        long long i = tile * t.lanes + t.lane;
        int mine = t.g < t.groups && i < a.n;
        long long o = i / inner, b = o * axis * inner + (i - o * inner);
        float bv = 0.0f;
        long long bi = -1; /* none yet */
        for (long long j = mine ? t.g : axis; j < axis; j += t.groups) {
            float v = k_ldf(x, b + j * inner, ft);
            if (v != v)
                continue; /* NaN never wins */
            if (bi < 0 || (argmin ? v < bv : v > bv)) {
                bv = v;
                bi = j;
            }
        }
        bi = k_team_argreduce(&t, sv, si, argmin, bv, bi);
        if (mine && t.g == 0)
            y[i] = bi < 0 ? 0 : bi;
        if (t.groups > 1)
            K_SYNC(); /* everyone has read sv, si before the next tile writes them */
    }
}

/* n = outer * inner; a.p[0] axis size, a.p[1] inner, a.p[2] the reduction: 0 sum, 1 mean,
 * 2 max, 3 min (NaN propagates), 4 product, 5 sum of squares, 6 L2 norm, 7 L1 norm;
 * others NaN. Cooperative: a k_team output per output. */
KERNEL void infer_reduce(infer_kargs a) {
    K_SHARED(float, red, 2 * K_MAX_BLOCK);
    const void *x = a.in[0];
    void *y = a.out;
    long long axis = a.p[0], inner = a.p[1], op = a.p[2], ft = a.ft;
    if (inner <= 0)
        return;
    /* how partials combine */
    int how = op == INFER_REDUCE_MAX ? 1 : op == INFER_REDUCE_MIN ? 2 : op == INFER_REDUCE_PROD ? 3 : 0;
    float init = op == INFER_REDUCE_MAX    ? -K_INF
                 : op == INFER_REDUCE_MIN  ? K_INF
                 : op == INFER_REDUCE_PROD ? 1.0f
                                           : 0.0f;
    k_team t = k_team_make(axis, inner);
    long long tiles = (a.n + t.lanes - 1) / t.lanes;
    int half = 0; /* which half of red this tile uses */
    for (long long tile = K_BID; tile < tiles; tile += K_NBLOCKS) {
        long long i = tile * t.lanes + t.lane;
        int mine = t.g < t.groups && i < a.n;
        long long o = i / inner, b = o * axis * inner + (i - o * inner);
        float acc = init;
        for (long long j = mine ? t.g : axis; j < axis; j += t.groups) {
            float v = k_ldf(x, b + j * inner, ft);
            switch (op) {
            case INFER_REDUCE_SUM: case INFER_REDUCE_MEAN: acc += v; break;
            case INFER_REDUCE_MAX: acc = v > acc || v != v ? v : acc; break; /* NaN propagates */
            case INFER_REDUCE_MIN: acc = v < acc || v != v ? v : acc; break;
            case INFER_REDUCE_PROD: acc *= v; break;
            case INFER_REDUCE_SUM_SQUARE: case INFER_REDUCE_L2: acc += v * v; break;
            case INFER_REDUCE_L1: acc += fabsf(v); break;
            default: break;
            }
        }
        acc = k_team_reduce(&t, red + half * K_MAX_BLOCK, how, acc);
        half ^= 1;
        if (!mine || t.g != 0)
            continue;
        if (op == INFER_REDUCE_MEAN)
            acc /= (float)axis;
        else if (op == INFER_REDUCE_L2)
            acc = sqrtf(acc);
        else if (op < INFER_REDUCE_SUM || op > INFER_REDUCE_L1)
            acc = K_NAN;
        k_stf(y, i, ft, acc);
    }
}

/* n = outer * ni * inner; a.p: 0 outer, 1 axis, 2 ni, 3 inner, 4 element size,
 * 5 index type (0 i64, 1 i32). */
KERNEL void infer_gather(infer_kargs a) {
    const unsigned char *data = (const unsigned char *)a.in[0];
    unsigned char *y = (unsigned char *)a.out;
    long long axis = a.p[1], ni = a.p[2], inner = a.p[3], size = a.p[4];
    K_LOOP(i) {
        long long k = i % inner, t = i / inner;
        long long j = t % ni, o = t / ni;
        long long idx = a.p[5] == 1 ? (long long)((const int *)a.in[1])[j]
                                    : ((const long long *)a.in[1])[j];
        if (idx < 0)
            idx += axis;
        if (idx < 0 || idx >= axis)
            k_store_bits(y + i * size, 0, size);
        else
            k_copy_elem(y + i * size, data + ((o * axis + idx) * inner + k) * size, size);
    }
}

/* NCHW direct convolution, n = N*K*OH*OW; in: x, w [K, C/groups, R, S], bias or NULL.
 * a.p: 0 C, 1 H, 2 W, 3 K, 4 R, 5 S, 6 OH, 7 OW, 8 stride_h, 9 stride_w, 10 pad_top,
 * 11 pad_left, 12 dilation_h, 13 dilation_w, 14 groups, 15 activation (1 relu). */
KERNEL void infer_conv2d(infer_kargs a) {
    const void *x = a.in[0];
    const void *w = a.in[1];
    const void *bias = a.in[2];
    void *y = a.out;
    long long ft = a.ft;
    long long C = a.p[0], H = a.p[1], W = a.p[2], K = a.p[3], R = a.p[4], S = a.p[5];
    long long OH = a.p[6], OW = a.p[7], sh = a.p[8], sw = a.p[9], pt = a.p[10],
              pl = a.p[11], dh = a.p[12], dw = a.p[13], groups = a.p[14];
    long long Cg = groups > 1 ? C / groups : C, Kg = groups > 1 ? K / groups : K;
    if (Kg <= 0)
        Kg = 1;
    K_LOOP(i) {
        long long ow = i % OW, t = i / OW;
        long long oh = t % OH;
        t /= OH;
        long long kk = t % K, nb = t / K;
        long long g = kk / Kg;
        float acc = 0.0f;
        for (long long c = 0; c < Cg; c++) {
            long long xc = (nb * C + g * Cg + c) * H * W;
            long long wc = (kk * Cg + c) * R * S;
            for (long long r = 0; r < R; r++) {
                long long ih = oh * sh - pt + r * dh;
                if (ih < 0 || ih >= H)
                    continue;
                for (long long s = 0; s < S; s++) {
                    long long iw = ow * sw - pl + s * dw;
                    if (iw < 0 || iw >= W)
                        continue;
                    acc += k_ldf(x, xc + ih * W + iw, ft) * k_ldf(w, wc + r * S + s, ft);
                }
            }
        }
        if (bias != 0)
            acc += k_ldf(bias, kk, ft);
        if (a.p[15] == 1 && acc < 0.0f)
            acc = 0.0f;
        k_stf(y, i, ft, acc);
    }
}

/* The columns of a convolution, for a GEMM: n = N*C*R*S*OH*OW, out laid out as
 * [N][C*R*S][OH*OW]; taps outside the image are zero. a.p as infer_conv2d: 0 C,
 * 1 H, 2 W, 4 R, 5 S, 6 OH, 7 OW, 8 stride_h, 9 stride_w, 10 pad_top, 11 pad_left,
 * 12 dilation_h, 13 dilation_w. */
KERNEL void infer_im2col(infer_kargs a) {
    const void *x = a.in[0];
    void *y = a.out;
    long long ft = a.ft;
    long long C = a.p[0], H = a.p[1], W = a.p[2], R = a.p[4], S = a.p[5];
    long long OH = a.p[6], OW = a.p[7], sh = a.p[8], sw = a.p[9], pt = a.p[10],
              pl = a.p[11], dh = a.p[12], dw = a.p[13];
    K_LOOP(i) {
        long long ow = i % OW, t = i / OW;
        long long oh = t % OH;
        t /= OH;
        long long s = t % S;
        t /= S;
        long long r = t % R;
        t /= R;
        long long c = t % C, nb = t / C;
        long long ih = oh * sh - pt + r * dh, iw = ow * sw - pl + s * dw;
        int inside = ih >= 0 && ih < H && iw >= 0 && iw < W;
        k_stf(y, i, ft, inside ? k_ldf(x, ((nb * C + c) * H + ih) * W + iw, ft) : 0.0f);
    }
}

/* n = N*C*OH*OW; a.p: 1 H, 2 W, 3 pad_bottom, 4 kernel_h, 5 kernel_w, 6 OH, 7 OW,
 * 8 stride_h, 9 stride_w, 10 pad_top, 11 pad_left, 12 dilation_h, 13 dilation_w,
 * 14 mode (0 max, 1 average without padding, 2 average counting padding),
 * 15 pad_right. Mode 2 divides by the number of taps inside the padded input
 * ([-pad_top, H + pad_bottom) x [-pad_left, W + pad_right)), as ONNX count_include_pad. */
KERNEL void infer_pool2d(infer_kargs a) {
    const void *x = a.in[0];
    void *y = a.out;
    long long ft = a.ft;
    long long H = a.p[1], W = a.p[2], pb = a.p[3], KH = a.p[4], KW = a.p[5];
    long long OH = a.p[6], OW = a.p[7], sh = a.p[8], sw = a.p[9], pt = a.p[10],
              pl = a.p[11], dh = a.p[12], dw = a.p[13], mode = a.p[14], pr = a.p[15];
    K_LOOP(i) {
        long long ow = i % OW, t = i / OW;
        long long oh = t % OH, nc = t / OH;
        long long xc = nc * H * W;
        float acc = mode == 0 ? -K_INF : 0.0f;
        long long inside = 0, padded = 0;
        for (long long r = 0; r < KH; r++) {
            long long ih = oh * sh - pt + r * dh;
            for (long long s = 0; s < KW; s++) {
                long long iw = ow * sw - pl + s * dw;
                if (ih >= -pt && ih < H + pb && iw >= -pl && iw < W + pr)
                    padded++;
                if (ih < 0 || ih >= H || iw < 0 || iw >= W)
                    continue;
                float v = k_ldf(x, xc + ih * W + iw, ft);
                inside++;
                if (mode == 0)
                    acc = v > acc || v != v ? v : acc; /* NaN propagates */
                else
                    acc += v;
            }
        }
        if (mode == 1)
            acc = inside > 0 ? acc / (float)inside : 0.0f;
        else if (mode == 2)
            acc = padded > 0 ? acc / (float)padded : 0.0f;
        else if (mode != 0)
            acc = K_NAN;
        k_stf(y, i, ft, acc);
    }
}

/* n elements of a.p[1] bytes, each the low bytes of a.p[2]. */
KERNEL void infer_fill(infer_kargs a) {
    unsigned char *y = (unsigned char *)a.out;
    long long size = a.p[1];
    unsigned long long bits = (unsigned long long)a.p[2];
    K_LOOP(i) {
        k_store_bits(y + i * size, bits, size);
    }
}

/* Strided over in0 condition (u8), in1 x, in2 y; elements of a.p[1] bytes. */
KERNEL void infer_where(infer_kargs a) {
    const unsigned char *cond = (const unsigned char *)a.in[0];
    const unsigned char *x = (const unsigned char *)a.in[1];
    const unsigned char *w = (const unsigned char *)a.in[2];
    unsigned char *y = (unsigned char *)a.out;
    long long size = a.p[1];
    K_LOOP(i) {
        long long o[3], oo;
        K_STRIDED(a, i, 3, o, oo);
        k_copy_elem(y + oo * size, cond[o[0]] ? x + o[1] * size : w + o[2] * size, size);
    }
}

/* The output of a transposed convolution from its columns (each input pixel's
 * contribution to every tap, from a GEMM): n = N*K*OH*OW outputs, each the sum over the
 * taps (r, s) whose input pixel (oh + pad_top - r*dh) / sh, (ow + pad_left - s*dw) / sw
 * divides exactly and lies inside H x W, of cols[nb][(k*R + r)*S + s][ih*W + iw], plus
 * in[1][k] (bias) when not NULL. in[0] cols [N][K*R*S][H*W]; float operands of type
 * a.ft. a.p: 0 K, 1 H, 2 W, 4 R, 5 S, 6 OH, 7 OW, 8 stride_h, 9 stride_w, 10 pad_top,
 * 11 pad_left, 12 dilation_h, 13 dilation_w. */
KERNEL void infer_col2im(infer_kargs a) {
    long long K = a.p[0], H = a.p[1], W = a.p[2], R = a.p[4], S = a.p[5];
    long long OH = a.p[6], OW = a.p[7], sh = a.p[8], sw = a.p[9], pt = a.p[10],
              pl = a.p[11], dh = a.p[12], dw = a.p[13], ft = a.ft;
    K_LOOP(i) {
        long long ow = i % OW, t = i / OW;
        long long oh = t % OH;
        t /= OH;
        long long k = t % K, nb = t / K;
        float acc = a.in[1] != 0 ? k_ldf(a.in[1], k, ft) : 0.0f;
        for (long long r = 0; r < R; r++) {
            long long hn = oh + pt - r * dh;
            if (hn < 0 || hn % sh != 0 || hn / sh >= H)
                continue;
            long long ih = hn / sh;
            for (long long s2 = 0; s2 < S; s2++) {
                long long wn = ow + pl - s2 * dw;
                if (wn < 0 || wn % sw != 0 || wn / sw >= W)
                    continue;
                long long row = (k * R + r) * S + s2;
                acc += k_ldf(a.in[0], ((nb * K * R * S) + row) * H * W + ih * W + wn / sw, ft);
            }
        }
        k_stf(a.out, i, ft, acc);
    }
}

/* Resize, nearest or n-linear: n output elements over a.dims[0..a.rank) (row-major,
 * contiguous). Per dim d: a.strides[0][d] the input's element stride, a.strides[1][d] its
 * size; the output coordinate x maps to the input coordinate (x + P) * M / S + Q with M,
 * S, Q the doubles whose bits are a.strides[2][d], a.strides[3][d], a.ostrides[d] and P
 * the double of a.p[2]. a.p[0]: 0 nearest, 1 linear, 2 cubic (coefficient a.f[1]; a.p[5]
 * = 1: taps outside the input excluded and the rest renormalized, else edge-padded);
 * a.p[1] (nearest): 0
 * round_prefer_floor, 1 round_prefer_ceil, 2 floor, 3 ceil. a.p[3] = 1: an input
 * coordinate outside [0, size - 1] in any dim gives a.f[0] (tf_crop_and_resize's
 * extrapolation); else indices are clamped into the input (linear: the two neighbours,
 * weighted by the fraction, as if the input were edge-padded). Float operands of type
 * a.ft. */
DEVFN double k_bits_f64(long long b) {
    union {
        long long i;
        double d;
    } u;
    u.i = b;
    return u.d;
}

KERNEL void infer_resize(infer_kargs a) {
    long long mode = a.p[0], nearest = a.p[1], ft = a.ft, extrapolate = a.p[3];
    double P = k_bits_f64(a.p[2]);
    int rank = (int)a.rank;
    K_LOOP(i) {
        long long i0[8], i1[8], ct[8][4];
        float w[8], cw[8][4];
        int interp[8], k = 0, outside = 0, ntap[8];
        long long rem = i;
        for (int d = rank - 1; d >= 0; d--) {
            long long xd = rem % a.dims[d];
            rem /= a.dims[d];
            long long len = a.strides[1][d];
            double M = k_bits_f64(a.strides[2][d]), S = k_bits_f64(a.strides[3][d]);
            double x = ((double)xd + P) * M / S + k_bits_f64(a.ostrides[d]);
            if (extrapolate && (x < 0.0 || x > (double)(len - 1)))
                outside = 1;
            if (mode == 2) { /* cubic: four taps, edge-padded or renormalized */
                double f = floor(x), t = x - f, A = (double)a.f[1];
                long long j = (long long)f;
                ntap[d] = t == 0.0 ? 1 : 4;
                if (ntap[d] == 1) {
                    ct[d][0] = j < 0 ? 0 : (j >= len ? len - 1 : j);
                    cw[d][0] = 1.0f;
                } else {
                    double s4[4] = {1.0 + t, t, 1.0 - t, 2.0 - t}, sum = 0.0, w4[4];
                    for (int q = 0; q < 4; q++) {
                        double z = s4[q];
                        w4[q] = z <= 1.0 ? ((A + 2.0) * z - (A + 3.0)) * z * z + 1.0
                                         : ((A * z - 5.0 * A) * z + 8.0 * A) * z - 4.0 * A;
                        long long jq = j - 1 + q;
                        if (a.p[5] == 1 && (jq < 0 || jq >= len))
                            w4[q] = 0.0;
                        sum += w4[q];
                        ct[d][q] = jq < 0 ? 0 : (jq >= len ? len - 1 : jq);
                    }
                    for (int q = 0; q < 4; q++)
                        cw[d][q] = (float)(a.p[5] == 1 && sum != 0.0 ? w4[q] / sum : w4[q]);
                }
                continue;
            }
            if (mode == 0) {
                double f = floor(x), frac = x - f;
                long long j;
                if (nearest == 2)
                    j = (long long)f;
                else if (nearest == 3)
                    j = (long long)ceil(x);
                else if (frac == 0.5)
                    j = nearest == 1 ? (long long)f + 1 : (long long)f;
                else
                    j = (long long)floor(x + 0.5);
                i0[d] = j < 0 ? 0 : (j >= len ? len - 1 : j);
                i1[d] = i0[d];
                w[d] = 0.0f;
            } else {
                double f = floor(x);
                long long j = (long long)f;
                i0[d] = j < 0 ? 0 : (j >= len ? len - 1 : j);
                i1[d] = j + 1 < 0 ? 0 : (j + 1 >= len ? len - 1 : j + 1);
                w[d] = (float)(x - f);
                if (w[d] != 0.0f && i0[d] != i1[d])
                    interp[k++] = d;
            }
        }
        if (outside) {
            k_stf(a.out, i, ft, a.f[0]);
            continue;
        }
        if (mode == 2) { /* every combination of the dims' taps (mixed radix) */
            long long combos = 1;
            for (int d = 0; d < rank; d++)
                combos *= ntap[d];
            float acc = 0.0f;
            for (long long c = 0; c < combos; c++) {
                long long rest = c, src = 0;
                float weight = 1.0f;
                for (int d = 0; d < rank; d++) {
                    int q = (int)(rest % ntap[d]);
                    rest /= ntap[d];
                    src += ct[d][q] * a.strides[0][d];
                    weight *= cw[d][q];
                }
                acc += weight * k_ldf(a.in[0], src, ft);
            }
            k_stf(a.out, i, ft, acc);
            continue;
        }
        float acc = 0.0f;
        for (long long c = 0; c < (1LL << k); c++) {
            float weight = 1.0f;
            long long src = 0;
            for (int d = 0; d < rank; d++)
                src += i0[d] * a.strides[0][d];
            for (int e = 0; e < k; e++) {
                int d = interp[e];
                if ((c >> e) & 1) {
                    weight *= w[d];
                    src += (i1[d] - i0[d]) * a.strides[0][d];
                } else {
                    weight *= 1.0f - w[d];
                }
            }
            acc += weight * k_ldf(a.in[0], src, ft);
        }
        k_stf(a.out, i, ft, acc);
    }
}

/* Pad (and Tile): n output elements over a.dims[0..a.rank) (row-major, contiguous); per
 * dim d, a.strides[0][d] is the input's element stride, a.strides[1][d] the input's size
 * and a.strides[2][d] the padding before it (negative: cropped). An output index x maps
 * to j = x - pad; outside [0, size): a.p[0] mode 0 writes the constant (the low a.p[1]
 * bytes of a.p[2]), 1 reflects (without repeating the edge), 2 repeats the edge, 3 wraps
 * around (Tile is a wrap with no padding before). a.p[1]: element size in bytes. */
KERNEL void infer_pad(infer_kargs a) {
    const unsigned char *x = (const unsigned char *)a.in[0];
    unsigned char *y = (unsigned char *)a.out;
    long long mode = a.p[0], size = a.p[1];
    K_LOOP(i) {
        unsigned long long rem = (unsigned long long)i;
        long long src = 0;
        int outside = 0;
        for (int d = (int)a.rank - 1; d >= 0; d--) {
            unsigned long long dim = (unsigned long long)a.dims[d];
            long long xd = (long long)(rem % dim);
            rem /= dim;
            long long len = a.strides[1][d], j = xd - a.strides[2][d];
            if (j < 0 || j >= len) {
                if (mode == 0 || len <= 0) {
                    outside = 1;
                    break;
                } else if (mode == 1) {
                    long long period = 2 * (len - 1);
                    if (period == 0) {
                        j = 0;
                    } else {
                        j %= period;
                        if (j < 0)
                            j += period;
                        if (j >= len)
                            j = period - j;
                    }
                } else if (mode == 2) {
                    j = j < 0 ? 0 : len - 1;
                } else {
                    j %= len;
                    if (j < 0)
                        j += len;
                }
            }
            src += j * a.strides[0][d];
        }
        if (outside)
            k_store_bits(y + i * size, (unsigned long long)a.p[2], size);
        else
            k_copy_elem(y + i * size, x + src * size, size);
    }
}

/* Integer arithmetic, strided like infer_binary over in[0] (and in[1] for the binary
 * ops), in 64 bits and stored truncated to the type (wrapping as integers do). a.p[0] the
 * op: 0 Add, 1 Sub, 2 Mul, 3 Div (toward zero), 4 Pow, 5 Max, 6 Min, 7 Mod (the
 * divisor's sign), 8 fmod (the dividend's sign), 9 And, 10 Or, 11 Xor (bitwise), 12 shift
 * left, 13 shift right; unary: 14 Neg, 15 Abs, 16 Sign, 17 bitwise Not, 18 Clip to
 * [a.p[3], a.p[4]]. Division and remainders by zero give 0. a.p[1] the cast type code of
 * the operands and the output (integers only: 1, 2, 3, 4, 6, 7, 8, 9); a.p[2] = 1:
 * unsigned (divisions, remainders, comparisons and right shifts). */
DEVFN unsigned long long k_ldu(const void *p, long long i, long long t) {
    switch (t) {
    case 1: return ((const unsigned char *)p)[i];
    case 2: return (unsigned long long)(long long)((const signed char *)p)[i];
    case 3: return (unsigned long long)(long long)((const int *)p)[i];
    case 6: return ((const unsigned short *)p)[i];
    case 7: return (unsigned long long)(long long)((const short *)p)[i];
    case 8: return ((const unsigned int *)p)[i];
    default: return ((const unsigned long long *)p)[i];
    }
}

DEVFN void k_stu(void *p, long long i, long long t, unsigned long long v) {
    switch (t) {
    case 1:
    case 2: ((unsigned char *)p)[i] = (unsigned char)v; break;
    case 3:
    case 8: ((unsigned int *)p)[i] = (unsigned int)v; break;
    case 6:
    case 7: ((unsigned short *)p)[i] = (unsigned short)v; break;
    default: ((unsigned long long *)p)[i] = v; break;
    }
}

KERNEL void infer_int(infer_kargs a) {
    long long op = a.p[0], t = a.p[1];
    int uns = a.p[2] == 1, nin = op >= INFER_INT_NEG ? 1 : 2;
    K_LOOP(i) {
        long long o[2], oo;
        K_STRIDED(a, i, nin, o, oo);
        unsigned long long x = k_ldu(a.in[0], o[0], t);
        unsigned long long y = nin == 2 ? k_ldu(a.in[1], o[1], t) : 0ULL, r = 0ULL;
        long long sx = (long long)x, sy = (long long)y;
        switch (op) {
        case INFER_INT_ADD: r = x + y; break;
        case INFER_INT_SUB: r = x - y; break;
        case INFER_INT_MUL: r = x * y; break;
        case INFER_INT_DIV: /* (-2^63 / -1 wraps, as two's complement does) */
            r = y == 0ULL ? 0ULL
                : uns     ? x / y
                : sy == -1 ? 0ULL - x
                           : (unsigned long long)(sx / sy);
            break;
        case INFER_INT_POW:
            if (!uns && sy < 0) { /* 1 / x^n truncated */
                r = sx == 1 ? 1ULL : sx == -1 ? ((sy & 1) ? ~0ULL : 1ULL) : 0ULL;
            } else {
                unsigned long long b = x, e = y;
                r = 1ULL;
                while (e != 0ULL) {
                    if (e & 1ULL)
                        r *= b;
                    b *= b;
                    e >>= 1;
                }
            }
            break;
        case INFER_INT_MAX: r = uns ? (x > y ? x : y) : (sx > sy ? x : y); break;
        case INFER_INT_MIN: r = uns ? (x < y ? x : y) : (sx < sy ? x : y); break;
        case INFER_INT_MOD:
        case INFER_INT_FMOD:
            if (y == 0ULL) {
                r = 0ULL;
            } else if (uns) {
                r = x % y;
            } else {
                long long m = sy == -1 ? 0 : sx % sy;
                if (op == INFER_INT_MOD && m != 0 && ((m < 0) != (sy < 0)))
                    m += sy;
                r = (unsigned long long)m;
            }
            break;
        case INFER_INT_AND: r = x & y; break;
        case INFER_INT_OR: r = x | y; break;
        case INFER_INT_XOR: r = x ^ y; break;
        case INFER_INT_SHL: r = y >= 64ULL ? 0ULL : x << y; break;
        case INFER_INT_SHR: r = y >= 64ULL ? 0ULL : x >> y; break;
        case INFER_INT_NEG: r = 0ULL - x; break;
        case INFER_INT_ABS: r = !uns && sx < 0 ? 0ULL - x : x; break;
        case INFER_INT_SIGN: r = uns ? (unsigned long long)(x != 0ULL) : sx > 0 ? 1ULL : sx < 0 ? ~0ULL : 0ULL; break;
        case INFER_INT_NOT: r = ~x; break;
        case INFER_INT_CLIP:
            if (uns) {
                unsigned long long lo = (unsigned long long)a.p[3], hi = (unsigned long long)a.p[4];
                r = x < lo ? lo : x > hi ? hi : x;
            } else {
                r = (unsigned long long)(sx < a.p[3] ? a.p[3] : sx > a.p[4] ? a.p[4] : sx);
            }
            break;
        default: break;
        }
        k_stu(a.out, oo, t, r);
    }
}

/* Element i of type code t (as infer_cast) as a double: floats exactly, integers as
 * their value (64-bit ones beyond 2^53 rounded). */
DEVFN double k_ld_any(const void *p, long long i, long long t) {
    switch (t) {
    case 0: return (double)((const float *)p)[i];
    case 10: return ((const double *)p)[i];
    case 11: return (double)k_ldf(p, i, 1);
    case 12: return (double)k_ldf(p, i, 2);
    case 9: return (double)k_ldu(p, i, t);
    default: return (double)(long long)k_ldu(p, i, t);
    }
}

DEVFN int k_is_float_code(long long t) { return t == 0 || t == 10 || t == 11 || t == 12; }

/* Stores v (a double for the float types, the integer's bits for the others) as type t. */
DEVFN void k_st_any(void *p, long long i, long long t, double v, unsigned long long u) {
    switch (t) {
    case 0: ((float *)p)[i] = (float)v; break;
    case 10: ((double *)p)[i] = v; break;
    case 11: k_stf(p, i, 1, (float)v); break;
    case 12: k_stf(p, i, 2, (float)v); break;
    default: k_stu(p, i, t, u); break;
    }
}

/* CumSum: n = outer * inner lines of a.p[0] elements a.p[1] apart; a.p[2] = 1: exclusive,
 * a.p[3] = 1: from the end; a.p[4] the type code (floats summed in double, integers in
 * 64 bits wrapping). Cooperative: a k_team per line, which takes the line a round of
 * `groups` consecutive elements at a time (loads coalesce): a scan of the round in shared
 * memory (Hillis and Steele: log2(groups) steps), plus the sum of the rounds before.
 * Integer sums are exact in any order; float sums are in double, so a result may differ
 * from a one-by-one sum only in the last bit of the double, before it is rounded to the
 * output's type. */
KERNEL void infer_cumsum(infer_kargs a) {
    K_SHARED(double, sd, K_MAX_BLOCK);
    K_SHARED(unsigned long long, su, K_MAX_BLOCK);
    long long len = a.p[0], inner = a.p[1], t = a.p[4];
    int exclusive = a.p[2] == 1, reverse = a.p[3] == 1, fl = k_is_float_code(t);
    if (inner <= 0 || len <= 0)
        return;
    k_team tm = k_team_make(len, inner);
    int tid = K_TID, on = tm.g < tm.groups;
    long long tiles = (a.n + tm.lanes - 1) / tm.lanes;
    for (long long tile = K_BID; tile < tiles; tile += K_NBLOCKS) {
        long long i = tile * tm.lanes + tm.lane;
        int mine = on && i < a.n;
        long long o = i / inner, b = o * len * inner + (i - o * inner);
        double carry = 0.0; /* the sum of the rounds before */
        unsigned long long ucarry = 0ULL;
        for (long long start = 0; start < len; start += tm.groups) {
            long long k = start + tm.g;
            int have = mine && k < len;
            long long j = b + (reverse ? len - 1 - k : k) * inner;
            double v = have && fl ? k_ld_any(a.in[0], j, t) : 0.0;
            unsigned long long u = have && !fl ? k_ldu(a.in[0], j, t) : 0ULL;
            /* this element's sums of the round: up to it (incl), before it (excl), and all
             * of it (all) */
            double incl = v, excl = 0.0, all = v;
            unsigned long long uincl = u, uexcl = 0ULL, uall = u;
            if (tm.groups > 1) {
                if (on) {
                    sd[tid] = v;
                    su[tid] = u;
                }
                K_SYNC();
                for (int d = 1; d < tm.groups; d *= 2) {
                    int add = on && tm.g >= d;
                    double pv = add ? sd[tid - d * tm.gs] : 0.0;
                    unsigned long long pu = add ? su[tid - d * tm.gs] : 0ULL;
                    K_SYNC(); /* every read of this step is done before its writes */
                    if (add) {
                        sd[tid] += pv;
                        su[tid] += pu;
                    }
                    K_SYNC();
                }
                if (on) {
                    long long rest = len - start, last = rest < tm.groups ? rest - 1 : tm.groups - 1;
                    int at = tm.lane * tm.ls + (int)last * tm.gs;
                    incl = sd[tid];
                    uincl = su[tid];
                    excl = tm.g > 0 ? sd[tid - tm.gs] : 0.0;
                    uexcl = tm.g > 0 ? su[tid - tm.gs] : 0ULL;
                    all = sd[at];
                    uall = su[at];
                }
                K_SYNC(); /* everyone has read sd, su before the next round writes them */
            }
            if (have)
                k_st_any(a.out, j, t, carry + (exclusive ? excl : incl),
                         ucarry + (exclusive ? uexcl : uincl));
            carry += all;
            ucarry += uall;
        }
    }
}

/* GatherElements: strided over the indices' dims (n elements): in[0] data with its
 * stride along the axis zeroed (o[0]: the element's place off the axis), in[1] the
 * indices; a.p[0] the data's stride along the axis, a.p[1] its size there, a.p[2] the
 * element size, a.p[3] index type (0 i64, 1 i32). An index out of range gives zeros. */
KERNEL void infer_gather_elements(infer_kargs a) {
    const unsigned char *data = (const unsigned char *)a.in[0];
    unsigned char *y = (unsigned char *)a.out;
    long long size = a.p[2];
    K_LOOP(i) {
        long long o[2], oo;
        K_STRIDED(a, i, 2, o, oo);
        long long idx = a.p[3] == 1 ? (long long)((const int *)a.in[1])[o[1]]
                                    : ((const long long *)a.in[1])[o[1]];
        if (idx < 0)
            idx += a.p[1];
        if (idx < 0 || idx >= a.p[1])
            k_store_bits(y + oo * size, 0, size);
        else
            k_copy_elem(y + oo * size, data + (o[0] + idx * a.p[0]) * size, size);
    }
}

/* Update element i of u into element at of y (type code t, `size` bytes): written, or
 * combined by reduction red (1 add, 2 mul, 3 max, 4 min; floats in double, integers in
 * 64 bits, unsigned types as unsigned). */
DEVFN void k_scatter_one(void *y, long long at, const void *u, long long i, long long size,
                         long long red, long long t) {
    if (red == 0) {
        k_copy_elem((unsigned char *)y + at * size, (const unsigned char *)u + i * size, size);
    } else if (k_is_float_code(t)) {
        double x = k_ld_any(y, at, t), v = k_ld_any(u, i, t);
        double r = red == 1 ? x + v : red == 2 ? x * v : red == 3 ? (v > x ? v : x)
                                                                  : (v < x ? v : x);
        k_st_any(y, at, t, r, 0ULL);
    } else {
        unsigned long long x = k_ldu(y, at, t), v = k_ldu(u, i, t);
        int uns = t == 1 || t == 6 || t == 8 || t == 9;
        int gt = uns ? v > x : (long long)v > (long long)x;
        int lt = uns ? v < x : (long long)v < (long long)x;
        unsigned long long r = red == 1 ? x + v : red == 2 ? x * v : red == 3 ? (gt ? v : x)
                                                                             : (lt ? v : x);
        k_st_any(y, at, t, 0.0, r);
    }
}

/* ScatterElements into a.out (already a copy of the data): strided over the indices'
 * dims (n elements): in[0] the indices, in[1] the updates, the output with its stride
 * along the axis zeroed (oo: the element's place off the axis); a.p[0] the output's
 * stride along the axis, a.p[1] its size there, a.p[2] the element size, a.p[3] index type
 * (0 i64, 1 i32), a.p[4] the reduction (0 none, 1 add, 2 mul, 3 max, 4 min), a.p[5] the
 * type code, a.p[6] the indices' size along the axis and a.p[7] their elements after it.
 * Indices out of range are skipped. Without a reduction the updates are written in
 * parallel. With one, repeated indices combine, in the updates' order: a thread takes a
 * line of the indices along the axis and applies its updates in turn. Lines never meet
 * (an update lands off the axis where it is), and every update of an output element is
 * in one line, in the order of the whole, so the result is that of one thread applying
 * them all in order. */
DEVFN void k_scatter_element(const infer_kargs *a, long long i) {
    long long o[2], oo;
    K_STRIDED(*a, i, 2, o, oo);
    long long idx = a->p[3] == 1 ? (long long)((const int *)a->in[0])[o[0]]
                                 : ((const long long *)a->in[0])[o[0]];
    if (idx < 0)
        idx += a->p[1];
    if (idx < 0 || idx >= a->p[1])
        return;
    k_scatter_one(a->out, oo + idx * a->p[0], a->in[1], o[1], a->p[2], a->p[4], a->p[5]);
}

KERNEL void infer_scatter_elements(infer_kargs a) {
    long long len = a.p[6], inner = a.p[7];
    if (a.p[4] == 0) {
        K_LOOP(i) {
            k_scatter_element(&a, i);
        }
        return;
    }
    if (!K_PLANE0 || len <= 0 || inner <= 0)
        return; /* a reduction applied twice would count twice */
    for (long long l = K_FIRST; l < a.n / len; l += K_STEP) {
        long long o = l / inner, b = o * len * inner + (l - o * inner);
        for (long long k = 0; k < len; k++)
            k_scatter_element(&a, b + k * inner);
    }
}

/* TopK: n = outer * inner lines of a.p[0] elements a.p[1] apart; the a.p[2] largest
 * (a.p[3] = 1) or smallest values of each, sorted, ties to the lower index, into a.out
 * (values, type code a.p[4], the lines' layout with k along the axis) and in[3] (their
 * indices, i64). NaN counts as larger than every number (as numpy sorts it).
 *
 * Is (v, u, i) before (w, x, j) in that order? Floats (fl) compare as the doubles v and
 * w; integers exactly, as the 64-bit values u and x (unsigned types as unsigned). A strict
 * total order over elements of distinct indices. */
DEVFN int k_topk_before(int fl, long long t, int largest, double v, unsigned long long u,
                        long long i, double w, unsigned long long x, long long j) {
    if (fl) {
        int vn = v != v, wn = w != w;
        if (vn || wn) {
            if (vn && wn)
                return i < j;
            return largest ? vn : wn;
        }
        if (v != w)
            return largest ? v > w : v < w;
        return i < j;
    }
    if (u == x)
        return i < j;
    int uns = t == 1 || t == 6 || t == 8 || t == 9;
    int gt = uns ? u > x : (long long)u > (long long)x;
    return largest ? gt : !gt;
}

/* Cooperative: a k_team per line takes the k outputs in k rounds; in each, every thread
 * finds the first, in TopK's order, of its elements (g, g + groups, ...) that come after
 * the previous round's output, and a tree over the team keeps the first of those. No
 * element is marked: the order is total, so "after the previous output" excludes exactly
 * the ones taken. O(k * len / groups) loads per thread. */
KERNEL void infer_topk(infer_kargs a) {
    K_SHARED(double, sv, K_MAX_BLOCK);
    K_SHARED(unsigned long long, su, K_MAX_BLOCK);
    K_SHARED(long long, si, K_MAX_BLOCK);
    long long len = a.p[0], inner = a.p[1], k = a.p[2], t = a.p[4];
    int largest = a.p[3] == 1, fl = k_is_float_code(t);
    long long *yi = (long long *)a.in[3];
    if (inner <= 0 || len <= 0 || k <= 0)
        return;
    k_team tm = k_team_make(len, inner);
    int tid = K_TID, on = tm.g < tm.groups;
    long long tiles = (a.n + tm.lanes - 1) / tm.lanes;
    for (long long tile = K_BID; tile < tiles; tile += K_NBLOCKS) {
        long long i = tile * tm.lanes + tm.lane;
        int mine = on && i < a.n;
        long long o = i / inner, in = i - o * inner;
        long long b = o * len * inner + in, ob = o * k * inner + in;
        double pv = 0.0; /* the previous round's output; pi < 0: none yet */
        unsigned long long pu = 0ULL;
        long long pi = -1;
        for (long long r = 0; r < k; r++) {
            double bv = 0.0; /* this thread's first; bi < 0: none */
            unsigned long long bu = 0ULL;
            long long bi = -1;
            for (long long j = mine ? tm.g : len; j < len; j += tm.groups) {
                double v = fl ? k_ld_any(a.in[0], b + j * inner, t) : 0.0;
                unsigned long long u = fl ? 0ULL : k_ldu(a.in[0], b + j * inner, t);
                if (pi >= 0 && !k_topk_before(fl, t, largest, pv, pu, pi, v, u, j))
                    continue; /* taken already */
                if (bi < 0 || k_topk_before(fl, t, largest, v, u, j, bv, bu, bi)) {
                    bv = v;
                    bu = u;
                    bi = j;
                }
            }
            if (tm.groups > 1) {
                if (on) {
                    sv[tid] = bv;
                    su[tid] = bu;
                    si[tid] = bi;
                }
                K_SYNC();
                for (int m = tm.groups; m > 1;) {
                    int h = (m + 1) / 2; /* groups [h, m) fold into [0, m - h) */
                    if (tm.g < m - h) {
                        int q = tid + h * tm.gs;
                        if (si[q] >= 0 &&
                            (si[tid] < 0 || k_topk_before(fl, t, largest, sv[q], su[q], si[q],
                                                          sv[tid], su[tid], si[tid]))) {
                            sv[tid] = sv[q];
                            su[tid] = su[q];
                            si[tid] = si[q];
                        }
                    }
                    K_SYNC();
                    m = h;
                }
                if (on) {
                    int w = tm.lane * tm.ls;
                    bv = sv[w];
                    bu = su[w];
                    bi = si[w];
                }
                K_SYNC(); /* everyone has read the winner before the next round writes */
            }
            if (mine && tm.g == 0 && bi >= 0) {
                k_st_any(a.out, ob + r * inner, t, bv, bu);
                yi[ob + r * inner] = bi;
            }
            pv = bv;
            pu = bu;
            pi = bi;
        }
    }
}

/* GatherND and ScatterND over flattened operands: B batches, each of J index tuples of m
 * entries (i64, in in[1]) naming a slice of `slice` elements of the data (a.p: 0 B, 1 J,
 * 2 m, 3 slice, 4 data elements per batch, 5 element size, 6 the op: 0 gather, else a
 * scatter with reduction 6 - 1 (0 none, 1 add, 2 mul, 3 max, 4 min), 7 the type code).
 * a.dims[t] and a.strides[0][t]: the size and the element stride of the data's axis that
 * tuple entry t indexes (negative entries count from the end). Gather: n = B * J * slice
 * outputs from in[0]; an entry out of range gives zeros. Scatter: a.out (already a copy
 * of the data) takes in[2] (the updates, J * slice) at the tuples; out-of-range tuples are
 * skipped. With a reduction, a thread takes one element of the slice (e) and applies that
 * element of every tuple in turn: a tuple's slice starts at a multiple of `slice`, so
 * updates of different elements never meet, and those of one output element come in the
 * tuples' order, as one thread applying them all in order would. */
DEVFN void k_nd_one(const infer_kargs *a, long long i) {
    long long J = a->p[1], m = a->p[2], slice = a->p[3], per = a->p[4], size = a->p[5];
    long long op = a->p[6], t = a->p[7];
    const long long *ix = (const long long *)a->in[1];
    long long e = i % slice, tj = i / slice, b = tj / J;
    long long at = b * per + e;
    int ok = 1;
    for (long long q = 0; q < m; q++) {
        long long v = ix[tj * m + q];
        if (v < 0)
            v += a->dims[q];
        if (v < 0 || v >= a->dims[q])
            ok = 0;
        at += v * a->strides[0][q];
    }
    if (op == 0) {
        unsigned char *y = (unsigned char *)a->out + i * size;
        if (ok)
            k_copy_elem(y, (const unsigned char *)a->in[0] + at * size, size);
        else
            k_store_bits(y, 0, size);
        return;
    }
    if (ok)
        k_scatter_one(a->out, at, a->in[2], i, size, op - 1, t);
}

KERNEL void infer_nd(infer_kargs a) {
    long long slice = a.p[3];
    if (a.p[6] <= 1) {
        K_LOOP(i) {
            k_nd_one(&a, i);
        }
        return;
    }
    if (!K_PLANE0 || slice <= 0)
        return; /* a reduction applied twice would count twice */
    for (long long e = K_FIRST; e < slice; e += K_STEP)
        for (long long tj = 0; tj < a.n / slice; tj++)
            k_nd_one(&a, tj * slice + e);
}

/* RotaryEmbedding: n = B * S * H * D outputs in the input's layout (a.p[6]: 0 [B, H, S, D],
 * 1 [B, S, H * D]); a.p: 0 B, 1 S, 2 H, 3 D, 4 the rotated dims (even, <= D), 5 = 1:
 * interleaved pairs (else halves), 7 = 1: in[3] holds i64 position ids [B, S] into the
 * caches' a.p[8] rows (else the caches are [B, S, rot / 2]). in[1], in[2]: the cos and
 * sin caches. A position out of range gives zeros. Float operands of type a.ft. */
KERNEL void infer_rope(infer_kargs a) {
    long long S = a.p[1], H = a.p[2], D = a.p[3], rot = a.p[4], ft = a.ft;
    int inter = a.p[5] == 1, bshd = a.p[6] == 1, ids = a.p[7] == 1;
    long long half = rot / 2;
    K_LOOP(i) {
        long long d = i % D, r = i / D, s, b; /* the row's position and batch (not its head) */
        if (bshd) {
            s = (r / H) % S;
            b = r / (H * S);
        } else {
            s = r % S;
            b = r / (S * H);
        }
        float x = k_ldf(a.in[0], i, ft);
        if (d >= rot) {
            k_stf(a.out, i, ft, x);
            continue;
        }
        long long row = b * S + s, k, mate;
        int first; /* the pair's first element (real part) */
        if (inter) {
            k = d / 2;
            first = (d & 1) == 0;
            mate = first ? i + 1 : i - 1;
        } else {
            k = d < half ? d : d - half;
            first = d < half;
            mate = first ? i + half : i - half;
        }
        if (ids) {
            row = ((const long long *)a.in[3])[b * S + s];
            if (row < 0 || row >= a.p[8]) {
                k_stf(a.out, i, ft, 0.0f);
                continue;
            }
        }
        float c = k_ldf(a.in[1], row * half + k, ft), sn = k_ldf(a.in[2], row * half + k, ft);
        float m = k_ldf(a.in[0], mate, ft);
        k_stf(a.out, i, ft, first ? c * x - sn * m : sn * m + c * x);
    }
}

/* Element i of a numeric operand of cast type code t (as infer_cast): integers and bools
 * into *ll (returns 1), floats into *d (returns 0). */
DEVFN int k_ld_num(const void *p, long long i, long long t, long long *ll, double *d) {
    switch (t) {
    case 1: *ll = ((const unsigned char *)p)[i]; return 1;
    case 2: *ll = ((const signed char *)p)[i]; return 1;
    case 3: *ll = ((const int *)p)[i]; return 1;
    case 4: *ll = ((const long long *)p)[i]; return 1;
    case 5: *ll = ((const unsigned char *)p)[i] != 0; return 1;
    case 6: *ll = ((const unsigned short *)p)[i]; return 1;
    case 7: *ll = ((const short *)p)[i]; return 1;
    case 8: *ll = ((const unsigned int *)p)[i]; return 1;
    case 9: *ll = (long long)((const unsigned long long *)p)[i]; return 1; /* its bits */
    case 10: *d = ((const double *)p)[i]; return 0;
    case 11: *d = (double)k_ldf(p, i, 1); return 0;
    case 12: *d = (double)k_ldf(p, i, 2); return 0;
    default: *d = (double)((const float *)p)[i]; return 0;
    }
}

/* a op b for the ordered comparisons (EQUAL to GREATER_OR_EQUAL). */
#define K_ORDERED(op, a, b)                                                                  \
    ((op) == INFER_CMP_EQUAL           ? (a) == (b)                                          \
     : (op) == INFER_CMP_LESS          ? (a) < (b)                                           \
     : (op) == INFER_CMP_GREATER       ? (a) > (b)                                           \
     : (op) == INFER_CMP_LESS_OR_EQUAL ? (a) <= (b)                                          \
                                       : (a) >= (b))

/* Comparisons and logic into BOOL (one byte, 0 or 1), strided like infer_binary over
 * in[0] (and in[1] for the binary ones). a.p[0] the op: 0 Equal, 1 Less, 2 Greater,
 * 3 LessOrEqual, 4 GreaterOrEqual, 5 And, 6 Or, 7 Xor, 8 Not, 9 IsNaN, 10 IsInf (a.p[3]:
 * detect +inf, a.p[4]: detect -inf); a.p[1], a.p[2] the inputs' cast type codes. Two
 * integer operands compare as 64-bit integers (two UINT64 ones unsigned), anything else
 * as doubles (NaN compares unequal and unordered). */
KERNEL void infer_compare(infer_kargs a) {
    long long op = a.p[0];
    int nin = op >= INFER_CMP_NOT ? 1 : 2;
    K_LOOP(i) {
        long long o[2], oo;
        K_STRIDED(a, i, nin, o, oo);
        long long la = 0, lb = 0;
        double da = 0.0, db = 0.0;
        int ia = k_ld_num(a.in[0], o[0], a.p[1], &la, &da);
        int ib = nin == 2 ? k_ld_num(a.in[1], o[1], a.p[2], &lb, &db) : 1;
        int r = 0;
        int ordered = op <= INFER_CMP_GREATER_OR_EQUAL;
        if (ordered && ia && ib && a.p[1] == 9 && a.p[2] == 9) { /* UINT64 with UINT64 */
            unsigned long long ua = (unsigned long long)la, ub = (unsigned long long)lb;
            r = K_ORDERED(op, ua, ub);
        } else if (ordered && ia && ib) {
            r = K_ORDERED(op, la, lb);
        } else if (ordered) {
            if (ia)
                da = (double)la;
            if (ib)
                db = (double)lb;
            r = K_ORDERED(op, da, db);
        } else {
            int xa = ia ? la != 0 : da != 0.0, xb = ib ? lb != 0 : db != 0.0;
            switch (op) {
            case INFER_CMP_AND: r = xa && xb; break;
            case INFER_CMP_OR: r = xa || xb; break;
            case INFER_CMP_XOR: r = xa != xb; break;
            case INFER_CMP_NOT: r = !xa; break;
            case INFER_CMP_IS_NAN: r = !ia && da != da; break;
            case INFER_CMP_IS_INF:
                r = !ia && ((a.p[3] != 0 && da > 1.7976931348623157e308) ||
                            (a.p[4] != 0 && da < -1.7976931348623157e308));
                break;
            default: break;
            }
        }
        ((unsigned char *)a.out)[oo] = (unsigned char)r;
    }
}

/* A chain of element-wise operations in one pass (the planner fuses them:
 * src/onnx/gpu/fuse.rs), strided like infer_binary over the inputs that are not NULL
 * (all of type a.ft; computed in f32). Registers 0..3 hold inputs 0..3, register 4 + j
 * the result of instruction j; the output is the last result. a.p[0]: the number of
 * instructions (1..15); a.p[1 + j]: instruction j, bits 0-7 the op (of k_unary or
 * k_binary), 8-9 the kind (0: k_unary(op, r[a], f[s], f[s + 1]); 1: k_binary(op, r[a],
 * r[b]); 2: k_binary(op, r[a], f[s]); 3: k_binary(op, f[s], r[a])), 10-14 register a,
 * 15-19 register b, 20-21 the float slot s. */
KERNEL void infer_fused(infer_kargs a) {
    long long ft = a.ft, count = a.p[0];
    int nin = 0;
    for (int k = 0; k < 4; k++)
        if (a.in[k] != 0)
            nin = k + 1;
    if (count < 1 || count > 15)
        return;
    K_LOOP(i) {
        long long o[4], oo;
        float r[19];
        K_STRIDED(a, i, nin, o, oo);
        for (int k = 0; k < 4; k++)
            r[k] = k < nin && a.in[k] != 0 ? k_ldf(a.in[k], o[k], ft) : 0.0f;
        for (long long j = 0; j < count; j++) {
            long long w = a.p[1 + j];
            long long op = w & 0xff, kind = (w >> 8) & 3;
            int ra = (int)((w >> 10) & 31), rb = (int)((w >> 15) & 31), s = (int)((w >> 20) & 3);
            float x = ra < 4 + j ? r[ra] : K_NAN, v;
            if (kind == INFER_FUSED_UNARY)
                v = k_unary(op, x, a.f[s], a.f[s < 3 ? s + 1 : 3]);
            else if (kind == INFER_FUSED_BINARY)
                v = k_binary(op, x, rb < 4 + j ? r[rb] : K_NAN);
            else if (kind == INFER_FUSED_BINARY_IMM_B)
                v = k_binary(op, x, a.f[s]);
            else
                v = k_binary(op, a.f[s], x);
            r[4 + j] = v;
        }
        k_stf(a.out, oo, ft, r[3 + count]);
    }
}

#ifdef INFER_HOST_EMULATION
/* For the stand-in driver's cuModuleGetFunction: every kernel by name, then {0, 0}. */
#define INFER_ENTRY(k) {#k, k},
const struct infer_kernel_entry {
    const char *name;
    void (*fn)(infer_kargs);
} infer_kernel_table[] = {INFER_KERNELS(INFER_ENTRY){0, 0}};
#undef INFER_ENTRY
/* For the emulator: the names of the cooperative kernels, then NULL. */
#define INFER_COOP_ENTRY(k) #k,
const char *const infer_cooperative_kernels[] = {
    INFER_COOPERATIVE_KERNELS(INFER_COOP_ENTRY) 0};
#undef INFER_COOP_ENTRY
#endif

#endif /* INFER_KARGS_ONLY */
