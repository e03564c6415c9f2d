/* The CUDA C kernels of libinfer's GPU executor for ONNX graphs.
 *
 * One source, two compilers:
 * - NVRTC compiles it for the device (once per device, at the first model that needs it);
 * - tests compile it as C for the host (-DINFER_HOST_EMULATION) into the stand-in CUDA
 *   driver (tests/fixtures/), which runs each launch over its whole grid on the host, so
 *   the executor's use of every kernel is checked against CPU references on machines
 *   without a GPU.
 * So: C that is also valid C++, no templates, no __syncthreads, no shared memory, no
 * warp intrinsics (each thread does its own part of the grid-stride loop).
 *
 * Every kernel takes one infer_kargs by value (the same struct in Rust:
 * src/gpu/onnx/kargs.rs). Kernels loop `for (i = first; i < a.n; i += step)` with
 * first = blockIdx.x * blockDim.x + threadIdx.x and step = gridDim.x * blockDim.x, so any
 * 1-D grid covers [0, a.n) (the y and z dimensions are not used).
 *
 * "Strided" kernels decompose i (row-major) over a.dims[0..a.rank) into idx[d]; input
 * k's element is a.off[k] + sum idx[d] * a.strides[k][d], the output's
 * a.ooff + sum idx[d] * a.ostrides[d] (a stride of 0 broadcasts). The others are
 * described above each kernel; offsets and sizes there count elements.
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
} infer_kargs;

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
#elif defined(INFER_HOST_EMULATION)
/* A host C compiler, for the stand-in driver: each launch calls the kernel once per
 * (block, thread) of its grid with these thread-local coordinates set (defined by the
 * emulator, which is the only reader of infer_kernel_table). */
#include <math.h>
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
    X(infer_unary_f32)                                                                       \
    X(infer_binary_f32)                                                                      \
    X(infer_strided_copy)                                                                    \
    X(infer_cast)                                                                            \
    X(infer_softmax_f32)                                                                     \
    X(infer_layernorm_f32)                                                                   \
    X(infer_argmax_f32)                                                                      \
    X(infer_reduce_f32)                                                                      \
    X(infer_gather)                                                                          \
    X(infer_conv2d_f32)                                                                      \
    X(infer_im2col_f32)                                                                      \
    X(infer_pool2d_f32)                                                                      \
    X(infer_fill)                                                                            \
    X(infer_where)

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

DEVFN float k_unary(long long op, float x, float f0, float f1) {
    switch (op) {
    case 0: return x;
    case 1: return x < 0.0f ? 0.0f : x; /* NaN stays NaN */
    case 2: return 1.0f / (1.0f + expf(-x));
    case 3: return tanhf(x);
    case 4: return erff(x);
    case 5: return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
    case 6: {
        float u = 0.79788456080286536f * (x + 0.044715f * x * x * x); /* sqrt(2/pi) */
        return 0.5f * x * (1.0f + tanhf(u));
    }
    case 7: return expf(x);
    case 8: return logf(x);
    case 9: return sqrtf(x);
    case 10: return -x;
    case 11: return fabsf(x);
    case 12: return 1.0f / x;
    case 13: return x < 0.0f ? f0 * x : x;
    case 14: return x < f0 ? f0 : (x > f1 ? f1 : x); /* NaN stays NaN */
    case 15: return floorf(x);
    case 16: return ceilf(x);
    case 17: return sinf(x);
    case 18: return cosf(x);
    case 19: /* log(1 + e^x), without overflow for large x */
        return (x > 0.0f ? x : 0.0f) + log1pf(expf(-fabsf(x)));
    case 20: {
        float y = f0 * x + f1;
        return y < 0.0f ? 0.0f : (y > 1.0f ? 1.0f : y);
    }
    case 21: return x > 0.0f ? x : f0 * expm1f(x);
    default: return K_NAN;
    }
}

DEVFN float k_binary(long long op, float x, float y) {
    switch (op) {
    case 0: return x + y;
    case 1: return x - y;
    case 2: return x * y;
    case 3: return x / y;
    case 4: return powf(x, y);
    case 5: return x != x ? x : (x > y ? x : y); /* NaN in either wins */
    case 6: return x != x ? x : (x < y ? x : y);
    case 7: return x < 0.0f ? x * y : x;
    default: return K_NAN;
    }
}

/* ---- the kernels ------------------------------------------------------------------ */

