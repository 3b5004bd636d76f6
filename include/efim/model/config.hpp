#pragma once
// Hyper-parameters of a Llama-architecture decoder.
#include <cstddef>
#include <string>

#include "efim/core/error.hpp"
#include "efim/kernels/rope.hpp"

namespace efim::model {

struct config {
  std::string architecture = "llama";
  std::size_t vocab = 0;
  std::size_t hidden = 128;
  std::size_t layers = 4;
  std::size_t heads = 4;
  std::size_t kv_heads = 2;  // grouped-query attention: heads share KV heads in groups
  std::size_t ffn = 384;
  std::size_t max_context = 8192;
  double rope_theta = 10000.0;
  float norm_eps = 1e-5f;
  kernels::rope_style rope = kernels::rope_style::adjacent;

  [[nodiscard]] constexpr std::size_t head_dim() const noexcept { return heads == 0 ? 0 : hidden / heads; }
  [[nodiscard]] constexpr std::size_t q_dim() const noexcept { return heads * head_dim(); }
  [[nodiscard]] constexpr std::size_t kv_dim() const noexcept { return kv_heads * head_dim(); }
};

inline void validate(const config& c) {
  require(
      c.vocab > 0 && c.hidden > 0 && c.layers > 0 && c.heads > 0 && c.kv_heads > 0 && c.ffn > 0 && c.max_context > 0,
      errc::invalid_argument, "model: every dimension of the config must be positive");
  require(c.hidden % c.heads == 0, errc::invalid_argument, "model: hidden must be a multiple of heads");
  require(c.heads % c.kv_heads == 0, errc::invalid_argument, "model: heads must be a multiple of kv_heads");
  require(c.head_dim() % 2 == 0, errc::invalid_argument, "model: the head dimension must be even for RoPE");
  require(c.rope_theta > 0.0 && c.norm_eps > 0.0f, errc::invalid_argument,
          "model: rope_theta and norm_eps must be positive");
}

}  // namespace efim::model
