// Speed of the AVX2 vector functions (f8 and d4): this implementation
// (libvm.so: cr_sl_*), the lane-by-lane libm version (libold.so: cr_sl_*), and
// libtorch's SLEEF (libtorch_cpu.so: Sleef_*), each called through a function
// pointer over a 1<<16-element array; ns per element, the median of 41 passes,
// the passes of the three implementations interleaved (so that the drift of a
// shared machine affects all three alike).
//
// build: g++ -O2 -std=c++17 bench.cpp -o bench -ldl
// run:   ./bench [filter]
#include <dlfcn.h>
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

static double now() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

struct Fn {
  const char *base, *sfx;
  int ar;
  double lo, hi, lo2 = 0, hi2 = 0;  // input ranges (common range of the function)
};
static const Fn FNS[] = {
    {"exp", "_u10", 1, -80, 80, 0, 0},      {"exp2", "_u10", 1, -100, 100}, {"expm1", "_u10", 1, -10, 10},
    {"log", "_u10", 1, 1e-3, 1e3},    {"log2", "_u10", 1, 1e-3, 1e3}, {"log10", "_u10", 1, 1e-3, 1e3},
    {"log1p", "_u10", 1, -0.9, 100},  {"sin", "_u10", 1, -10, 10},    {"sin", "_u35", 1, -10, 10},
    {"cos", "_u10", 1, -10, 10},      {"cos", "_u35", 1, -10, 10},    {"tan", "_u10", 1, -10, 10},
    {"asin", "_u10", 1, -1, 1},       {"acos", "_u10", 1, -1, 1},     {"atan", "_u10", 1, -10, 10},
    {"sinh", "_u10", 1, -10, 10},     {"cosh", "_u10", 1, -10, 10},   {"tanh", "_u10", 1, -5, 5},
    {"asinh", "_u10", 1, -10, 10},    {"acosh", "_u10", 1, 1, 10},    {"atanh", "_u10", 1, -0.99, 0.99},
    {"erf", "_u10", 1, -3, 3},        {"erfc", "_u15", 1, -3, 10},    {"lgamma", "_u10", 1, 0.1, 10},
    {"atan2", "_u10", 2, -10, 10, -10, 10}, {"pow", "_u10", 2, 0.1, 10, -10, 10},
    {"hypot", "_u05", 2, -10, 10, -10, 10}, {"fmod", "", 2, -100, 100, 0.1, 10},
    {"nextafter", "", 2, -10, 10, -10, 10}, {"copysign", "", 2, -10, 10, -10, 10},
};

enum { N = 1 << 16 };

// one pass over the array, ns per element
template <class V, class T, int L>
__attribute__((target("avx2"), noinline)) static double time_pass(void *fn, int ar, const T *x, const T *y, T *o) {
  double t0 = now();
  if (ar == 1) {
    auto f = (V(*)(V))fn;
    for (int i = 0; i < N; i += L) {
      V v;
      memcpy(&v, x + i, sizeof v);
      V w = f(v);
      memcpy(o + i, &w, sizeof w);
    }
  } else {
    auto f = (V(*)(V, V))fn;
    for (int i = 0; i < N; i += L) {
      V v, u;
      memcpy(&v, x + i, sizeof v);
      memcpy(&u, y + i, sizeof u);
      V w = f(v, u);
      memcpy(o + i, &w, sizeof w);
    }
  }
  return (now() - t0) / N * 1e9;
}
template <class V, class T, int L>
static void time3(void *const fp[3], int ar, const T *x, const T *y, T *o, double r[3]) {
  std::vector<double> ts[3];
  for (int k = 0; k < 3; ++k)
    if (fp[k])
      for (int w = 0; w < 3; ++w) time_pass<V, T, L>(fp[k], ar, x, y, o);  // warm up
  for (int rep = 0; rep < 41; ++rep)
    for (int k = 0; k < 3; ++k)
      if (fp[k]) ts[k].push_back(time_pass<V, T, L>(fp[k], ar, x, y, o));
  for (int k = 0; k < 3; ++k) {
    r[k] = -1;
    if (ts[k].empty()) continue;
    std::sort(ts[k].begin(), ts[k].end());
    r[k] = ts[k][ts[k].size() / 2];
  }
}

int main(int argc, char **argv) {
  const char *filter = argc > 1 ? argv[1] : nullptr;
  const char *torch = getenv("TORCH_CPU");
  if (!torch) torch = "/work/main/.venv/lib/python3.11/site-packages/torch/lib/libtorch_cpu.so";
  void *hm = dlopen("./libvm.so", RTLD_NOW | RTLD_LOCAL);
  void *ho = dlopen("./libold.so", RTLD_NOW | RTLD_LOCAL);
  void *hs = dlopen(torch, RTLD_LAZY | RTLD_LOCAL);
  if (!hm || !ho) {
    fprintf(stderr, "dlopen: %s\n", dlerror());
    return 1;
  }
  if (!hs) fprintf(stderr, "no SLEEF: %s\n", dlerror());
  std::mt19937_64 rng(42);
  std::vector<float> xf(N), yf(N), of(N);
  std::vector<double> xd(N), yd(N), od(N);
  printf("| function | f8 new | f8 libm lanes | f8 SLEEF | new/SLEEF | d4 new | d4 libm lanes | d4 SLEEF | new/SLEEF |\n");
  printf("|---|---|---|---|---|---|---|---|---|\n");
  for (const Fn &f : FNS) {
    std::string name = std::string(f.base) + f.sfx;
    if (filter && !strstr(name.c_str(), filter)) continue;
    std::uniform_real_distribution<double> d1(f.lo, f.hi), d2(f.ar == 2 ? f.lo2 : 0, f.ar == 2 ? f.hi2 : 1);
    for (int i = 0; i < N; ++i) {
      xd[i] = d1(rng);
      yd[i] = d2(rng);
      xf[i] = (float)xd[i];
      yf[i] = (float)yd[i];
    }
    double r[2][3];
    for (int prec = 0; prec < 2; ++prec) {
      std::string sym = std::string(f.base) + (prec ? "d4" : "f8") + f.sfx;
      void *fm = dlsym(hm, ("cr_sl_" + sym).c_str());
      void *fo = dlsym(ho, ("cr_sl_" + sym).c_str());
      void *fs = hs ? dlsym(hs, ("Sleef_" + sym).c_str()) : nullptr;
      void *fp[3] = {fm, fo, fs};
      if (prec == 0)
        time3<__m256, float, 8>(fp, f.ar, xf.data(), yf.data(), of.data(), r[prec]);
      else
        time3<__m256d, double, 4>(fp, f.ar, xd.data(), yd.data(), od.data(), r[prec]);
    }
    printf("| %s |", name.c_str());
    for (int prec = 0; prec < 2; ++prec) {
      for (int k = 0; k < 3; ++k)
        if (r[prec][k] < 0)
          printf(" - |");
        else
          printf(" %.2f |", r[prec][k]);
      if (r[prec][0] > 0 && r[prec][2] > 0)
        printf(" %.2f |", r[prec][0] / r[prec][2]);
      else
        printf(" - |");
    }
    printf("\n");
    fflush(stdout);
  }
  return 0;
}
