/* Fused element-wise kernels of the synchronizer and the replica (issue #14 item 5), loaded with ctypes by
 * p2p_diloco/protocol/fused.py. Plain C, no Python API: ctypes releases the GIL around every call.
 *
 * Bit-identity rule: every float32 operation below is the same IEEE operation, in the same order, as the
 * torch fallback path runs as separate kernels (see outer_step.nesterov_step, wire/blockwise.py,
 * wire/codecs/codec.py). The build (setup.py) compiles with -O3 -ffp-contract=off and never -ffast-math: no
 * multiply-add is contracted into an FMA and nothing is reassociated, so the auto-vectorized loops
 * (SSE2 baseline) round every element exactly as the scalar code reads. Denormals are kept (no FTZ/DAZ:
 * this code never changes MXCSR, and neither does torch by default).
 */

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define EXP_MASK 0x7F800000u
#define EXP_ONE 0x00800000u

static inline uint32_t bits_of(float x) {
    uint32_t b;
    memcpy(&b, &x, sizeof b);
    return b;
}

/* The outer step of one element, the same in both step kernels (inlined): m' = m*mu; m' = m' + g;
 * d = m'*mu; d = d + g; d = d*rate; Θ' = Θ - d, each a float32 operation rounded on its own. Returns the
 * element's finiteness bits (see pd_nesterov). */
static inline uint32_t step_one(float g, float m, float theta, float mu, float rate, float *restrict out_m,
                                float *restrict out_theta) {
    float mi = m * mu;
    mi = mi + g;
    float d = mi * mu;
    d = d + g;
    d = d * rate;
    float t = theta - d;
    *out_m = mi;
    *out_theta = t;
    return (bits_of(t) & EXP_MASK) + EXP_ONE;
}

/* Version of this file's ABI: fused.py refuses a library that reports another. */
int pd_abi_version(void) { return 1; }

/* The outer Nesterov step over n elements, in this order per element, each a float32 operation rounded
 * on its own:  m' = m*mu;  m' = m' + g;  d = m'*mu;  d = d + g;  d = d*rate;  Θ' = Θ - d.
 * Writes out_theta and out_m (which must not overlap the inputs). Returns 1 when every element of
 * out_theta is finite, else 0 (a non-finite m' makes Θ' non-finite too: see kernels.nesterov_into). The
 * finiteness test is exact: an exponent field of all ones (inf or NaN) plus one exponent step carries
 * into bit 31, which the OR of all elements keeps. */
int pd_nesterov(const float *restrict theta, const float *restrict m, const float *restrict g,
                float *restrict out_theta, float *restrict out_m, int64_t n, float mu, float rate) {
    uint32_t flags = 0;
    for (int64_t i = 0; i < n; i++) {
        float gi = g[i];
        flags |= step_one(gi, m[i], theta[i], mu, rate, out_m + i, out_theta + i);
    }
    return (flags & 0x80000000u) == 0;
}

/* Blockwise absmax quantization of n values (bitsandbytes' algorithm, as wire.blockwise runs it in torch):
 * per block of `block` values (the last may be short): a = max |x| (NaN if any |x| is NaN: compared as
 * integers, the bit patterns of non-negative floats order like the floats and every NaN lies above inf);
 * scale = 1 / (a < clamp_min ? clamp_min : a) (a NaN stays NaN, as torch.clamp keeps it); then for each
 * value y = x * scale and its code = counts[top 16 bits of y] + (y > padded[counts[...]]), the lookup of
 * wire.blockwise.nearest_codes. Writes absmax[ceil(n / block)] and codes[n]. */
void pd_quantize(const float *restrict x, int64_t n, int64_t block, const uint8_t *restrict counts,
                 const float *restrict padded, float clamp_min, uint8_t *restrict codes,
                 float *restrict absmax) {
    for (int64_t start = 0, b = 0; start < n; start += block, b++) {
        int64_t len = n - start < block ? n - start : block;
        const float *xs = x + start;
        int32_t top = 0;
        for (int64_t i = 0; i < len; i++) {
            int32_t a = (int32_t)(bits_of(xs[i]) & 0x7FFFFFFFu);
            top = a > top ? a : top;
        }
        float amax;
        memcpy(&amax, &top, sizeof amax);
        absmax[b] = amax;
        float clamped = amax < clamp_min ? clamp_min : amax;
        float scale = 1.0f / clamped;
        uint8_t *out = codes + start;
        for (int64_t i = 0; i < len; i++) {
            float y = xs[i] * scale;
            uint32_t below = counts[bits_of(y) >> 16];
            out[i] = (uint8_t)(below + (y > padded[below]));
        }
    }
}

/* Decode n int8 codes: out[i] = table[codes[i]] * absmax[i / block], one float32 multiply each. */
void pd_dequantize(const uint8_t *restrict codes, int64_t n, int64_t block, const float *restrict table,
                   const float *restrict absmax, float *restrict out) {
    for (int64_t start = 0, b = 0; start < n; start += block, b++) {
        int64_t len = n - start < block ? n - start : block;
        float scale = absmax[b];
        const uint8_t *cs = codes + start;
        float *os = out + start;
        for (int64_t i = 0; i < len; i++) os[i] = table[cs[i]] * scale;
    }
}

/* Decode fused into the outer step: the gradient of element i is table[codes[i]] * absmax[i / block]
 * (exactly what pd_dequantize writes), then the step of pd_nesterov. Same return value. */
int pd_dequantize_nesterov(const uint8_t *restrict codes, int64_t block, const float *restrict table,
                           const float *restrict absmax, const float *restrict theta,
                           const float *restrict m, float *restrict out_theta, float *restrict out_m,
                           int64_t n, float mu, float rate) {
    uint32_t flags = 0;
    for (int64_t start = 0, b = 0; start < n; start += block, b++) {
        int64_t len = n - start < block ? n - start : block;
        float scale = absmax[b];
        for (int64_t i = start; i < start + len; i++) {
            float gi = table[codes[i]] * scale;
            flags |= step_one(gi, m[i], theta[i], mu, rate, out_m + i, out_theta + i);
        }
    }
    return (flags & 0x80000000u) == 0;
}
