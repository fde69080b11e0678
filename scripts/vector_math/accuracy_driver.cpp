// Test driver: calls a SLEEF-ABI vector function (given by address) over
// arrays, and computes long double libm reference values.
#include <immintrin.h>
#include <math.h>
#include <string.h>

#define X extern "C"

X __attribute__((target("sse2"))) void run_f4(void *fn, int ar, const float *x, const float *y, float *o, long n) {
  if (ar == 1) {
    auto f = (__m128(*)(__m128))fn;
    for (long i = 0; i < n; i += 4) _mm_storeu_ps(o + i, f(_mm_loadu_ps(x + i)));
  } else {
    auto f = (__m128(*)(__m128, __m128))fn;
    for (long i = 0; i < n; i += 4) _mm_storeu_ps(o + i, f(_mm_loadu_ps(x + i), _mm_loadu_ps(y + i)));
  }
}
X __attribute__((target("sse2"))) void run_d2(void *fn, int ar, const double *x, const double *y, double *o, long n) {
  if (ar == 1) {
    auto f = (__m128d(*)(__m128d))fn;
    for (long i = 0; i < n; i += 2) _mm_storeu_pd(o + i, f(_mm_loadu_pd(x + i)));
  } else {
    auto f = (__m128d(*)(__m128d, __m128d))fn;
    for (long i = 0; i < n; i += 2) _mm_storeu_pd(o + i, f(_mm_loadu_pd(x + i), _mm_loadu_pd(y + i)));
  }
}
X __attribute__((target("avx2"))) void run_f8(void *fn, int ar, const float *x, const float *y, float *o, long n) {
  if (ar == 1) {
    auto f = (__m256(*)(__m256))fn;
    for (long i = 0; i < n; i += 8) _mm256_storeu_ps(o + i, f(_mm256_loadu_ps(x + i)));
  } else {
    auto f = (__m256(*)(__m256, __m256))fn;
    for (long i = 0; i < n; i += 8) _mm256_storeu_ps(o + i, f(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  }
}
X __attribute__((target("avx2"))) void run_d4(void *fn, int ar, const double *x, const double *y, double *o, long n) {
  if (ar == 1) {
    auto f = (__m256d(*)(__m256d))fn;
    for (long i = 0; i < n; i += 4) _mm256_storeu_pd(o + i, f(_mm256_loadu_pd(x + i)));
  } else {
    auto f = (__m256d(*)(__m256d, __m256d))fn;
    for (long i = 0; i < n; i += 4) _mm256_storeu_pd(o + i, f(_mm256_loadu_pd(x + i), _mm256_loadu_pd(y + i)));
  }
}

typedef long double LD;
static LD lg(LD x) { return lgammal(x); }
// long double reference (64-bit significand) for the named function.
X int ref_ld(const char *name, const LD *x, const LD *y, LD *o, long n) {
  LD (*f1)(LD) = 0;
  LD (*f2)(LD, LD) = 0;
#define F1(s, f) else if (!strcmp(name, s)) f1 = f;
#define F2(s, f) else if (!strcmp(name, s)) f2 = f;
  if (0) {
  }
  F1("exp", expl) F1("exp2", exp2l) F1("expm1", expm1l) F1("log", logl) F1("log2", log2l) F1("log10", log10l)
  F1("log1p", log1pl) F1("sin", sinl) F1("cos", cosl) F1("tan", tanl) F1("asin", asinl) F1("acos", acosl)
  F1("atan", atanl) F1("sinh", sinhl) F1("cosh", coshl) F1("tanh", tanhl) F1("asinh", asinhl) F1("acosh", acoshl)
  F1("atanh", atanhl) F1("erf", erfl) F1("erfc", erfcl) F1("lgamma", lg) F2("atan2", atan2l) F2("pow", powl)
  F2("hypot", hypotl) F2("fmod", fmodl) F2("copysign", copysignl)
  else return -1;
  for (long i = 0; i < n; ++i) o[i] = f1 ? f1(x[i]) : f2(x[i], y[i]);
  return 0;
}
X void nextafter_f(const float *x, const float *y, float *o, long n) {
  for (long i = 0; i < n; ++i) o[i] = nextafterf(x[i], y[i]);
}
X void nextafter_d(const double *x, const double *y, double *o, long n) {
  for (long i = 0; i < n; ++i) o[i] = nextafter(x[i], y[i]);
}
