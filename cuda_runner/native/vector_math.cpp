/*
 * Vectorized replacements for the SLEEF vector functions that CPU model
 * libraries import (ATen's Vectorized<T> calls Sleef_expf8_u10 and so on),
 * for libraries bound to cuda-runner's shim instead of libtorch.
 *
 * Exported as cr_sl_<base><f|d><lanes><suffix> (the runtime renames a
 * library's undefined "Sleef_" symbols to "cr_sl_"), for 30 functions x
 * float/double x three widths: SSE2 (f4, d2), AVX2+FMA (f8, d4) and
 * AVX-512F/DQ (f16, d8).  Arguments and results are __m128/__m128d/__m256/
 * __m256d/__m512/__m512d by value, as in SLEEF.  The u35 variants of sin and
 * cos are aliases of the u10 ones.
 *
 * Structure.  This file includes vector_math_kernels.inc three times, each
 * time inside "#pragma GCC target(...)" (sse2; avx2,fma; avx512f,avx512dq,fma)
 * and its own namespace, so every kernel is written once, on GCC vector
 * extension types (vf, vd, vi, vl of the region's width) with small helpers
 * (fma, select, rounding, bit casts, error-free sums/products, double-double
 * arithmetic); the few ISA-specific pieces (fma, sqrt, round, movemask,
 * float<->double halves, per-lane table rows) are #if'ed on the width.  No
 * -march flag is needed.  Build: g++ -O2 -std=c++17 -fPIC -shared; it needs
 * only libc and libm (fma and ldexp, in the scalar reduction below).
 *
 * Method.  Range reduction plus minimax polynomials (coefficients fitted with
 * a Remez exchange in mpmath: scripts/vector_math/gen_coeffs.py), with
 * error-free transformations / double-double arithmetic wherever a single
 * rounding of an intermediate would cost a noticeable part of an ULP:
 *  - exp, exp2, expm1: x = k ln2 + r (Cody-Waite, exact first step), e^r by a
 *    polynomial, 1 + r and the reduction error carried separately; 2^k added
 *    to the exponent field (two-step scaling only for overflow/denormals).
 *  - log family: x = 2^k m, m in [sqrt(1/2), sqrt(2)), log m = 2 atanh(s),
 *    s = (m-1)/(m+1) as a double-double; log2/log10/log1p/asinh/acosh/atanh
 *    build on it in double-double.  pow uses a 64-entry table reduction
 *    (|r| < 0.008, ~2^-70 relative log) and exp of a double-double.
 *  - sin, cos, tan: x = k pi/2 + r with a 3-part pi/2 and exact products, r
 *    kept as a double-double, for |x| <= 1.5e9; beyond that, lanes are
 *    reduced by a scalar Payne-Hanek routine (vm_rem_pio2: 2/pi to 1216 bits,
 *    exact integer products; right even for the worst case near DBL_MAX) and
 *    then go through the same vector kernels.  This is the only per-lane
 *    scalar code, and it runs only for lanes with |x| > 1.5e9.
 *  - asin/acos (x and sqrt((1-x)/2) forms), atan/atan2 (fdlibm-style
 *    reduction at 4 breakpoints, in double-double), sinh/cosh/tanh (polynomial for small |x|, exp in
 *    double-double otherwise), erf/erfc (polynomial below 1/2, else
 *    exp(-x^2) Q(x) with Q piecewise on 8 intervals, coefficients gathered per
 *    lane), lgamma (polynomial around 2 reached by exact shifts, Stirling from
 *    8, reflection with a double-double sin(pi x) for x < 0), hypot (exact sum
 *    of squares, corrected square root, exact rounding of denormal results),
 *    fmod (exact long division, a vector loop of ~52 bits per step),
 *    nextafter/copysign (bit operations).
 *  - float: exp, exp2, log, log2, log10 are computed in float arithmetic; the
 *    other float functions convert each half of the vector to double and use
 *    double kernels (float-accuracy polynomials where that is enough), which
 *    makes them correctly rounded in almost all cases.
 *
 * Measured accuracy (scripts/vector_math/accuracy.py: 1e6 float / 2e5 double points per
 * function and width over the whole range incl. denormals, plus edge values;
 * references glibc long double and mpmath), max ULP over the SSE2 and AVX2
 * entry points:
 *
 *   function  bound  float  double        function   bound  float  double
 *   exp       1.0    0.78   0.75          sinh       1.0    0.50   0.73
 *   exp2      1.0    0.77   0.74          cosh       1.0    0.50   0.55
 *   expm1     1.0    0.50   0.59          tanh       1.0    0.50   0.53
 *   log       1.0    0.54   0.54          asinh      1.0    0.50   0.53
 *   log2      1.0    0.56   0.55          acosh      1.0    0.50   0.52
 *   log10     1.0    0.55   0.53          atanh      1.0    0.50   0.53
 *   log1p     1.0    0.50   0.54          erf        1.0    0.50   0.65
 *   sin       1.0    0.50   0.71          erfc       1.5    0.50   0.99
 *   cos       1.0    0.50   0.73          lgamma     1.0    0.50   see below
 *   tan       1.0    0.50   0.76          atan2      1.0    0.50   0.62
 *   asin      1.0    0.50   0.61          pow        1.0    0.50   0.58
 *   acos      1.0    0.50   0.59          hypot      0.5    0.50   0.50
 *   atan      1.0    0.50   0.58          fmod, nextafter, copysign: exact
 *
 * (exp/exp2 reach 0.75 only for denormal results; for normal results 0.64.)  NaN,
 * infinities and signed zeros follow C99 Annex F (pow(1, NaN) = 1,
 * pow(-8, 1/3) = NaN, hypot(inf, NaN) = inf, lgamma(-n) = +inf, ...).
 *
 * Not met: double lgamma for x < 0 near the zeros of lgamma (x = -2.457...,
 * -2.747..., ...): the reflection formula cancels there, the absolute error
 * stays below 6e-17 but the error in ULPs of the tiny result was measured up
 * to 145 (random sweep; edge values closer to a zero more).  Elsewhere double
 * lgamma is within 0.70 ULP (x > 0: 0.70; x < 0 with |lgamma| > 0.5: 0.61).
 * SLEEF documents the same limitation (max(1 ULP, 1e-15) for x < 0).
 *
 * The AVX-512 entry points compile from the same kernels but were not run
 * (no AVX-512 hardware was available); their ISA-specific helpers are the
 * VM_BYTES == 64 branches of the helper section.
 */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define VM_EXPORT extern "C" __attribute__((visibility("default")))
