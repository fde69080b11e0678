/*
 * CPU compute kernels for cuda-runner's shim: see cpu_kernels.h.
 *
 * GEMMs go to an OpenBLAS loaded at run time from a path the runtime finds
 * (NumPy's wheels bundle one, `numpy.libs/libscipy_openblas64_-*.so`; the
 * scipy-openblas64 and -32 wheels ship the same build). Its functions carry a
 * `scipy_` prefix, so they never collide with a BLAS libtorch or MKL brings,
 * and they are looked up one by one: the wheels' header declares more than
 * the x86-64 builds export (no bfloat16 GEMM there, for one). Without a BLAS
 * the kernels fall back to a blocked loop, correct and several times slower.
 *
 * BLAS wants each matrix stored by rows or by columns with a leading
 * dimension; a strided view that is neither is copied first. float16 and
 * bfloat16 are widened to float32 (exact), multiplied in float32 and rounded
 * once, to nearest even, as libtorch's CPU GEMMs do.
 *
 * Convolution is im2col + GEMM per batch element and group (transposed:
 * GEMM + col2im), over 1 to 3 spatial dims, any strides, padding, dilation
 * and groups.
 */
#include "cpu_kernels.h"

#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <vector>

namespace cr {
namespace {

enum : int { kRowMajor = 101, kNoTrans = 111, kTrans = 112 };

using Sgemm64 = void (*)(int, int, int, int64_t, int64_t, int64_t, float, const float *, int64_t, const float *, int64_t, float, float *, int64_t);
using Dgemm64 = void (*)(int, int, int, int64_t, int64_t, int64_t, double, const double *, int64_t, const double *, int64_t, double, double *,
                         int64_t);
using Sgemm32 = void (*)(int, int, int, int, int, int, float, const float *, int, const float *, int, float, float *, int);
// OpenBLAS's hook for running its parallel work on the caller's threads (0.3.27 and later).
using DoJob = void (*)(int thread, void *job, int data);
using ThreadsCallback = void (*)(int sync, DoJob job, int jobs, size_t job_size, void *job_data, int data);
using SetThreadsCallback = void (*)(ThreadsCallback);
using Dgemm32 = void (*)(int, int, int, int, int, int, double, const double *, int, const double *, int, double, double *, int);

struct Blas {
  std::string path;
  Sgemm64 sgemm64 = nullptr;
  Dgemm64 dgemm64 = nullptr;
  Sgemm32 sgemm32 = nullptr;
  Dgemm32 dgemm32 = nullptr;
};

Blas blas;
std::mutex blas_lock;

// OpenBLAS's parallel work, run on the OpenMP team the model's own kernels use.
// OpenBLAS otherwise starts threads of its own, and on a machine with few
// cores they and the OpenMP threads, which spin between a model's parallel
// loops, took the cores from each other: a ResNet block's GEMMs ran 30 times
// slower than alone (scripts/bench_cpu.py, resnet). The callback is process-wide for
// the library it is set on (NumPy's copy included): its GEMMs then run on
// OpenMP threads too, which changes nothing but who runs them.
void openmp_jobs(int, DoJob job, int jobs, size_t job_size, void *job_data, int data) {
  char *base = static_cast<char *>(job_data);
#pragma omp parallel for schedule(static)
  for (int index = 0; index < jobs; ++index) job(index, base + index * job_size, data);
}

// ---------------------------------------------------------------- conversions
float from_bfloat16(uint16_t bits) {
  uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  memcpy(&value, &wide, sizeof value);
  return value;
}

uint16_t to_bfloat16(float value) {
  uint32_t bits;
  memcpy(&bits, &value, sizeof bits);
  if (std::isnan(value)) return static_cast<uint16_t>((bits >> 16) | 0x40);  // stays a (quiet) NaN
  bits += 0x7FFF + ((bits >> 16) & 1);  // round to nearest, ties to even
  return static_cast<uint16_t>(bits >> 16);
}

float from_float16(uint16_t bits) {
  uint32_t sign = static_cast<uint32_t>(bits & 0x8000) << 16, exponent = (bits >> 10) & 0x1F, mantissa = bits & 0x3FF, wide;
  if (exponent == 0x1F) {
    wide = sign | 0x7F800000 | (mantissa << 13);
  } else if (exponent != 0) {
    wide = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    wide = sign;
  } else {  // a subnormal half is a normal float
    int shift = 0;
    while (!(mantissa & 0x400)) {
      mantissa <<= 1;
      ++shift;
    }
    wide = sign | (static_cast<uint32_t>(113 - shift) << 23) | ((mantissa & 0x3FF) << 13);
  }
  float value;
  memcpy(&value, &wide, sizeof value);
  return value;
}

uint16_t to_float16(float value) {
  uint32_t bits;
  memcpy(&bits, &value, sizeof bits);
  uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000);
  uint32_t magnitude = bits & 0x7FFFFFFF;
  if (magnitude > 0x7F800000) return sign | 0x7E00;            // NaN
  if (magnitude >= 0x477FF000) return sign | 0x7C00;           // rounds past 65504: infinity
  if (magnitude < 0x38800000) {                                // below the smallest normal half
    if (magnitude < 0x33000000) return sign;                   // below half the smallest subnormal: zero
    uint32_t mantissa = (magnitude & 0x7FFFFF) | 0x800000;
    int shift = 126 - static_cast<int>(magnitude >> 23);       // 14..24
    uint32_t kept = mantissa >> shift, rest = mantissa & ((1u << shift) - 1), halfway = 1u << (shift - 1);
    if (rest > halfway || (rest == halfway && (kept & 1))) ++kept;
    return sign | static_cast<uint16_t>(kept);
  }
  uint32_t rounded = magnitude + 0xFFF + ((magnitude >> 13) & 1) - (112u << 23);  // rebias, round to nearest even
  return sign | static_cast<uint16_t>(rounded >> 13);
}

float load_float(Element element, const void *data, int64_t index) {
  if (element == Element::kBFloat16) return from_bfloat16(static_cast<const uint16_t *>(data)[index]);
  return from_float16(static_cast<const uint16_t *>(data)[index]);
}

void store_float(Element element, void *data, int64_t index, float value) {
  static_cast<uint16_t *>(data)[index] = element == Element::kBFloat16 ? to_bfloat16(value) : to_float16(value);
}

// ---------------------------------------------------------------- GEMM
template <typename T>
struct Gemm;

template <>
struct Gemm<float> {
  static bool call(int trans_a, int trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float *a, int64_t lda, const float *b,
                   int64_t ldb, float beta, float *c, int64_t ldc) {
    if (blas.sgemm64 != nullptr) {
      blas.sgemm64(kRowMajor, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
      return true;
    }
    if (blas.sgemm32 != nullptr && std::max({m, n, k, lda, ldb, ldc}) < (int64_t{1} << 31)) {
      blas.sgemm32(kRowMajor, trans_a, trans_b, int(m), int(n), int(k), alpha, a, int(lda), b, int(ldb), beta, c, int(ldc));
      return true;
    }
    return false;
  }
};

template <>
struct Gemm<double> {
  static bool call(int trans_a, int trans_b, int64_t m, int64_t n, int64_t k, double alpha, const double *a, int64_t lda, const double *b,
                   int64_t ldb, double beta, double *c, int64_t ldc) {
    if (blas.dgemm64 != nullptr) {
      blas.dgemm64(kRowMajor, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
      return true;
    }
    if (blas.dgemm32 != nullptr && std::max({m, n, k, lda, ldb, ldc}) < (int64_t{1} << 31)) {
      blas.dgemm32(kRowMajor, trans_a, trans_b, int(m), int(n), int(k), alpha, a, int(lda), b, int(ldb), beta, c, int(ldc));
      return true;
    }
    return false;
  }
};

// How BLAS can read a matrix in row-major terms: as stored (NoTrans) with
// rows `ld` apart, or as the transpose of a row-major matrix (Trans).
bool layout(const Matrix &matrix, int *trans, int64_t *ld) {
  int64_t row_stride = matrix.rows <= 1 ? std::max<int64_t>(matrix.cols, 1) : matrix.row_stride;
  int64_t col_stride = matrix.cols <= 1 ? 1 : matrix.col_stride;
  if (col_stride == 1 && row_stride >= std::max<int64_t>(matrix.cols, 1)) {
    *trans = kNoTrans, *ld = row_stride;
    return true;
  }
  row_stride = matrix.rows <= 1 ? 1 : matrix.row_stride;
  col_stride = matrix.cols <= 1 ? std::max<int64_t>(matrix.rows, 1) : matrix.col_stride;
  if (row_stride == 1 && col_stride >= std::max<int64_t>(matrix.rows, 1)) {
    *trans = kTrans, *ld = col_stride;
    return true;
  }
  return false;
}

template <typename T>
std::vector<T> packed(const Matrix &matrix) {
  std::vector<T> copy(static_cast<size_t>(matrix.rows * matrix.cols));
  const T *data = static_cast<const T *>(matrix.data);
  for (int64_t i = 0; i < matrix.rows; ++i)
    for (int64_t j = 0; j < matrix.cols; ++j) copy[i * matrix.cols + j] = data[i * matrix.row_stride + j * matrix.col_stride];
  return copy;
}

// The fallback: out = beta * out + alpha * (a @ b) with a blocked loop.
template <typename T>
void loop_gemm(Matrix out, Matrix a, Matrix b, T alpha, T beta) {
  T *c = static_cast<T *>(out.data);
  const T *x = static_cast<const T *>(a.data), *y = static_cast<const T *>(b.data);
  for (int64_t i = 0; i < out.rows; ++i)
    for (int64_t j = 0; j < out.cols; ++j) {
      T &cell = c[i * out.row_stride + j * out.col_stride];
      cell = beta == 0 ? T(0) : beta * cell;
    }
  constexpr int64_t kBlock = 256;
  for (int64_t k0 = 0; k0 < a.cols; k0 += kBlock) {
    int64_t k1 = std::min(a.cols, k0 + kBlock);
    for (int64_t i = 0; i < out.rows; ++i)
      for (int64_t p = k0; p < k1; ++p) {
        T scale = alpha * x[i * a.row_stride + p * a.col_stride];
        const T *row = y + p * b.row_stride;
        T *target = c + i * out.row_stride;
        for (int64_t j = 0; j < out.cols; ++j) target[j * out.col_stride] += scale * row[j * b.col_stride];
      }
  }
}

template <typename T>
void typed_gemm(Matrix out, Matrix a, Matrix b, double alpha, double beta) {
  if (out.rows == 0 || out.cols == 0) return;
  std::vector<T> a_copy, b_copy, c_copy;
  int trans_a, trans_b, trans_c;
  int64_t lda, ldb, ldc;
  bool usable = (blas.sgemm64 || blas.sgemm32) && (sizeof(T) == 4 || blas.dgemm64 || blas.dgemm32);
  if (!usable) {
    loop_gemm<T>(out, a, b, static_cast<T>(alpha), static_cast<T>(beta));
    return;
  }
  if (!layout(a, &trans_a, &lda)) {
    a_copy = packed<T>(a);
    a = Matrix{a_copy.data(), a.rows, a.cols, a.cols, 1};
    layout(a, &trans_a, &lda);
  }
  if (!layout(b, &trans_b, &ldb)) {
    b_copy = packed<T>(b);
    b = Matrix{b_copy.data(), b.rows, b.cols, b.cols, 1};
    layout(b, &trans_b, &ldb);
  }
  Matrix target = out;
  if (!layout(target, &trans_c, &ldc)) {  // written in a packed copy, then copied back
    c_copy = packed<T>(out);
    target = Matrix{c_copy.data(), out.rows, out.cols, out.cols, 1};
    layout(target, &trans_c, &ldc);
  }
  int64_t k = a.cols;
  bool done;
  if (trans_c == kNoTrans) {
    done = Gemm<T>::call(trans_a, trans_b, out.rows, out.cols, k, T(alpha), static_cast<const T *>(a.data), lda,
                         static_cast<const T *>(b.data), ldb, T(beta), static_cast<T *>(target.data), ldc);
  } else {  // out stored by columns: out^T = b^T a^T, row-major
    done = Gemm<T>::call(trans_b == kNoTrans ? kTrans : kNoTrans, trans_a == kNoTrans ? kTrans : kNoTrans, out.cols, out.rows, k, T(alpha),
                         static_cast<const T *>(b.data), ldb, static_cast<const T *>(a.data), lda, T(beta), static_cast<T *>(target.data), ldc);
  }
  if (!done) {
    loop_gemm<T>(target, a, b, static_cast<T>(alpha), static_cast<T>(beta));
  }
  if (!c_copy.empty()) {
    T *data = static_cast<T *>(out.data);
    for (int64_t i = 0; i < out.rows; ++i)
      for (int64_t j = 0; j < out.cols; ++j) data[i * out.row_stride + j * out.col_stride] = c_copy[i * out.cols + j];
  }
}

std::vector<float> widened(Element element, const Matrix &matrix) {
  std::vector<float> copy(static_cast<size_t>(matrix.rows * matrix.cols));
  for (int64_t i = 0; i < matrix.rows; ++i)
    for (int64_t j = 0; j < matrix.cols; ++j) copy[i * matrix.cols + j] = load_float(element, matrix.data, i * matrix.row_stride + j * matrix.col_stride);
  return copy;
}

void half_gemm(Element element, Matrix out, Matrix a, Matrix b, double alpha, double beta) {
  std::vector<float> wide_a = widened(element, a), wide_b = widened(element, b);
  std::vector<float> wide_c = beta != 0 ? widened(element, out) : std::vector<float>(static_cast<size_t>(out.rows * out.cols));
  typed_gemm<float>(Matrix{wide_c.data(), out.rows, out.cols, out.cols, 1}, Matrix{wide_a.data(), a.rows, a.cols, a.cols, 1},
                    Matrix{wide_b.data(), b.rows, b.cols, b.cols, 1}, alpha, beta);
  for (int64_t i = 0; i < out.rows; ++i)
    for (int64_t j = 0; j < out.cols; ++j) store_float(element, out.data, i * out.row_stride + j * out.col_stride, wide_c[i * out.cols + j]);
}

// ---------------------------------------------------------------- convolution
int64_t product(const int64_t *values, int count) {
  int64_t total = 1;
  for (int d = 0; d < count; ++d) total *= values[d];
  return total;
}

// Whether strides are the row-major ones of these sizes (dims of size 1 aside).
bool dense(const int64_t *sizes, const int64_t *strides, int dims) {
  int64_t expected = 1;
  for (int d = dims - 1; d >= 0; --d) {
    if (sizes[d] != 1 && strides[d] != expected) return false;
    expected *= sizes[d];
  }
  return true;
}

// A convolution's geometry with its spatial dims padded to three (leading
// dims of size 1), so that every loop below is the same three nested loops.
struct Geometry {
  int64_t in[3], out[3], kernel[3], stride[3], padding[3], dilation[3];

