#pragma once
// A model's weights in device memory, uploaded once from the host views (a mapped GGUF file), every
// matrix as the file stores it: f32, f16, bf16, and the block-quantized types, which the device's
// products read as stored (kernels/cuda/quant_groups.hpp), so a quantized model takes about its file's
// size on the GPU. Norm weights and biases go up as f32. A tied output matrix is the token
// embedding's device copy, uploaded once. device_weight_bytes (model/weights.hpp, host code) is what
// they take.
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

  // Device memory the weights hold (device_weight_bytes of the host weights).
  [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }

  // Workspace bytes a product of m x rows with any of these matrices needs (kernels::device::matmul).
  [[nodiscard]] std::size_t workspace(std::size_t m) const noexcept {
    std::size_t most = kernels::device::matmul_workspace(output, m);
    for (const device_layer_weights& l : layers)
      for (const kernels::device::matrix* w : layer_matrices(l))
        most = std::max(most, kernels::device::matmul_workspace(*w, m));
    return most;
  }

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
    const std::size_t bytes = device_matrix_bytes(m);
    auto& b = owned_.emplace_back(bytes);
    bytes_ += b.size();
    device::check(cudaMemcpy(b.data(), m.data, bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
    return {m.type, m.rows, m.cols, b.data()};
  }

  std::vector<device::buffer<std::byte>> owned_;
  std::size_t bytes_ = 0;
};

}  // namespace efim::model
