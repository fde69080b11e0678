/*
 * The vector math functions that CPU model libraries with vector code import
 * (ATen's Vectorized<T> calls SLEEF: Sleef_expf8_u10 and so on), for libraries
 * bound to cuda-runner's shim instead of libtorch, which otherwise supplies them.
 *
 * Exported as cr_sl_<name>: the runtime renames a library's undefined
 * "Sleef_" symbols to "cr_sl_" (the same length) in its private copy, as it
 * renames aoti_torch_ to cudarunner_ (aoti_shim.cpp). Each function applies
 * the C library's function lane by lane. That is not always within the bound
 * SLEEF's name promises (measured against mpmath: tanh 1.7 ULP, erfc 2.1 ULP,
 * lgamma of negative arguments 3.5 ULP, where the names say 1.0 or 1.5), but
 * far inside any tolerance results are compared with; libtorch's results are
 * matched to those tolerances, not bit for bit. It is slower than SLEEF's
 * polynomial code; such libraries still get vector code everywhere else.
 */
#include <immintrin.h>

#include <cmath>

#define EXPORT extern "C" __attribute__((visibility("default")))

// One unary function over every lane width x86 libraries use: SSE (f4, d2),
// AVX2 (f8, d4) and AVX-512 (f16, d8).
#define LANES_1(base, suffix, function)                                                                        \
  EXPORT __attribute__((target("sse2"))) __m128 cr_sl_##base##f4##suffix(__m128 x) {                             \
    alignas(16) float v[4];                                                                                    \
    _mm_store_ps(v, x);                                                                                        \
    for (float &lane : v) lane = std::function(lane);                                                          \
    return _mm_load_ps(v);                                                                                     \
  }                                                                                                            \
  EXPORT __attribute__((target("sse2"))) __m128d cr_sl_##base##d2##suffix(__m128d x) {                           \
    alignas(16) double v[2];                                                                                   \
    _mm_store_pd(v, x);                                                                                        \
    for (double &lane : v) lane = std::function(lane);                                                         \
    return _mm_load_pd(v);                                                                                     \
  }                                                                                                            \
  EXPORT __attribute__((target("avx2"))) __m256 cr_sl_##base##f8##suffix(__m256 x) {                             \
    alignas(32) float v[8];                                                                                    \
    _mm256_store_ps(v, x);                                                                                     \
    for (float &lane : v) lane = std::function(lane);                                                          \
    return _mm256_load_ps(v);                                                                                  \
  }                                                                                                            \
  EXPORT __attribute__((target("avx2"))) __m256d cr_sl_##base##d4##suffix(__m256d x) {                           \
    alignas(32) double v[4];                                                                                   \
    _mm256_store_pd(v, x);                                                                                     \
    for (double &lane : v) lane = std::function(lane);                                                         \
    return _mm256_load_pd(v);                                                                                  \
  }                                                                                                            \
  EXPORT __attribute__((target("avx512f"))) __m512 cr_sl_##base##f16##suffix(__m512 x) {                         \
    alignas(64) float v[16];                                                                                   \
    _mm512_store_ps(v, x);                                                                                     \
    for (float &lane : v) lane = std::function(lane);                                                          \
    return _mm512_load_ps(v);                                                                                  \
  }                                                                                                            \
  EXPORT __attribute__((target("avx512f"))) __m512d cr_sl_##base##d8##suffix(__m512d x) {                        \
    alignas(64) double v[8];                                                                                   \
    _mm512_store_pd(v, x);                                                                                     \
    for (double &lane : v) lane = std::function(lane);                                                         \
    return _mm512_load_pd(v);                                                                                  \
  }

