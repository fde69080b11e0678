/*
 * The CPU compute kernels of cuda-runner's shim (cpu_kernels.cpp): GEMMs
 * through a real BLAS (an OpenBLAS found at run time), and convolution as
 * im2col + GEMM. They work on raw memory described by element strides; the
 * shim (aoti_shim.cpp) checks tensors, devices, dtypes and aliasing first.
 */
#pragma once

#include <cstdint>
#include <string>

namespace cr {

// The element types the kernels take (the c10 codes the shim uses).
enum class Element : int32_t { kFloat16 = 5, kFloat32 = 6, kFloat64 = 7, kBFloat16 = 15 };

// A strided 2-D view: element (i, j) is at data[i * row_stride + j * col_stride].
struct Matrix {
  void *data;
  int64_t rows, cols, row_stride, col_stride;
};

// Load the BLAS at `path` (an OpenBLAS of the scipy-openblas builds: NumPy's
// bundled copy or the scipy-openblas64/32 wheel). False, with the reason, if
// it cannot be used; the kernels then use their own loops.
bool load_blas(const char *path, std::string *error);
// What the GEMMs run on: the library's path, or "" for the built-in loops.
const char *blas_path();

// out = beta * out + alpha * (a @ b), in `element` precision (float16 and
// bfloat16 are computed in float32 and rounded once, as libtorch's CPU GEMMs
// do). The caller has put what beta scales in out (or beta is 0).
bool gemm(Element element, Matrix out, Matrix a, Matrix b, double alpha, double beta, std::string *error);

// A convolution of N spatial dims (1 to 3): sizes and strides in elements,
// batch and channel dims first.
struct ConvShape {
  int spatial;                      // 1, 2 or 3
  int64_t batch, in_channels, out_channels, groups;
  int64_t in_size[3], out_size[3], kernel[3];
  int64_t stride[3], padding[3], dilation[3];
  bool transposed;
};

struct Strided {
  void *data;
  int64_t strides[5];  // batch, channel, spatial...
};

// out = conv(input, weight) + bias; weight is [out, in/groups, k...] (or
// [in, out/groups, k...] when transposed); bias is null or [out]. Elements
// of `element` precision; half precisions go through float32.
bool convolution(Element element, const ConvShape &shape, Strided out, Strided input, Strided weight, const void *bias, int64_t bias_stride,
                 std::string *error);

}  // namespace cr
