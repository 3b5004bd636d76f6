#pragma once
// A model's weights in device memory, uploaded once from the host views (a mapped GGUF file):
// matrices stored as f32, f16 or bf16 go up as they are; block-quantized ones (q8_0, q4_0, q5_0,
// q5_1, the k-quants) are dequantized to f16 on the way (cuBLAS multiplies 16-bit types; each element
// rounded once more, to f16, a relative change of at most 2^-11); norm weights and biases go up as f32. A tied output matrix is the token
// embedding's device copy, uploaded once.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "efim/core/device.cuh"
#include "efim/core/dtype.hpp"
#include "efim/kernels/cuda/matmul.cuh"
#include "efim/model/weights.hpp"

namespace efim::model {

struct device_layer_weights {
  const float *attn_norm = nullptr, *attn_norm_b = nullptr;
  kernels::device::matrix wq, wk, wv;
  const float *bq = nullptr, *bk = nullptr, *bv = nullptr;
  kernels::device::matrix wo;
  const float* bo = nullptr;
  const float *ffn_norm = nullptr, *ffn_norm_b = nullptr;
  kernels::device::matrix w_gate, w_up;
  const float* b_up = nullptr;
  kernels::device::matrix w_down;
  const float* b_down = nullptr;
};

class device_weights {
 public:
  explicit device_weights(const weights& w) : cfg(w.cfg) {
    token_embd = upload(w.token_embd);
    output = w.tied() ? token_embd : upload(w.output);
    output_norm = upload(w.output_norm);
    output_norm_b = upload(w.output_norm_b);
    output_b = upload(w.output_b);
    for (const layer_weights& lw : w.layers) {
      device_layer_weights d;
      d.attn_norm = upload(lw.attn_norm);
      d.attn_norm_b = upload(lw.attn_norm_b);
      d.wq = upload(lw.wq);
      d.wk = upload(lw.wk);
      d.wv = upload(lw.wv);
      d.bq = upload(lw.bq);
      d.bk = upload(lw.bk);
      d.bv = upload(lw.bv);
      d.wo = upload(lw.wo);
      d.bo = upload(lw.bo);
      d.ffn_norm = upload(lw.ffn_norm);
      d.ffn_norm_b = upload(lw.ffn_norm_b);
      d.w_gate = upload(lw.w_gate);
      d.w_up = upload(lw.w_up);
      d.b_up = upload(lw.b_up);
      d.w_down = upload(lw.w_down);
      d.b_down = upload(lw.b_down);
      layers.push_back(d);
    }
    device::check(cudaDeviceSynchronize(), "weights upload");
  }

  // Device memory the weights hold.
  [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }

  config cfg;
  kernels::device::matrix token_embd, output;  // (vocab, hidden)
  std::vector<device_layer_weights> layers;
  const float *output_norm = nullptr, *output_norm_b = nullptr, *output_b = nullptr;

 private:
  const float* upload(vector v) {
    if (v.empty()) return nullptr;
    auto& b = owned_.emplace_back(v.size() * sizeof(float));
    device::check(cudaMemcpy(b.data(), v.data(), v.size() * sizeof(float), cudaMemcpyHostToDevice), "cudaMemcpy");
    bytes_ += b.size();
    return reinterpret_cast<const float*>(b.data());
  }

  kernels::device::matrix upload(const matrix& m) {
    if (m.data == nullptr) return {};
    const bool as_stored = m.type == dtype::f32 || m.type == dtype::f16 || m.type == dtype::bf16;
    const dtype type = as_stored ? m.type : dtype::f16;
    const std::size_t row = m.cols * info(type).bytes;
    auto& b = owned_.emplace_back(m.rows * row);
    bytes_ += b.size();
    if (as_stored) {
      device::check(cudaMemcpy(b.data(), m.data, m.rows * row, cudaMemcpyHostToDevice), "cudaMemcpy");
    } else {  // dequantized to f16, some rows at a time
      const std::size_t stored_row = row_bytes(m.type, m.cols);
      const std::size_t step = std::max<std::size_t>(1, (std::size_t{16} << 20) / row);
      std::vector<float> f32(m.cols);
      std::vector<std::uint16_t> staged(step * m.cols);
      for (std::size_t r0 = 0; r0 < m.rows; r0 += step) {
        const std::size_t rows = std::min(step, m.rows - r0);
        for (std::size_t r = 0; r < rows; ++r) {
          dequantize_row(m.type, m.data + (r0 + r) * stored_row, f32.data(), m.cols);
          for (std::size_t j = 0; j < m.cols; ++j) staged[r * m.cols + j] = f32_to_f16(f32[j]);
        }
        device::check(cudaMemcpy(b.data() + r0 * row, staged.data(), rows * row, cudaMemcpyHostToDevice), "cudaMemcpy");
      }
    }
    return {type, m.rows, m.cols, b.data()};
  }

  std::vector<device::buffer<std::byte>> owned_;
  std::size_t bytes_ = 0;
};

}  // namespace efim::model
