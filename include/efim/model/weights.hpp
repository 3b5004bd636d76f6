#pragma once
// Weights of a Llama-architecture decoder in f32, and random weights from a seed.
#include <bit>
#include <cmath>
#include <cstdint>
#include <vector>

#include "efim/cache/xxhash.hpp"
#include "efim/core/random.hpp"
#include "efim/model/config.hpp"

namespace efim::model {

struct layer_weights {
  std::vector<float> attn_norm;     // (hidden)
  std::vector<float> wq;            // (heads * head_dim, hidden)
  std::vector<float> wk, wv;        // (kv_heads * head_dim, hidden)
  std::vector<float> wo;            // (hidden, heads * head_dim)
  std::vector<float> ffn_norm;      // (hidden)
  std::vector<float> w_gate, w_up;  // (ffn, hidden)
  std::vector<float> w_down;        // (hidden, ffn)
};

struct weights {
  config cfg;
  std::vector<float> token_embd;  // (vocab, hidden)
  std::vector<layer_weights> layers;
  std::vector<float> output_norm;  // (hidden)
  std::vector<float> output;       // (vocab, hidden)
  std::uint64_t fingerprint = 0;   // identifies these weights in cache keys
};

namespace detail {
inline std::vector<float> normal(rng& r, std::size_t n, double stddev) {
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(r.normal() * stddev);
  return v;
}
inline std::vector<float> near_one(rng& r, std::size_t n) {
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(1.0 + 0.1 * r.normal());
  return v;
}
}  // namespace detail

// Weights drawn from a seed: each projection scaled by 1/sqrt(fan-in), and the residual branches
// by 1/sqrt(2 * layers), so activations stay O(1) and logits are neither flat nor one-hot.
inline weights random_weights(const config& c, std::uint64_t seed) {
  validate(c);
  rng r(seed);
  const auto h = c.hidden;
  const double in_scale = 1.0 / std::sqrt(static_cast<double>(h));
  const double branch = 1.0 / std::sqrt(2.0 * static_cast<double>(c.layers));
  weights w;
  w.cfg = c;
  w.token_embd = detail::normal(r, c.vocab * h, 1.0);
  for (std::size_t l = 0; l < c.layers; ++l) {
    layer_weights lw;
    lw.attn_norm = detail::near_one(r, h);
    lw.wq = detail::normal(r, c.q_dim() * h, in_scale);
    lw.wk = detail::normal(r, c.kv_dim() * h, in_scale);
    lw.wv = detail::normal(r, c.kv_dim() * h, in_scale);
    lw.wo = detail::normal(r, h * c.q_dim(), branch / std::sqrt(static_cast<double>(c.q_dim())));
    lw.ffn_norm = detail::near_one(r, h);
    lw.w_gate = detail::normal(r, c.ffn * h, in_scale);
    lw.w_up = detail::normal(r, c.ffn * h, in_scale);
    lw.w_down = detail::normal(r, h * c.ffn, branch / std::sqrt(static_cast<double>(c.ffn)));
    w.layers.push_back(std::move(lw));
  }
  w.output_norm = detail::near_one(r, h);
  w.output = detail::normal(r, c.vocab * h, 2.0 * in_scale);

  const std::uint64_t shape[] = {c.vocab,
                                 c.hidden,
                                 c.layers,
                                 c.heads,
                                 c.kv_heads,
                                 c.ffn,
                                 c.max_context,
                                 static_cast<std::uint64_t>(c.rope),
                                 std::bit_cast<std::uint64_t>(c.rope_theta),
                                 std::bit_cast<std::uint32_t>(c.norm_eps),
                                 seed};
  w.fingerprint = XXH3_64bits(shape, sizeof shape);
  return w;
}

}  // namespace efim::model
