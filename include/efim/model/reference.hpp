#pragma once
// The reference decoder: one sequence, every weight dequantized to f32, dense K/V, plain loops in the
// order of the definitions, no threads. Slow and obvious; the paged, batched transformer is tested
// against it, and the benchmarks time it as the baseline.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>
#include <vector>

#include "efim/core/dtype.hpp"
#include "efim/model/weights.hpp"

namespace efim::model {

class reference_model {
 public:
  // `kv` = f16 rounds K and V to f16 as a KV cache in f16 stores them.
  explicit reference_model(const weights& w, dtype kv = dtype::f32) : c_(w.cfg), kv_type_(kv) {
    validate(c_);
    require(kv == dtype::f32 || kv == dtype::f16, errc::invalid_argument, "reference: KV in f32 or f16");
    token_embd_ = dense(w.token_embd);
    for (const auto& lw : w.layers) {
      layer l;
      l.attn_norm = copy(lw.attn_norm), l.attn_norm_b = copy(lw.attn_norm_b);
      l.wq = dense(lw.wq), l.wk = dense(lw.wk), l.wv = dense(lw.wv), l.wo = dense(lw.wo);
      l.bq = copy(lw.bq), l.bk = copy(lw.bk), l.bv = copy(lw.bv), l.bo = copy(lw.bo);
      l.ffn_norm = copy(lw.ffn_norm), l.ffn_norm_b = copy(lw.ffn_norm_b);
      l.w_gate = dense(lw.w_gate), l.w_up = dense(lw.w_up), l.w_down = dense(lw.w_down);
      l.b_up = copy(lw.b_up), l.b_down = copy(lw.b_down);
      layers_.push_back(std::move(l));
      keys_.emplace_back();
      values_.emplace_back();
    }
    output_norm_ = copy(w.output_norm), output_norm_b_ = copy(w.output_norm_b);
    output_ = w.tied() ? token_embd_ : dense(w.output);
    output_b_ = copy(w.output_b);
  }

  // Positions computed so far.
  [[nodiscard]] std::size_t size() const noexcept { return keys_.empty() ? 0 : keys_[0].size() / c_.kv_dim(); }

  // Forgets the sequence.
  void reset() {
    for (auto& k : keys_) k.clear();
    for (auto& v : values_) v.clear();
  }

  // Appends `tokens` at the next positions; returns their logits (tokens.size(), vocab).
  std::vector<float> forward(std::span<const token_id> tokens) {
    const std::size_t n = tokens.size(), h = c_.hidden, hd = c_.head_dim(), start = size();
    const std::size_t group = c_.heads / c_.kv_heads;
    require(start + n <= c_.max_context, errc::too_long, "reference: past the context");
    std::vector<float> x(n * h);
    for (std::size_t t = 0; t < n; ++t) {
      require(tokens[t] >= 0 && static_cast<std::size_t>(tokens[t]) < c_.vocab, errc::unknown_token,
              "reference: token outside the vocabulary");
      std::copy_n(token_embd_.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(tokens[t]) * h), h,
                  x.begin() + static_cast<std::ptrdiff_t>(t * h));
    }
    for (std::size_t li = 0; li < layers_.size(); ++li) {
      const layer& l = layers_[li];
      const auto xn = norm(x, l.attn_norm, l.attn_norm_b);
      auto q = linear(xn, l.wq, l.bq, n, c_.q_dim(), h);
      auto k = linear(xn, l.wk, l.bk, n, c_.kv_dim(), h);
      auto v = linear(xn, l.wv, l.bv, n, c_.kv_dim(), h);
      rotate(q, c_.heads, start);
      rotate(k, c_.kv_heads, start);
      if (kv_type_ == dtype::f16) {
        for (auto& e : k) e = f16_to_f32(f32_to_f16(e));
        for (auto& e : v) e = f16_to_f32(f32_to_f16(e));
      }
      auto& keys = keys_[li];
      auto& values = values_[li];
      keys.insert(keys.end(), k.begin(), k.end());
      values.insert(values.end(), v.begin(), v.end());
      std::vector<float> att(n * c_.q_dim(), 0.0f);
      for (std::size_t t = 0; t < n; ++t)
        for (std::size_t hh = 0; hh < c_.heads; ++hh) {
          const std::size_t g = hh / group, visible = start + t + 1;
          std::vector<float> p(visible);
          float top = -INFINITY, sum = 0.0f;
          for (std::size_t j = 0; j < visible; ++j) {
            float s = 0.0f;
            for (std::size_t d = 0; d < hd; ++d)
              s += q[(t * c_.heads + hh) * hd + d] * keys[(j * c_.kv_heads + g) * hd + d];
            p[j] = s / std::sqrt(static_cast<float>(hd));
            top = std::max(top, p[j]);
          }
          for (auto& pj : p) sum += pj = std::exp(pj - top);
          for (std::size_t j = 0; j < visible; ++j)
            for (std::size_t d = 0; d < hd; ++d)
              att[(t * c_.heads + hh) * hd + d] += p[j] / sum * values[(j * c_.kv_heads + g) * hd + d];
        }
      const auto o = linear(att, l.wo, l.bo, n, h, c_.q_dim());
      for (std::size_t i = 0; i < x.size(); ++i) x[i] += o[i];

      const auto xf = norm(x, l.ffn_norm, l.ffn_norm_b);
      std::vector<float> mid;
      if (c_.mlp == mlp_kind::swiglu) {
        mid = linear(xf, l.w_gate, {}, n, c_.ffn, h);
        const auto up = linear(xf, l.w_up, l.b_up, n, c_.ffn, h);
        for (std::size_t i = 0; i < mid.size(); ++i) mid[i] = mid[i] / (1.0f + std::exp(-mid[i])) * up[i];
      } else {
        mid = linear(xf, l.w_up, l.b_up, n, c_.ffn, h);
        for (auto& e : mid) e = 0.5f * e * (1.0f + std::tanh(0.7978845608028654f * (e + 0.044715f * e * e * e)));
      }
      const auto down = linear(mid, l.w_down, l.b_down, n, h, c_.ffn);
      for (std::size_t i = 0; i < x.size(); ++i) x[i] += down[i];
    }
    return linear(norm(x, output_norm_, output_norm_b_), output_, output_b_, n, c_.vocab, h);
  }