#define LANES_2(base, suffix, function)                                                                        \
  EXPORT __attribute__((target("sse2"))) __m128 cr_sl_##base##f4##suffix(__m128 x, __m128 y) {                   \
    alignas(16) float v[4], w[4];                                                                              \
    _mm_store_ps(v, x);                                                                                        \
    _mm_store_ps(w, y);                                                                                        \
    for (int i = 0; i < 4; ++i) v[i] = std::function(v[i], w[i]);                                              \
    return _mm_load_ps(v);                                                                                     \
  }                                                                                                            \
  EXPORT __attribute__((target("sse2"))) __m128d cr_sl_##base##d2##suffix(__m128d x, __m128d y) {                \
    alignas(16) double v[2], w[2];                                                                             \
    _mm_store_pd(v, x);                                                                                        \
    _mm_store_pd(w, y);                                                                                        \
    for (int i = 0; i < 2; ++i) v[i] = std::function(v[i], w[i]);                                              \
    return _mm_load_pd(v);                                                                                     \
  }                                                                                                            \
  EXPORT __attribute__((target("avx2"))) __m256 cr_sl_##base##f8##suffix(__m256 x, __m256 y) {                   \
    alignas(32) float v[8], w[8];                                                                              \
    _mm256_store_ps(v, x);                                                                                     \
    _mm256_store_ps(w, y);                                                                                     \
    for (int i = 0; i < 8; ++i) v[i] = std::function(v[i], w[i]);                                              \
    return _mm256_load_ps(v);                                                                                  \
  }                                                                                                            \
  EXPORT __attribute__((target("avx2"))) __m256d cr_sl_##base##d4##suffix(__m256d x, __m256d y) {                \
    alignas(32) double v[4], w[4];                                                                             \
    _mm256_store_pd(v, x);                                                                                     \
    _mm256_store_pd(w, y);                                                                                     \
    for (int i = 0; i < 4; ++i) v[i] = std::function(v[i], w[i]);                                              \
    return _mm256_load_pd(v);                                                                                  \
  }                                                                                                            \
  EXPORT __attribute__((target("avx512f"))) __m512 cr_sl_##base##f16##suffix(__m512 x, __m512 y) {               \
    alignas(64) float v[16], w[16];                                                                            \
    _mm512_store_ps(v, x);                                                                                     \
    _mm512_store_ps(w, y);                                                                                     \
    for (int i = 0; i < 16; ++i) v[i] = std::function(v[i], w[i]);                                             \
    return _mm512_load_ps(v);                                                                                  \
  }                                                                                                            \
  EXPORT __attribute__((target("avx512f"))) __m512d cr_sl_##base##d8##suffix(__m512d x, __m512d y) {             \
    alignas(64) double v[8], w[8];                                                                             \
    _mm512_store_pd(v, x);                                                                                     \
    _mm512_store_pd(w, y);                                                                                     \
    for (int i = 0; i < 8; ++i) v[i] = std::function(v[i], w[i]);                                              \
    return _mm512_load_pd(v);                                                                                  \
  }

LANES_1(exp, _u10, exp)
LANES_1(exp2, _u10, exp2)
LANES_1(expm1, _u10, expm1)
LANES_1(log, _u10, log)
LANES_1(log2, _u10, log2)
LANES_1(log10, _u10, log10)
LANES_1(log1p, _u10, log1p)
LANES_1(sin, _u10, sin)
LANES_1(sin, _u35, sin)
LANES_1(cos, _u10, cos)
LANES_1(cos, _u35, cos)
LANES_1(tan, _u10, tan)
LANES_1(asin, _u10, asin)
LANES_1(acos, _u10, acos)
LANES_1(atan, _u10, atan)
LANES_1(sinh, _u10, sinh)
LANES_1(cosh, _u10, cosh)
LANES_1(tanh, _u10, tanh)
LANES_1(asinh, _u10, asinh)
LANES_1(acosh, _u10, acosh)
LANES_1(atanh, _u10, atanh)
LANES_1(erf, _u10, erf)
LANES_1(erfc, _u15, erfc)
LANES_1(lgamma, _u10, lgamma)
LANES_2(atan2, _u10, atan2)
LANES_2(pow, _u10, pow)
LANES_2(hypot, _u05, hypot)
LANES_2(fmod, , fmod)
LANES_2(nextafter, , nextafter)
LANES_2(copysign, , copysign)
