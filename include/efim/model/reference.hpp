#pragma once
// The reference decoder: one sequence, dense K/V, plain loops, no threads. Slow and obvious; the
// paged, batched transformer is tested against it.
#include <cmath>
#include <cstddef>
#include <span>
#include <vector>

#include "efim/model/weights.hpp"

namespace efim::model {

// Logits (tokens.size(), vocab) for every position of `tokens`.
inline std::vector<float> reference_forward(const weights& w, std::span<const token_id> tokens) {
  const config& c = w.cfg;
  validate(c);
  const std::size_t n = tokens.size(), h = c.hidden, hd = c.head_dim(), group = c.heads / c.kv_heads;
  const auto linear = [](const std::vector<float>& x, const std::vector<float>& m, std::size_t rows, std::size_t out,
                         std::size_t in) {
    std::vector<float> y(rows * out, 0.0f);
    for (std::size_t r = 0; r < rows; ++r)
      for (std::size_t o = 0; o < out; ++o) {
        float s = 0.0f;
        for (std::size_t i = 0; i < in; ++i) s += x[r * in + i] * m[o * in + i];
        y[r * out + o] = s;
      }
    return y;
  };
  const auto norm = [&](const std::vector<float>& x, const std::vector<float>& g) {
    std::vector<float> y(x.size());
    for (std::size_t r = 0; r < x.size() / h; ++r) {
      float ss = 0.0f;
      for (std::size_t i = 0; i < h; ++i) ss += x[r * h + i] * x[r * h + i];
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(h) + c.norm_eps);
      for (std::size_t i = 0; i < h; ++i) y[r * h + i] = x[r * h + i] * inv * g[i];
    }
    return y;
  };
  const auto rotate = [&](std::vector<float>& x, std::size_t heads) {
    for (std::size_t t = 0; t < n; ++t)
      for (std::size_t hh = 0; hh < heads; ++hh)
        for (std::size_t i = 0; i < hd / 2; ++i) {
          const double angle =
              static_cast<double>(t) * std::pow(c.rope_theta, -2.0 * static_cast<double>(i) / static_cast<double>(hd));
          const auto cs = static_cast<float>(std::cos(angle)), sn = static_cast<float>(std::sin(angle));
          const bool adjacent = c.rope == kernels::rope_style::adjacent;
          float* v = &x[(t * heads + hh) * hd];
          float& a = v[adjacent ? 2 * i : i];
          float& b = v[adjacent ? 2 * i + 1 : i + hd / 2];
          const float x0 = a, x1 = b;
          a = x0 * cs - x1 * sn;
          b = x0 * sn + x1 * cs;
        }
  };

  std::vector<float> x(n * h);
  for (std::size_t t = 0; t < n; ++t)
    for (std::size_t i = 0; i < h; ++i) x[t * h + i] = w.token_embd[static_cast<std::size_t>(tokens[t]) * h + i];

  for (const layer_weights& lw : w.layers) {
    const auto xn = norm(x, lw.attn_norm);
    auto q = linear(xn, lw.wq, n, c.q_dim(), h);
    auto k = linear(xn, lw.wk, n, c.kv_dim(), h);
    const auto v = linear(xn, lw.wv, n, c.kv_dim(), h);
    rotate(q, c.heads);
    rotate(k, c.kv_heads);
    std::vector<float> att(n * c.q_dim(), 0.0f);
    for (std::size_t t = 0; t < n; ++t)
      for (std::size_t hh = 0; hh < c.heads; ++hh) {
        const std::size_t g = hh / group;
        std::vector<float> p(t + 1);
        float top = -INFINITY, sum = 0.0f;
        for (std::size_t j = 0; j <= t; ++j) {
          float s = 0.0f;
          for (std::size_t d = 0; d < hd; ++d) s += q[(t * c.heads + hh) * hd + d] * k[(j * c.kv_heads + g) * hd + d];
          p[j] = s / std::sqrt(static_cast<float>(hd));
          top = std::max(top, p[j]);
        }
        for (auto& pj : p) sum += pj = std::exp(pj - top);
        for (std::size_t j = 0; j <= t; ++j)
          for (std::size_t d = 0; d < hd; ++d)
            att[(t * c.heads + hh) * hd + d] += p[j] / sum * v[(j * c.kv_heads + g) * hd + d];
      }
    const auto o = linear(att, lw.wo, n, h, c.q_dim());
    for (std::size_t i = 0; i < x.size(); ++i) x[i] += o[i];

    const auto xf = norm(x, lw.ffn_norm);
    auto gate = linear(xf, lw.w_gate, n, c.ffn, h);
    const auto up = linear(xf, lw.w_up, n, c.ffn, h);
    for (std::size_t i = 0; i < gate.size(); ++i) gate[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
    const auto down = linear(gate, lw.w_down, n, h, c.ffn);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] += down[i];
  }
  return linear(norm(x, w.output_norm), w.output, n, c.vocab, h);
}

}  // namespace efim::model