  explicit Geometry(const ConvShape &s) {
    int lead = 3 - s.spatial;
    for (int d = 0; d < 3; ++d) {
      bool real = d >= lead;
      in[d] = real ? s.in_size[d - lead] : 1;
      out[d] = real ? s.out_size[d - lead] : 1;
      kernel[d] = real ? s.kernel[d - lead] : 1;
      stride[d] = real ? s.stride[d - lead] : 1;
      padding[d] = real ? s.padding[d - lead] : 0;
      dilation[d] = real ? s.dilation[d - lead] : 1;
    }
  }
  int64_t in_plane() const { return in[0] * in[1] * in[2]; }
  int64_t out_plane() const { return out[0] * out[1] * out[2]; }
  int64_t kernel_size() const { return kernel[0] * kernel[1] * kernel[2]; }
};

// im2col: row (channel, kernel offset) of `columns` holds, for every output
// position, the input element that kernel offset meets there (0 in the padding).
template <typename T>
void gather_columns(const Geometry &g, const T *source, int64_t channels, T *columns) {
  int64_t in_plane = g.in_plane(), out_plane = g.out_plane();
  T *column = columns;
  for (int64_t c = 0; c < channels; ++c)
    for (int64_t k0 = 0; k0 < g.kernel[0]; ++k0)
      for (int64_t k1 = 0; k1 < g.kernel[1]; ++k1)
        for (int64_t k2 = 0; k2 < g.kernel[2]; ++k2, column += out_plane) {
          T *cell = column;
          for (int64_t o0 = 0; o0 < g.out[0]; ++o0) {
            int64_t i0 = o0 * g.stride[0] - g.padding[0] + k0 * g.dilation[0];
            for (int64_t o1 = 0; o1 < g.out[1]; ++o1) {
              int64_t i1 = o1 * g.stride[1] - g.padding[1] + k1 * g.dilation[1];
              if (i0 < 0 || i0 >= g.in[0] || i1 < 0 || i1 >= g.in[1]) {
                std::fill_n(cell, g.out[2], T(0));
                cell += g.out[2];
                continue;
              }
              const T *row = source + c * in_plane + (i0 * g.in[1] + i1) * g.in[2];
              int64_t i2 = k2 * g.dilation[2] - g.padding[2];
              for (int64_t o2 = 0; o2 < g.out[2]; ++o2, i2 += g.stride[2]) *cell++ = i2 >= 0 && i2 < g.in[2] ? row[i2] : T(0);
            }
          }
        }
}

// col2im: the transpose of gather_columns, adding each column element into the position it came from.
template <typename T>
void scatter_columns(const Geometry &g, const T *columns, int64_t channels, T *target) {
  // Here `in` is the GEMM's side (the transposed convolution's input) and `out` the image written.
  int64_t in_plane = g.in_plane(), out_plane = g.out_plane();
  const T *column = columns;
  for (int64_t c = 0; c < channels; ++c)
    for (int64_t k0 = 0; k0 < g.kernel[0]; ++k0)
      for (int64_t k1 = 0; k1 < g.kernel[1]; ++k1)
        for (int64_t k2 = 0; k2 < g.kernel[2]; ++k2, column += in_plane) {
          const T *cell = column;
          for (int64_t i0 = 0; i0 < g.in[0]; ++i0) {
            int64_t o0 = i0 * g.stride[0] - g.padding[0] + k0 * g.dilation[0];
            for (int64_t i1 = 0; i1 < g.in[1]; ++i1, cell += g.in[2]) {
              int64_t o1 = i1 * g.stride[1] - g.padding[1] + k1 * g.dilation[1];
              if (o0 < 0 || o0 >= g.out[0] || o1 < 0 || o1 >= g.out[1]) continue;
              T *row = target + c * out_plane + (o0 * g.out[1] + o1) * g.out[2];
              int64_t o2 = k2 * g.dilation[2] - g.padding[2];
              for (int64_t i2 = 0; i2 < g.in[2]; ++i2, o2 += g.stride[2])
                if (o2 >= 0 && o2 < g.out[2]) row[o2] += cell[i2];
            }
          }
        }
}

bool pointwise(const Geometry &g) {
  for (int d = 0; d < 3; ++d)
    if (g.kernel[d] != 1 || g.stride[d] != 1 || g.padding[d] != 0) return false;
  return true;
}

template <typename T>
void forward_conv(const ConvShape &s, T *out, const T *input, const T *weight) {
  // input [N, C, in...], weight [O, C/g, k...], out [N, O, out...]: all dense row-major here; out holds the bias.
  Geometry g(s);
  int64_t in_plane = g.in_plane(), out_plane = g.out_plane();
  int64_t in_per_group = s.in_channels / s.groups, out_per_group = s.out_channels / s.groups, depth = in_per_group * g.kernel_size();
  bool direct = pointwise(g);  // a 1x1 convolution reads its input as the column matrix
  std::vector<T> columns(direct ? 0 : static_cast<size_t>(depth * out_plane));
  for (int64_t n = 0; n < s.batch; ++n)
    for (int64_t group = 0; group < s.groups; ++group) {
      const T *source = input + (n * s.in_channels + group * in_per_group) * in_plane;
      if (!direct) gather_columns(g, source, in_per_group, columns.data());
      Matrix result{out + (n * s.out_channels + group * out_per_group) * out_plane, out_per_group, out_plane, out_plane, 1};
      Matrix filters{const_cast<T *>(weight) + group * out_per_group * depth, out_per_group, depth, depth, 1};
      Matrix gathered{direct ? const_cast<T *>(source) : columns.data(), depth, out_plane, out_plane, 1};
      typed_gemm<T>(result, filters, gathered, 1.0, 1.0);
    }
}

template <typename T>
void transposed_conv(const ConvShape &s, T *out, const T *input, const T *weight) {
  // input [N, C, in...], weight [C, O/g, k...], out [N, O, out...]: dense here; out holds the bias.
  Geometry g(s);
  int64_t in_plane = g.in_plane(), out_plane = g.out_plane();
  int64_t in_per_group = s.in_channels / s.groups, out_per_group = s.out_channels / s.groups, depth = out_per_group * g.kernel_size();
  std::vector<T> columns(static_cast<size_t>(depth * in_plane));
  for (int64_t n = 0; n < s.batch; ++n)
    for (int64_t group = 0; group < s.groups; ++group) {
      // columns[(o, k), p] = sum_c weight[c, o, k] * input[c, p]
      Matrix filters_t{const_cast<T *>(weight) + group * in_per_group * depth, depth, in_per_group, 1, depth};
      Matrix source{const_cast<T *>(input) + (n * s.in_channels + group * in_per_group) * in_plane, in_per_group, in_plane, in_plane, 1};
      typed_gemm<T>(Matrix{columns.data(), depth, in_plane, in_plane, 1}, filters_t, source, 1.0, 0.0);
      scatter_columns(g, columns.data(), out_per_group, out + (n * s.out_channels + group * out_per_group) * out_plane);
    }
}

// Where a channels-last tensor keeps its channel dim: innermost, spatial dims
// packed outside it, then the batch (N, spatial..., C in memory).
bool channels_last(const int64_t *sizes, const int64_t *strides, int dims) {
  if (sizes[1] != 1 && strides[1] != 1) return false;
  int64_t expected = sizes[1];
  for (int d = dims - 1; d >= 2; --d) {
    if (sizes[d] != 1 && strides[d] != expected) return false;
    expected *= sizes[d];
  }
  return sizes[0] == 1 || strides[0] == expected;
}

// Copies element by element between two strided layouts of the same sizes, converting each element.
template <typename Read, typename Write>
void strided_each(const int64_t *sizes, int dims, const int64_t *from, const int64_t *to, Read read, Write write, int dim = 0, int64_t at_from = 0,
                  int64_t at_to = 0) {
  if (dim == dims - 1) {
    for (int64_t i = 0; i < sizes[dim]; ++i) write(at_to + i * to[dim], read(at_from + i * from[dim]));
    return;
  }
  for (int64_t i = 0; i < sizes[dim]; ++i) strided_each(sizes, dims, from, to, read, write, dim + 1, at_from + i * from[dim], at_to + i * to[dim]);
}

void first_strides(const int64_t *sizes, int dims, int64_t *strides) {
  int64_t step = 1;
  for (int d = dims - 1; d >= 0; --d) {
    strides[d] = step;
    step *= sizes[d];
  }
}

void last_strides(const int64_t *sizes, int dims, int64_t *strides) {
  int64_t step = sizes[1];
  strides[1] = 1;
  for (int d = dims - 1; d >= 2; --d) {
    strides[d] = step;
    step *= sizes[d];
  }
  strides[0] = step;
}

// A convolution operand in the working precision T, dense in the layout the
// kernels read (channels first, or channels last when `last`): the tensor
// itself where it already is, else a converted copy.
template <typename T>
struct Operand {
  const T *data = nullptr;
  std::vector<T> copy;