 private:
  struct layer {
    std::vector<float> attn_norm, attn_norm_b, wq, wk, wv, wo, bq, bk, bv, bo;
    std::vector<float> ffn_norm, ffn_norm_b, w_gate, w_up, w_down, b_up, b_down;
  };

  static std::vector<float> dense(const matrix& m) {
    if (!m.data) return {};
    std::vector<float> out(m.rows * m.cols);
    const std::size_t bytes = row_bytes(m.type, m.cols);
    for (std::size_t r = 0; r < m.rows; ++r)
      dequantize_row(m.type, m.data + r * bytes, out.data() + r * m.cols, m.cols);
    return out;
  }
  static std::vector<float> copy(vector v) { return {v.begin(), v.end()}; }

  static std::vector<float> linear(const std::vector<float>& x, const std::vector<float>& m,
                                   const std::vector<float>& bias, std::size_t rows, std::size_t out, std::size_t in) {
    std::vector<float> y(rows * out, 0.0f);
    for (std::size_t r = 0; r < rows; ++r)
      for (std::size_t o = 0; o < out; ++o) {
        float s = 0.0f;
        for (std::size_t i = 0; i < in; ++i) s += x[r * in + i] * m[o * in + i];
        y[r * out + o] = bias.empty() ? s : s + bias[o];
      }
    return y;
  }

  std::vector<float> norm(const std::vector<float>& x, const std::vector<float>& g, const std::vector<float>& b) const {
    const std::size_t h = c_.hidden;
    std::vector<float> y(x.size());
    for (std::size_t r = 0; r < x.size() / h; ++r) {
      const float* xr = &x[r * h];
      float mean = 0.0f;
      if (c_.norm == norm_kind::layer) {
        for (std::size_t i = 0; i < h; ++i) mean += xr[i];
        mean /= static_cast<float>(h);
      }
      float ss = 0.0f;
      for (std::size_t i = 0; i < h; ++i) ss += (xr[i] - mean) * (xr[i] - mean);
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(h) + c_.norm_eps);
      for (std::size_t i = 0; i < h; ++i) y[r * h + i] = (xr[i] - mean) * inv * g[i] + (b.empty() ? 0.0f : b[i]);
    }
    return y;
  }

  void rotate(std::vector<float>& x, std::size_t heads, std::size_t start) const {
    const std::size_t hd = c_.head_dim(), n = x.size() / (heads * hd);
    const bool adjacent = c_.rope == kernels::rope_style::adjacent;
    for (std::size_t t = 0; t < n; ++t)
      for (std::size_t hh = 0; hh < heads; ++hh)
        for (std::size_t i = 0; i < hd / 2; ++i) {
          const double angle = static_cast<double>(start + t) / c_.rope_scale *
                               std::pow(c_.rope_theta, -2.0 * static_cast<double>(i) / static_cast<double>(hd));
          const auto cs = static_cast<float>(std::cos(angle)), sn = static_cast<float>(std::sin(angle));
          float* v = &x[(t * heads + hh) * hd];
          float& a = v[adjacent ? 2 * i : i];
          float& b = v[adjacent ? 2 * i + 1 : i + hd / 2];
          const float x0 = a, x1 = b;
          a = x0 * cs - x1 * sn;
          b = x0 * sn + x1 * cs;
        }
  }

  config c_;
  dtype kv_type_;
  std::vector<float> token_embd_, output_norm_, output_norm_b_, output_, output_b_;
  std::vector<layer> layers_;
  std::vector<std::vector<float>> keys_, values_;  // per layer (position, kv_heads, head_dim)
};

// Logits (tokens.size(), vocab) for every position of `tokens`, from position 0.
inline std::vector<float> reference_forward(const weights& w, std::span<const token_id> tokens, dtype kv = dtype::f32) {
  return reference_model(w, kv).forward(tokens);
}

}  // namespace efim::model
