#pragma once
// Hyper-parameters of a Llama-family decoder, and what each supported architecture computes.
#include <cmath>
#include <cstddef>
#include <string>
#include <string_view>

#include "efim/core/error.hpp"
#include "efim/kernels/common.hpp"

namespace efim::model {

// The architectures of GGUF's general.architecture that this decoder computes.
enum class architecture {
  llama,       // Llama, CodeLlama, DeepSeek-Coder: RMSNorm, SwiGLU, rotary pairs (2i, 2i+1)
  qwen2,       // Qwen2 / Qwen2.5-Coder: as llama with Q/K/V biases and rotary pairs (i, i + d/2)
  starcoder2,  // StarCoder2: LayerNorm with biases, GELU MLP, biases on every projection, pairs (i, i + d/2)
};

enum class norm_kind {
  rms,    // x / sqrt(mean(x^2) + eps) * w
  layer,  // (x - mean) / sqrt(var + eps) * w + b
};

enum class mlp_kind {
  swiglu,  // down(silu(gate(x)) * up(x))
  gelu,    // down(gelu(up(x))), GELU's tanh approximation
};

constexpr std::string_view to_string(architecture a) noexcept {
  switch (a) {
    case architecture::llama:
      return "llama";
    case architecture::qwen2:
      return "qwen2";
    case architecture::starcoder2:
      return "starcoder2";
  }
  return "?";
}

inline architecture parse_architecture(std::string_view name) {
  for (const auto a : {architecture::llama, architecture::qwen2, architecture::starcoder2})
    if (to_string(a) == name) return a;
  throw error(errc::invalid_argument,
              "model: architecture '" + std::string(name) + "' is not supported (llama, qwen2, starcoder2)");
}

struct config {
  architecture arch = architecture::llama;
  std::size_t vocab = 0;
  std::size_t hidden = 128;
  std::size_t layers = 4;
  std::size_t heads = 4;
  std::size_t kv_heads = 2;  // grouped-query attention: heads share KV heads in groups
  std::size_t ffn = 384;
  std::size_t max_context = 8192;
  std::size_t head_size = 0;  // 0: hidden / heads
  double rope_theta = 10000.0;
  double rope_scale = 1.0;  // linear RoPE scaling: positions are divided by this
  float norm_eps = 1e-5f;
  kernels::rope_style rope = kernels::rope_style::adjacent;
  norm_kind norm = norm_kind::rms;
  mlp_kind mlp = mlp_kind::swiglu;

  [[nodiscard]] constexpr std::size_t head_dim() const noexcept {
    return head_size != 0 ? head_size : heads == 0 ? 0 : hidden / heads;
  }
  [[nodiscard]] constexpr std::size_t q_dim() const noexcept { return heads * head_dim(); }
  [[nodiscard]] constexpr std::size_t kv_dim() const noexcept { return kv_heads * head_dim(); }
};

// A config with the computation `a` defines (norm, MLP, RoPE pairing) and the other fields defaulted.
inline config for_architecture(architecture a) {
  config c;
  c.arch = a;
  c.rope = a == architecture::llama ? kernels::rope_style::adjacent : kernels::rope_style::neox;
  c.norm = a == architecture::starcoder2 ? norm_kind::layer : norm_kind::rms;
  c.mlp = a == architecture::starcoder2 ? mlp_kind::gelu : mlp_kind::swiglu;
  return c;
}

inline void validate(const config& c) {
  require(
      c.vocab > 0 && c.hidden > 0 && c.layers > 0 && c.heads > 0 && c.kv_heads > 0 && c.ffn > 0 && c.max_context > 0,
      errc::invalid_argument, "model: every dimension of the config must be positive");
  // Bounds that keep every product of dimensions (q_dim, the KV layout, token ids) far from overflow.
  constexpr std::size_t most = std::size_t{1} << 24;
  require(c.vocab < (std::size_t{1} << 31) && c.hidden <= most && c.ffn <= most && c.layers <= (1u << 16) &&
              c.heads <= most && c.head_dim() <= most && c.heads * c.head_dim() <= most &&
              c.max_context < (std::size_t{1} << 31),
          errc::invalid_argument, "model: a dimension of the config is implausibly large");
  require(c.head_size != 0 || c.hidden % c.heads == 0, errc::invalid_argument,
          "model: hidden must be a multiple of heads");
  require(c.heads % c.kv_heads == 0, errc::invalid_argument, "model: heads must be a multiple of kv_heads");
  require(c.head_dim() > 0 && c.head_dim() % 2 == 0, errc::invalid_argument,
          "model: the head dimension must be even for RoPE");
  require(std::isfinite(c.rope_theta) && std::isfinite(c.rope_scale) && std::isfinite(c.norm_eps) &&
              c.rope_theta > 0.0 && c.rope_scale > 0.0 && c.norm_eps > 0.0f && c.rope_theta < 1e30 &&
              c.rope_scale < 1e30,
          errc::invalid_argument, "model: rope_theta, rope_scale and norm_eps must be finite and positive");
}

}  // namespace efim::model