  Operand(Element element, const void *source, const int64_t *sizes, const int64_t *strides, int dims, bool last) {
    int64_t wanted[5];
    if (last) {
      last_strides(sizes, dims, wanted);
    } else {
      first_strides(sizes, dims, wanted);
    }
    bool native = sizeof(T) == 8 || element == Element::kFloat32;
    if (native && (last ? channels_last(sizes, strides, dims) : dense(sizes, strides, dims))) {
      data = static_cast<const T *>(source);
      return;
    }
    copy.resize(static_cast<size_t>(product(sizes, dims)));
    T *target = copy.data();
    if (native) {
      const T *from = static_cast<const T *>(source);
      strided_each(sizes, dims, strides, wanted, [&](int64_t at) { return from[at]; }, [&](int64_t at, T value) { target[at] = value; });
    } else {
      strided_each(sizes, dims, strides, wanted, [&](int64_t at) { return static_cast<T>(load_float(element, source, at)); },
                   [&](int64_t at, T value) { target[at] = value; });
    }
    data = target;
  }
};

// Channels last, not transposed: per batch element and group,
// out[P, O/g] = patches[P, K] @ weight[O/g, K]^T with K = (kernel position, channel),
// each patch row gathered as channel runs (a 1x1 convolution's is the input itself).
template <typename T>
void channels_last_conv(const ConvShape &s, T *out, const T *input, const T *weight) {
  Geometry g(s);
  int64_t in_plane = g.in_plane(), out_plane = g.out_plane(), kernel_size = g.kernel_size();
  int64_t in_per_group = s.in_channels / s.groups, out_per_group = s.out_channels / s.groups, depth = kernel_size * in_per_group;
  bool direct = pointwise(g) && s.groups == 1;
  std::vector<T> patches(direct ? 0 : static_cast<size_t>(out_plane * depth));
  for (int64_t n = 0; n < s.batch; ++n)
    for (int64_t group = 0; group < s.groups; ++group) {
      const T *source = input + n * in_plane * s.in_channels + group * in_per_group;
      if (!direct) {
        T *row = patches.data();
        for (int64_t o0 = 0; o0 < g.out[0]; ++o0)
          for (int64_t o1 = 0; o1 < g.out[1]; ++o1)
            for (int64_t o2 = 0; o2 < g.out[2]; ++o2)
              for (int64_t k0 = 0; k0 < g.kernel[0]; ++k0) {
                int64_t i0 = o0 * g.stride[0] - g.padding[0] + k0 * g.dilation[0];
                for (int64_t k1 = 0; k1 < g.kernel[1]; ++k1) {
                  int64_t i1 = o1 * g.stride[1] - g.padding[1] + k1 * g.dilation[1];
                  for (int64_t k2 = 0; k2 < g.kernel[2]; ++k2, row += in_per_group) {
                    int64_t i2 = o2 * g.stride[2] - g.padding[2] + k2 * g.dilation[2];
                    if (i0 < 0 || i0 >= g.in[0] || i1 < 0 || i1 >= g.in[1] || i2 < 0 || i2 >= g.in[2]) {
                      std::fill_n(row, in_per_group, T(0));
                    } else {
                      memcpy(row, source + ((i0 * g.in[1] + i1) * g.in[2] + i2) * s.in_channels, sizeof(T) * in_per_group);
                    }
                  }
                }
              }
      }
      Matrix gathered = direct ? Matrix{const_cast<T *>(source), out_plane, depth, s.in_channels, 1} : Matrix{patches.data(), out_plane, depth, depth, 1};
      Matrix filters_t{const_cast<T *>(weight) + group * out_per_group * depth, depth, out_per_group, 1, depth};
      Matrix result{out + n * out_plane * s.out_channels + group * out_per_group, out_plane, out_per_group, s.out_channels, 1};
      typed_gemm<T>(result, gathered, filters_t, 1.0, 1.0);  // out holds the bias
    }
}

template <typename T>
void typed_convolution(Element element, const ConvShape &s, Strided out, Strided input, Strided weight, const void *bias, int64_t bias_stride) {
  int dims = 2 + s.spatial;
  int64_t in_sizes[5] = {s.batch, s.in_channels}, out_sizes[5] = {s.batch, s.out_channels}, weight_sizes[5];
  for (int d = 0; d < s.spatial; ++d) {
    in_sizes[2 + d] = s.in_size[d];
    out_sizes[2 + d] = s.out_size[d];
    weight_sizes[2 + d] = s.kernel[d];
  }
  weight_sizes[0] = s.transposed ? s.in_channels : s.out_channels;
  weight_sizes[1] = s.transposed ? s.out_channels / s.groups : s.in_channels / s.groups;
  // Channels last (what Inductor hands 2-D convolutions) is computed as it is laid out; anything else channels first.
  bool last = !s.transposed && channels_last(in_sizes, input.strides, dims) && channels_last(out_sizes, out.strides, dims);
  Operand<T> x(element, input.data, in_sizes, input.strides, dims, last), w(element, weight.data, weight_sizes, weight.strides, dims, last);
  bool native = sizeof(T) == 8 || element == Element::kFloat32;
  bool in_place = native && (last || dense(out_sizes, out.strides, dims));
  int64_t out_plane = product(s.out_size, s.spatial), count = s.batch * s.out_channels * out_plane;
  std::vector<T> y_copy(in_place ? 0 : static_cast<size_t>(count));
  T *y = in_place ? static_cast<T *>(out.data) : y_copy.data();
  for (int64_t n = 0; n < s.batch; ++n)
    for (int64_t o = 0; o < s.out_channels; ++o) {
      T start = T(0);
      if (bias != nullptr) {
        if constexpr (sizeof(T) == 8) {
          start = static_cast<const double *>(bias)[o * bias_stride];
        } else {
          start = element == Element::kFloat32 ? static_cast<const float *>(bias)[o * bias_stride] : load_float(element, bias, o * bias_stride);
        }
      }
      if (last) {
        for (int64_t p = 0; p < out_plane; ++p) y[(n * out_plane + p) * s.out_channels + o] = start;
      } else {
        std::fill_n(y + (n * s.out_channels + o) * out_plane, out_plane, start);
      }
    }
  if (last) {
    channels_last_conv<T>(s, y, x.data, w.data);
  } else if (s.transposed) {
    transposed_conv<T>(s, y, x.data, w.data);
  } else {
    forward_conv<T>(s, y, x.data, w.data);
  }
  if (in_place) return;
  int64_t computed[5];
  if (last) {
    last_strides(out_sizes, dims, computed);
  } else {
    first_strides(out_sizes, dims, computed);
  }
  if (native) {
    T *target = static_cast<T *>(out.data);
    strided_each(out_sizes, dims, computed, out.strides, [&](int64_t at) { return y[at]; }, [&](int64_t at, T value) { target[at] = value; });
  } else {
    strided_each(out_sizes, dims, computed, out.strides, [&](int64_t at) { return y[at]; },
                 [&](int64_t at, T value) { store_float(element, out.data, at, static_cast<float>(value)); });
  }
}

template <typename Function>
bool bind(void *library, const char *name, Function *slot) {
  *slot = reinterpret_cast<Function>(dlsym(library, name));
  return *slot != nullptr;
}

}  // namespace

bool load_blas(const char *path, std::string *error) {
  std::lock_guard<std::mutex> hold(blas_lock);
  if (!blas.path.empty()) {
    if (blas.path == path) return true;
    *error = "another BLAS is already loaded: " + blas.path;
    return false;
  }
  void *library = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    const char *why = dlerror();
    *error = std::string("cannot load ") + path + ": " + (why ? why : "unknown error");
    return false;
  }
  Blas found;
  bool ilp64 = bind(library, "scipy_cblas_sgemm64_", &found.sgemm64) && bind(library, "scipy_cblas_dgemm64_", &found.dgemm64);
  bool lp64 = !ilp64 && bind(library, "scipy_cblas_sgemm", &found.sgemm32) && bind(library, "scipy_cblas_dgemm", &found.dgemm32);
  if (!ilp64 && !lp64) {
    dlclose(library);
    *error = std::string(path) + " exports no scipy_cblas_sgemm64_ or scipy_cblas_sgemm: not a scipy-openblas build";
    return false;
  }
  found.path = path;
  SetThreadsCallback set_callback = nullptr;
  if (bind(library, ilp64 ? "scipy_openblas_set_threads_callback_function64_" : "scipy_openblas_set_threads_callback_function", &set_callback))
    set_callback(openmp_jobs);
  blas = found;  // kept loaded for the process
  return true;
}

const char *blas_path() { return blas.path.c_str(); }

bool gemm(Element element, Matrix out, Matrix a, Matrix b, double alpha, double beta, std::string *error) {
  switch (element) {
    case Element::kFloat32:
      typed_gemm<float>(out, a, b, alpha, beta);
      return true;
    case Element::kFloat64:
      typed_gemm<double>(out, a, b, alpha, beta);
      return true;
    case Element::kFloat16:
    case Element::kBFloat16:
      half_gemm(element, out, a, b, alpha, beta);
      return true;
  }
  *error = "a GEMM dtype this shim does not compute";
  return false;
}

bool convolution(Element element, const ConvShape &shape, Strided out, Strided input, Strided weight, const void *bias, int64_t bias_stride,
                 std::string *error) {
  switch (element) {
    case Element::kFloat64:
      typed_convolution<double>(element, shape, out, input, weight, bias, bias_stride);
      return true;
    case Element::kFloat32:
    case Element::kFloat16:
    case Element::kBFloat16:
      typed_convolution<float>(element, shape, out, input, weight, bias, bias_stride);
      return true;
  }
  *error = "a convolution dtype this shim does not compute";
  return false;
}

}  // namespace cr
