#pragma once
// Matrix products on the CUDA backend: y (m, n) = [y +] x (m, k) * w (n, k)^T with x and y f32 rows in
// device memory and w a device matrix in f32, f16 or bf16 (through cuBLAS), or block-quantized as the
// file stores it (q8_0, q4_0, q5_0, q5_1, q4_k, q5_k, q6_k: quant_matmul.cuh). f16 and bf16 products
// convert the x rows to the weights' type in a caller-owned workspace and accumulate in f32
// (cublasGemmEx, CUBLAS_COMPUTE_32F); f32 products stay f32 (no TF32: the math mode is the default).
// Decode products (up to 8 x rows) multiply in registers instead (quant_decode), the dense types too.
// Results agree with the host's canonical dot products within the rounding of x to 16 bits (none in
// the decode product; 8 bits with products::int8 for quantized weights, the host's int8 products'
// rounding) and of f32 sums in another order, not bit for bit.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <span>
#include <string>

#include "efim/core/dtype.hpp"
#include "efim/kernels/common.hpp"
#include "efim/kernels/cuda/quant_groups.hpp"
#include "efim/kernels/cuda/quant_matmul.cuh"
#include "efim/kernels/cuda/quant_tiles.cuh"
#include "efim/kernels/cuda/runtime.cuh"

namespace efim::kernels::device {

inline void check_blas(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS)
    throw error(errc::unavailable, std::string("cuBLAS: ") + what + ": " + cublasGetStatusString(status));
}

// A cuBLAS handle whose work is ordered on one stream, with a workspace of its own (set after the
// stream, which resets it): cuBLAS then allocates nothing while a CUDA graph captures its calls.
class blas {
 public:
  static constexpr std::size_t workspace_bytes = 32u << 20;  // what cuBLAS asks for on Hopper

  explicit blas(cudaStream_t stream) : workspace_(workspace_bytes) {
    check_blas(cublasCreate(&handle_), "cublasCreate");
    try {
      check_blas(cublasSetStream(handle_, stream), "cublasSetStream");
      check_blas(cublasSetWorkspace(handle_, workspace_.data(), workspace_bytes), "cublasSetWorkspace");
      check_blas(cublasSetMathMode(handle_, CUBLAS_DEFAULT_MATH), "cublasSetMathMode");
    } catch (...) {
      (void)cublasDestroy(handle_);  // (no destructor runs for an object whose constructor throws)
      throw;
    }
  }
  blas(const blas&) = delete;
  blas& operator=(const blas&) = delete;
  ~blas() { (void)cublasDestroy(handle_); }
  [[nodiscard]] cublasHandle_t get() const noexcept { return handle_; }

 private:
  buffer<std::byte> workspace_;
  cublasHandle_t handle_ = nullptr;
};

// A weight matrix in device memory: (rows = output features, cols = inputs), rows contiguous.
struct matrix {
  dtype type = dtype::f32;  // f32, f16, bf16, or a type quant::kept_quantized names
  std::size_t rows = 0, cols = 0;
  const void* data = nullptr;
};

namespace policy {
struct convert {
  static constexpr int threads = 256;
  static constexpr int max_blocks = 65535;
};
}  // namespace policy

namespace detail {
template <class Policy>
__global__ void __launch_bounds__(Policy::threads) to_16bit_kernel(const float* x, void* out, std::size_t n, bool bf16) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(Policy::threads) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * Policy::threads) {
    if (bf16)
      static_cast<__nv_bfloat16*>(out)[i] = __float2bfloat16_rn(x[i]);
    else
      static_cast<__half*>(out)[i] = __float2half_rn(x[i]);
  }
}
}  // namespace detail

// Whether matmul multiplies m x rows by w with the decode kernel (quant_decode, in registers) rather
// than cuBLAS: up to policy::quant_matmul::decode_rows rows, quantized weights or dense ones of whole
// chunks of 8 values.
inline bool decodes_in_registers(const matrix& w, std::size_t m) noexcept {
  return m <= policy::quant_matmul::decode_rows &&
         (quant::kept_quantized(w.type) || quant::dense_decodes(w.type, w.cols));
}

// Whether matmul multiplies m x rows by quantized w on tensor cores, the weights dequantized in shared
// memory (quant_tiles), rather than in f16 slices: above decode_rows, up to policy::quant_tiles::max_rows.
inline bool multiplies_in_tiles(const matrix& w, std::size_t m) noexcept {
  return quant::kept_quantized(w.type) && m > policy::quant_matmul::decode_rows && m <= policy::quant_tiles::max_rows;
}