KERNEL void infer_unary_f32(infer_kargs a) {
    const float *x = (const float *)a.in[0];
    float *y = (float *)a.out;
    K_LOOP(i) {
        long long o[1], oo;
        K_STRIDED(a, i, 1, o, oo);
        y[oo] = k_unary(a.p[0], x[o[0]], a.f[0], a.f[1]);
    }
}

KERNEL void infer_binary_f32(infer_kargs a) {
    const float *x = (const float *)a.in[0];
    const float *w = (const float *)a.in[1];
    float *y = (float *)a.out;
    K_LOOP(i) {
        long long o[2], oo;
        K_STRIDED(a, i, 2, o, oo);
        y[oo] = k_binary(a.p[0], x[o[0]], w[o[1]]);
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

/* Type codes: 0 f32, 1 u8, 2 i8, 3 i32, 4 i64, 5 bool, 6 u16, 7 i16, 8 u32, 9 u64, 10 f64. */
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
        default: d = (double)K_NAN; is_float = 1; break;
        }
        if (to == 0) {
            ((float *)y)[i] = is_float ? (float)d : is_signed ? (float)(long long)u : (float)u;
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

/* n rows of a.p[0] columns; a.p[1] = 1: LogSoftmax. */
KERNEL void infer_softmax_f32(infer_kargs a) {
    long long cols = a.p[0];
    int log_softmax = a.p[1] == 1;
    K_LOOP(r) {
        const float *x = (const float *)a.in[0] + r * cols;
        float *y = (float *)a.out + r * cols;
        if (cols <= 0)
            continue;
        float m = x[0];
        for (long long c = 1; c < cols; c++)
            m = x[c] > m || x[c] != x[c] ? x[c] : m; /* NaN propagates */
        float s = 0.0f;
        for (long long c = 0; c < cols; c++)
            s += expf(x[c] - m);
        if (log_softmax) {
            float ls = logf(s);
            for (long long c = 0; c < cols; c++)
                y[c] = x[c] - m - ls;
        } else {
            float inv = 1.0f / s;
            for (long long c = 0; c < cols; c++)
                y[c] = expf(x[c] - m) * inv;
        }
    }
}

/* n rows of a.p[0] columns; in[1] scale, in[2] bias or NULL; eps a.f[0]. */
KERNEL void infer_layernorm_f32(infer_kargs a) {
    long long cols = a.p[0];
    const float *scale = (const float *)a.in[1];
    const float *bias = (const float *)a.in[2];
    K_LOOP(r) {
        const float *x = (const float *)a.in[0] + r * cols;
        float *y = (float *)a.out + r * cols;
        if (cols <= 0)
            continue;
        float mean = 0.0f;
        for (long long c = 0; c < cols; c++)
            mean += x[c];
        mean /= (float)cols;
        float var = 0.0f;
        for (long long c = 0; c < cols; c++) {
            float d = x[c] - mean;
            var += d * d;
        }
        var /= (float)cols;
        float inv = 1.0f / sqrtf(var + a.f[0]);
        for (long long c = 0; c < cols; c++) {
            float v = (x[c] - mean) * inv * scale[c];
            y[c] = bias != 0 ? v + bias[c] : v;
        }
    }
}

/* n = outer * inner; a.p[0] axis size, a.p[1] inner, a.p[2] = 1: ArgMin. i64 output. */
KERNEL void infer_argmax_f32(infer_kargs a) {
    const float *x = (const float *)a.in[0];
    long long *y = (long long *)a.out;
    long long axis = a.p[0], inner = a.p[1];
    int argmin = a.p[2] == 1;
    K_LOOP(i) {
        long long o = i / inner, k = i - o * inner;
        const float *p = x + o * axis * inner + k;
        long long best = 0;
        float bv = axis > 0 ? p[0] : 0.0f;
        for (long long j = 1; j < axis; j++) {
            float v = p[j * inner];
            if (v != v)
                continue; /* NaN never wins */
            if (bv != bv || (argmin ? v < bv : v > bv)) {
                bv = v;
                best = j;
            }
        }
        y[i] = best;
    }
}

/* n = outer * inner; a.p[0] axis size, a.p[1] inner, a.p[2] the reduction. */
KERNEL void infer_reduce_f32(infer_kargs a) {
    const float *x = (const float *)a.in[0];
    float *y = (float *)a.out;
    long long axis = a.p[0], inner = a.p[1], op = a.p[2];
    K_LOOP(i) {
        long long o = i / inner, k = i - o * inner;
        const float *p = x + o * axis * inner + k;
        float acc;
        switch (op) {
        case 2: acc = -K_INF; break;
        case 3: acc = K_INF; break;
        case 4: acc = 1.0f; break;
        default: acc = 0.0f; break;
        }
        for (long long j = 0; j < axis; j++) {
            float v = p[j * inner];
            switch (op) {
            case 0: case 1: acc += v; break;
            case 2: acc = v > acc || v != v ? v : acc; break; /* NaN propagates */
            case 3: acc = v < acc || v != v ? v : acc; break;
            case 4: acc *= v; break;
            case 5: case 6: acc += v * v; break;
            case 7: acc += fabsf(v); break;
            default: break;
            }
        }
        if (op == 1)
            acc /= (float)axis;
        else if (op == 6)
            acc = sqrtf(acc);
        else if (op < 0 || op > 7)
            acc = K_NAN;
        y[i] = acc;
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
KERNEL void infer_conv2d_f32(infer_kargs a) {
    const float *x = (const float *)a.in[0];
    const float *w = (const float *)a.in[1];
    const float *bias = (const float *)a.in[2];
    float *y = (float *)a.out;
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
            const float *xc = x + (nb * C + g * Cg + c) * H * W;
            const float *wc = w + (kk * Cg + c) * R * S;
            for (long long r = 0; r < R; r++) {
                long long ih = oh * sh - pt + r * dh;
                if (ih < 0 || ih >= H)
                    continue;
                for (long long s = 0; s < S; s++) {
                    long long iw = ow * sw - pl + s * dw;
                    if (iw < 0 || iw >= W)
                        continue;
                    acc += xc[ih * W + iw] * wc[r * S + s];
                }
            }
        }
        if (bias != 0)
            acc += bias[kk];
        if (a.p[15] == 1 && acc < 0.0f)
            acc = 0.0f;
        y[i] = acc;
    }
}

/* The columns of a convolution, for a GEMM: n = N*C*R*S*OH*OW, out laid out as
 * [N][C*R*S][OH*OW]; taps outside the image are zero. a.p as infer_conv2d_f32: 0 C,
 * 1 H, 2 W, 4 R, 5 S, 6 OH, 7 OW, 8 stride_h, 9 stride_w, 10 pad_top, 11 pad_left,
 * 12 dilation_h, 13 dilation_w. */
KERNEL void infer_im2col_f32(infer_kargs a) {
    const float *x = (const float *)a.in[0];
    float *y = (float *)a.out;
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
        y[i] = (ih >= 0 && ih < H && iw >= 0 && iw < W) ? x[((nb * C + c) * H + ih) * W + iw]
                                                         : 0.0f;
    }
}

/* n = N*C*OH*OW; a.p: 1 H, 2 W, 3 pad_bottom, 4 kernel_h, 5 kernel_w, 6 OH, 7 OW,
 * 8 stride_h, 9 stride_w, 10 pad_top, 11 pad_left, 12 dilation_h, 13 dilation_w,
 * 14 mode (0 max, 1 average without padding, 2 average counting padding),
 * 15 pad_right. Mode 2 divides by the number of taps inside the padded input
 * ([-pad_top, H + pad_bottom) x [-pad_left, W + pad_right)), as ONNX count_include_pad. */
KERNEL void infer_pool2d_f32(infer_kargs a) {
    const float *x = (const float *)a.in[0];
    float *y = (float *)a.out;
    long long H = a.p[1], W = a.p[2], pb = a.p[3], KH = a.p[4], KW = a.p[5];
    long long OH = a.p[6], OW = a.p[7], sh = a.p[8], sw = a.p[9], pt = a.p[10],
              pl = a.p[11], dh = a.p[12], dw = a.p[13], mode = a.p[14], pr = a.p[15];
    K_LOOP(i) {
        long long ow = i % OW, t = i / OW;
        long long oh = t % OH, nc = t / OH;
        const float *xc = x + nc * H * W;
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
                float v = xc[ih * W + iw];
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
        y[i] = acc;
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

#ifdef INFER_HOST_EMULATION
/* For the stand-in driver's cuModuleGetFunction: every kernel by name, then {0, 0}. */
#define INFER_ENTRY(k) {#k, k},
const struct infer_kernel_entry {
    const char *name;
    void (*fn)(infer_kargs);
} infer_kernel_table[] = {INFER_KERNELS(INFER_ENTRY){0, 0}};
#undef INFER_ENTRY
#endif

#endif /* INFER_KARGS_ONLY */