#define VM_CAT_(a, b) a##b
#define VM_CAT(a, b) VM_CAT_(a, b)
#define VM_STR_(a) #a
#define VM_STR(a) VM_STR_(a)
#define VMI static inline __attribute__((always_inline))

// ---------------------------------------------------------------------------
// Payne-Hanek reduction (scalar; only for lanes with |x| > 1.5e9, which the
// vector Cody-Waite reduction does not cover).  x = (q + f) pi/2, |f| <= 1/2;
// returns q and f pi/2 as rh + rl (about 106 bits, even for the worst cases).
// ---------------------------------------------------------------------------
// 2/pi in binary: 64 zero bits, then the bits of 2/pi (1216 bits).
static const uint64_t VM_2OPI[20] = {0x0000000000000000ULL, 0xa2f9836e4e441529ULL, 0xfc2757d1f534ddc0ULL, 0xdb6295993c439041ULL, 0xfe5163abdebbc561ULL, 0xb7246e3a424dd2e0ULL, 0x06492eea09d1921cULL, 0xfe1deb1cb129a73eULL, 0xe88235f52ebb4484ULL, 0xe99c7026b45f7e41ULL, 0x3991d639835339f4ULL, 0x9c845f8bbdf9283bULL, 0x1ff897ffde05980fULL, 0xef2f118b5a0a6d1fULL, 0x6d367ecf27cb09b7ULL, 0x4f463f669e5fea2dULL, 0x7527bac7ebe5f17bULL, 0x3d0739f78a5292eaULL, 0x6bfb5fb11f8d5d08ULL, 0x56033046fc7b6babULL};
static __attribute__((noinline)) int vm_rem_pio2(double x, double *rh, double *rl) {
  typedef unsigned __int128 u128;
  uint64_t ix;
  __builtin_memcpy(&ix, &x, 8);
  int e = (int)((ix >> 52) & 0x7ff);
  uint64_t m = (ix & 0xfffffffffffffULL) | (1ULL << 52);
  int E = e - 1075;            // x = m 2^E (|x| >= 2^30 here, so E >= -22)
  int n0 = (E - 1) + 63;       // first needed bit of 2/pi in VM_2OPI
  int wi = n0 >> 6, o = n0 & 63;
  uint64_t w[3];
  for (int i = 0; i < 3; ++i)
    w[i] = o ? (VM_2OPI[wi + i] << o) | (VM_2OPI[wi + i + 1] >> (64 - o)) : VM_2OPI[wi + i];
  // P = m * (w0:w1:w2), 256 bits; x*2/pi mod 4 = P * 2^-190 mod 4
  u128 a2 = (u128)m * w[2], a1 = (u128)m * w[1], a0 = (u128)m * w[0];
  uint64_t p0 = (uint64_t)a2;
  u128 t = (a2 >> 64) + (uint64_t)a1;
  uint64_t p1 = (uint64_t)t;
  t = (t >> 64) + (a1 >> 64) + (uint64_t)a0;
  uint64_t p2 = (uint64_t)t;
  int q = (int)(p2 >> 62);
  // fraction: bits 189..0 of P, as hi (128 bits) and lo (62 bits)
  u128 hi = ((u128)(p2 & ((1ULL << 62) - 1)) << 66) | ((u128)p1 << 2) | (p0 >> 62);
  uint64_t lo = p0 & ((1ULL << 62) - 1);
  int neg = 0;
  if (hi >> 127) {  // fraction >= 1/2: round the quotient up
    q += 1;
    neg = 1;
    uint64_t borrow = lo != 0;
    lo = (0 - lo) & ((1ULL << 62) - 1);
    hi = ~hi + (borrow ? 0 : 1);
  }
  int sh = 0;
  while (sh < 62 && !(hi >> 127)) {  // normalize (the fraction can be ~2^-61)
    hi = (hi << 1) | (lo >> 61);
    lo = (lo << 1) & ((1ULL << 62) - 1);
    ++sh;
  }
  // hi = T 2^64 + U = (T >> 11) 2^75 + ((T & 0x7ff) 2^64 + U): the top 53 bits
  // exactly, the next 75 rounded (no 128-bit float conversions: no libgcc)
  uint64_t T = (uint64_t)(hi >> 64), U = (uint64_t)hi;
  double d1 = (double)(T >> 11) * __builtin_ldexp(1.0, -53 - sh);
  double d2 = ((double)(T & 0x7ff) * 0x1p64 + (double)U) * __builtin_ldexp(1.0, -128 - sh);
  // (d1 + d2) * pi/2
  const double P1 = 0x1.921fb54442d18p0, P2 = 0x1.1a62633145c07p-54;
  double h = d1 * P1;
  double l = __builtin_fma(d1, P1, -h) + (d1 * P2 + d2 * P1);
  double r = h + l;
  l = l - (r - h);
  if (neg) {
    r = -r;
    l = -l;
  }
  if (ix >> 63) {
    r = -r;
    l = -l;
    q = -q;
  }
  *rh = r;
  *rl = l;
  return q;
}

// ---- SSE2: f4 / d2, no FMA ----
#pragma GCC push_options
#pragma GCC target("sse2")
#define VM_NS vm_sse2
#define VM_BYTES 16
#define VM_FMA 0
#include "vector_math_kernels.inc"
#undef VM_NS
#undef VM_BYTES
#undef VM_FMA
#pragma GCC pop_options

// ---- AVX2 + FMA: f8 / d4 ----
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define VM_NS vm_avx2
#define VM_BYTES 32
#define VM_FMA 1
#include "vector_math_kernels.inc"
#undef VM_NS
#undef VM_BYTES
#undef VM_FMA
#pragma GCC pop_options

// ---- AVX-512F/DQ: f16 / d8 ----
#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,fma")
#define VM_NS vm_avx512
#define VM_BYTES 64
#define VM_FMA 1
#include "vector_math_kernels.inc"
#undef VM_NS
#undef VM_BYTES
#undef VM_FMA
#pragma GCC pop_options