// Bytes of workspace `matmul` needs for m rows against w (x converted to w's type; 0 for f32).
inline std::size_t matmul_workspace(const matrix& w, std::size_t m) noexcept {
  if (multiplies_in_tiles(w, m)) return 0;
  if (quant::kept_quantized(w.type)) return quant_matmul_workspace(w.rows, w.cols, m);
  return w.type == dtype::f32 || decodes_in_registers(w, m) ? 0 : m * w.cols * 2;
}

// x (n values) rounded to f16, or to bf16 where bf16, into out (16-bit values), on the stream.
template <class Policy = policy::convert>
void to_16bit(const float* x, void* out, std::size_t n, bool bf16, cudaStream_t stream) {
  const std::size_t blocks = (n + Policy::threads - 1) / Policy::threads;
  detail::to_16bit_kernel<Policy><<<static_cast<unsigned>(blocks < Policy::max_blocks ? blocks : Policy::max_blocks),
                                    Policy::threads, 0, stream>>>(x, out, n, bf16);
  check(cudaGetLastError(), "to_16bit launch");
}

namespace detail {
// matmul's cuBLAS products (f32, f16, bf16 weights; quantized ones in f16 slices).
template <class Policy>
void cublas_product(const blas& h, const float* x, const matrix& w, float* y, std::size_t m, void* workspace,
                    cudaStream_t stream, accumulate acc) {
  const bool quantized = quant::kept_quantized(w.type);
  const int n = static_cast<int>(w.rows), k = static_cast<int>(w.cols), rows = static_cast<int>(m);
  const float alpha = 1.0f, beta = acc == accumulate::yes ? 1.0f : 0.0f;
  // Column-major view: y^T (n, m) = w (k, n)^T * x^T (k, m).
  if (w.type == dtype::f32) {
    check_blas(cublasGemmEx(h.get(), CUBLAS_OP_T, CUBLAS_OP_N, n, rows, k, &alpha, w.data, CUDA_R_32F, k, x,
                            CUDA_R_32F, k, &beta, y, CUDA_R_32F, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
               "cublasGemmEx (f32)");
    return;
  }
  const bool bf16 = w.type == dtype::bf16;  // (quantized weights go through f16)
  const std::size_t total = m * w.cols;
  to_16bit<Policy>(x, workspace, total, bf16, stream);
  if (quantized) {  // a slice of weight rows at a time, dequantized to f16 after the x rows
    auto* const slice = static_cast<std::byte*>(workspace) + total * 2;
    const std::size_t step = quant_slice_rows(w.rows, w.cols);
    for (std::size_t r0 = 0; r0 < w.rows; r0 += step) {
      const std::size_t count = std::min(step, w.rows - r0);
      quant_to_f16(w.type, w.data, w.cols, r0, count, slice, stream);
      check_blas(cublasGemmEx(h.get(), CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(count), rows, k, &alpha, slice,
                              CUDA_R_16F, k, workspace, CUDA_R_16F, k, &beta, y + r0, CUDA_R_32F, n,
                              CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                 "cublasGemmEx (quantized, f16 slices)");
    }
    return;
  }
  const cudaDataType_t type = bf16 ? CUDA_R_16BF : CUDA_R_16F;
  check_blas(cublasGemmEx(h.get(), CUBLAS_OP_T, CUBLAS_OP_N, n, rows, k, &alpha, w.data, type, k, workspace, type, k,
                          &beta, y, CUDA_R_32F, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
             bf16 ? "cublasGemmEx (bf16)" : "cublasGemmEx (f16)");
}
}  // namespace detail

// y (m, w.rows) = [y +] x (m, w.cols) * w^T [+ bias (w.rows), added to each row after the product], on
// the handle's stream; `workspace` holds at least matmul_workspace(w, m) bytes. Decode (up to
// policy::quant_matmul::decode_rows x rows, decodes_in_registers) runs quant_decode, for dense weights
// too; a few more rows of quantized weights run quant_tiles where multiplies_in_tiles; the rest
// cuBLAS. products::int8 changes the quantized decode product to integers against x rounded to 8 bits
// (quant_decode_int8; `rounded`, if given, is x rounded already for w's type's span, quantize_x8);
// prefill and the other types multiply as with products::exact. The decode products and the tiles
// add the bias as they store y (one launch fewer, the same bits); cuBLAS's are followed by add_bias.
template <class Policy = policy::convert>
void matmul(const blas& h, const float* x, const matrix& w, float* y, std::size_t m, void* workspace,
            cudaStream_t stream, accumulate acc = accumulate::no, products p = products::exact,
            const float* bias = nullptr, const quant::x8_rows* rounded = nullptr) {
  if (m == 0 || w.rows == 0) return;
  const bool quantized = quant::kept_quantized(w.type);
  if (w.type != dtype::f32 && w.type != dtype::f16 && w.type != dtype::bf16 && !quantized)
    throw error(errc::invalid_argument, "device::matmul: weights in " + std::string(to_string(w.type)) +
                                            " (f32, f16, bf16, q8_0, q4_0, q5_0, q5_1, q4_k, q5_k or q6_k on the device)");
  require(m <= 0x7FFFFFFFu && w.rows <= 0x7FFFFFFFu && w.cols <= 0x7FFFFFFFu, errc::invalid_argument,
          "device::matmul: a dimension above 2^31 - 1");
  if (decodes_in_registers(w, m)) {
    if (quantized && p == products::int8)
      quant_decode_int8(w.type, w.data, w.rows, w.cols, x, m, y, workspace, stream, acc, bias, rounded);
    else
      quant_decode(w.type, w.data, w.rows, w.cols, x, m, y, stream, acc, bias);
    return;
  }
  if constexpr (policy::quant_tiles::max_rows > 0) {  // (no kernels instantiated while matmul takes none)
    if (multiplies_in_tiles(w, m)) {
      quant_tiles(w.type, w.data, w.rows, w.cols, x, m, y, stream, acc, bias);
      return;
    }
  }
  detail::cublas_product<Policy>(h, x, w, y, m, workspace, stream, acc);
  if (bias != nullptr) add_bias(y, bias, m, w.rows, stream);
}

// One matrix of a product of several by the same x rows (matmul_parts): y = x w^T [+ bias].
struct product_part {
  const matrix* w = nullptr;
  float* y = nullptr;
  const float* bias = nullptr;
};

// Where parts of two types start that matmul_parts multiplies in one int8 launch (quant::int8_pair:
// the first parts of one type, the rest, one or more, of the other), else 0.
inline std::size_t pair_from(std::span<const product_part> parts) noexcept {
  std::size_t k = 1;
  while (k < parts.size() && parts[k].w->type == parts[0].w->type) ++k;
  if (k == parts.size()) return 0;
  for (std::size_t j = k; j < parts.size(); ++j)
    if (parts[j].w->type != parts[k].w->type) return 0;
  return quant::int8_pair(parts[0].w->type, parts[k].w->type) ? k : 0;
}

// Whether matmul_parts multiplies these matrices by m x rows in one launch: up to decode_parts::max of
// them, of one width, each decoded in registers, at one x row (a sequence's decode step), and of one
// type, or with int8 products of a pair of types (pair_from: a Q4_K_M layer's q4_k q and k and q6_k v).
inline bool one_launch(std::span<const product_part> parts, std::size_t m, products p = products::exact) noexcept {
  if (parts.empty() || parts.size() > static_cast<std::size_t>(decode_parts::max) || m != 1) return false;
  for (const product_part& part : parts)
    if (part.w->cols != parts[0].w->cols || !decodes_in_registers(*part.w, m)) return false;
  const bool one_type = std::all_of(parts.begin(), parts.end(),
                                    [&](const product_part& part) { return part.w->type == parts[0].w->type; });
  return one_type || (p == products::int8 && pair_from(parts) > 0);
}

// Each part's y = x w^T [+ bias] (m rows) in one decode launch, the bits matmul gives each (one_launch
// must hold: q, k and v of a layer, or its FFN's gate and up). `workspace` and `rounded` as matmul
// takes them for any one of the parts.
inline void matmul_parts(const float* x, std::span<const product_part> parts, std::size_t m, void* workspace,
                         cudaStream_t stream, products p = products::exact, const quant::x8_rows* rounded = nullptr) {
  require(one_launch(parts, m, p), errc::invalid_argument,
          "device::matmul_parts: up to three matrices of one width, decoded in registers, of one type (int8: or "
          "a pair of types)");
  decode_parts dp;
  for (const product_part& part : parts)
    dp.add(part.w->data, part.w->rows, part.y, part.bias, policy::quant_matmul::warps);
  const matrix& w = *parts[0].w;
  if (const std::size_t k = pair_from(parts); k > 0 && p == products::int8) {
    const dtype second = parts[k].w->type;
    dp.second = static_cast<int>(k);
    const quant::x8_rows xq = rounded != nullptr ? *rounded : quantize_x8(w.type, x, m, w.cols, workspace, stream);
    quant_decode_int8_pair(w.type, second, dp, w.cols, xq, stream);
    return;
  }
  if (quant::kept_quantized(w.type) && p == products::int8)
    quant_decode_int8_parts(w.type, dp, w.cols, x, m, workspace, stream, accumulate::no, rounded);
  else
    quant_decode_parts(w.type, dp, w.cols, x, m, stream);
}

}  // namespace efim::kernels::device
