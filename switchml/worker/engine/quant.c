/* quant.py's arithmetic in C: block floating point and chunk exponents, bit for
 * bit numpy's (tests/test_fastengine.py sweeps them against quant.py). */

/* ------------------------------------------------------------ block floating point */
/* float -> int32 as numpy's unsafe cast does on x86-64 (cvttss2si): NaN and
 * out-of-range values become INT32_MIN; C leaves them undefined.  Written as
 * selects, not branches, so that the loops below vectorise. */
static inline int32_t float_to_int32(float x) {
    int in_range = (x >= -2147483648.0f) & (x < 2147483648.0f);
    int32_t converted = (int32_t)(in_range ? x : 0.0f);
    return in_range ? converted : INT32_MIN;
}

/* rintf (round half to even, the default rounding mode) without a libm call:
 * below 2**23, adding and taking away 2**23 leaves the rounded value; from 2**23
 * on every float32 is an integer already.  NaN fails the test and stays NaN.
 * Exact only without -ffast-math and FMA contraction (setup.py). */
static inline float round_half_even(float x) {
    float magnitude = fabsf(x);
    float rounded = copysignf((magnitude + 8388608.0f) - 8388608.0f, x);
    return magnitude < 8388608.0f ? rounded : x;
}

/* round(src * factor) half to even, as int32 (float_to_int32's).  cvtps2dq
 * rounds in the current mode, half to even as rintf, and gives INT32_MIN for
 * NaN and out of range as cvttss2si: the same integers, four at a time,
 * without the range selects that SSE2 vectorises poorly. */
static void scale_round_into(const float *src, int64_t n, float factor, int32_t *dst) {
    int64_t i = 0;
#ifdef __SSE2__
    __m128 by = _mm_set1_ps(factor);
    for (; i + 4 <= n; i += 4)
        _mm_storeu_si128((__m128i *)(dst + i),
                         _mm_cvtps_epi32(_mm_mul_ps(_mm_loadu_ps(src + i), by)));
#endif
    for (; i < n; i++)
        dst[i] = float_to_int32(round_half_even(src[i] * factor));
}

/* quant.quantize_into: round(src * 2**(bits - exponent)), half to even. */
static void quantize_into(const float *src, int64_t n, int exponent, int bits, int32_t *dst) {
    if (n == 0)
        return;
    if (exponent == WIRE_EXP_ZERO || exponent == WIRE_EXP_NONFINITE) {
        memset(dst, 0, (size_t)n * sizeof(int32_t));
        return;
    }
    int shift = bits - exponent;
    if (shift <= 127) {
        /* np.float32(2.0**shift): the double power rounded to float32 */
        scale_round_into(src, n, (float)ldexp(1.0, shift), dst);
    } else {
        /* 2**shift is no float32, but 2**(shift - 64) and 2**64 are: two exact
         * multiplies scale as ldexp does (the result is below 2**31).  Rare:
         * chunks below 2**-96 or so; kept scalar. */
        float first = (float)ldexp(1.0, shift - 64), second = 18446744073709551616.0f;
        for (int64_t i = 0; i < n; i++)
            dst[i] = float_to_int32(round_half_even(src[i] * first * second));
    }
}

/* quant.quantize16_into: quantize_into's rounding, then biased by 2**bits into
 * uint16 (0 .. 2**(bits+1) with bits = quant.scale_bits16(n)). */
static void quantize16_into(const float *src, int64_t n, int exponent, int bits, uint16_t *dst,
                            int32_t *wide) {
    quantize_into(src, n, exponent, bits, wide);
    int32_t bias = (int32_t)1 << bits;
    for (int64_t i = 0; i < n; i++)
        dst[i] = (uint16_t)(wide[i] + bias);
}

/* quant.dequantize_into: float32(sum) * 2**(exponent - bits). */
static void dequantize_into(const int32_t *src, int64_t n, int exponent, int bits, float *dst) {
    if (n == 0)
        return;
    if (exponent == WIRE_EXP_NONFINITE) {
        for (int64_t i = 0; i < n; i++)
            dst[i] = NAN;
        return;
    }
    if (exponent == WIRE_EXP_ZERO) {
        memset(dst, 0, (size_t)n * sizeof(float));
        return;
    }
    int shift = exponent - bits;
    if (shift >= -126) {
        float factor = (float)ldexp(1.0, shift);
        for (int64_t i = 0; i < n; i++)
            dst[i] = (float)src[i] * factor;
    } else { /* numpy computes int32 * python float in float64, then casts */
        double factor = ldexp(1.0, shift);
        for (int64_t i = 0; i < n; i++)
            dst[i] = (float)((double)src[i] * factor);
    }
}

/* quant.exponents_of_peaks of one chunk's peak (bits of its greatest magnitude) */
static int16_t exponent_of_peak(int32_t peak) {
    if (peak == 0)
        return WIRE_EXP_ZERO;
    if (peak >= 0x7F800000)
        return WIRE_EXP_NONFINITE;
    float f;
    memcpy(&f, &peak, 4);
    int e;
    frexpf(f, &e);
    return (int16_t)e;
}

/* The greatest of n float32 magnitudes as bits: with the sign cleared, a
 * float32's bits as an int32 grow with its magnitude and NaNs lie above inf
 * (quant.block_peaks), so an integer max.  The loop vectorises, but SSE2 (the
 * x86-64 baseline) has no int32 max and emulates it in four instructions; AVX2
 * has one, eight lanes wide: the pass over a sparse call's input, which its
 * first message waits for, takes a third of the time (bench/first_send.py).
 * One body, two builds, the AVX2 one picked at import where the CPU has it. */
#define MAGNITUDE_PEAK_BODY                                                        \
    {                                                                              \
        int32_t peak = 0;                                                          \
        for (int64_t i = 0; i < n; i++) {                                          \
            int32_t magnitude = bits[i] & 0x7FFFFFFF;                              \
            peak = magnitude > peak ? magnitude : peak;                            \
        }                                                                          \
        return peak;                                                               \
    }
static int32_t magnitude_peak_baseline(const int32_t *bits, int64_t n) MAGNITUDE_PEAK_BODY
#if defined(__x86_64__) && defined(__GNUC__)
#define HAVE_AVX2_BUILD 1
__attribute__((target("avx2"))) static int32_t magnitude_peak_avx2(const int32_t *bits,
                                                                  int64_t n) MAGNITUDE_PEAK_BODY
#endif
static int32_t (*magnitude_peak)(const int32_t *, int64_t) = magnitude_peak_baseline;

/* quant.chunk_exponents of one chunk: smallest e with 2**e > max|x|, or a special. */
static int16_t chunk_exponent(const float *values, int64_t n) {
    return exponent_of_peak(magnitude_peak((const int32_t *)values, n));
}

