#pragma once
// llama.cpp's quantization recipes for the GGUF files people download: Q4_K_M, Q5_K_M and Q6_K give
// most matrices one k-quant and some tensors more bits, as llama.cpp's quantizer (llama-quant.cpp,
// without an importance matrix) chooses them, so that efim-model writes, for the same f32 weights, the
// tensor types and bytes that llama.cpp's `quantize` writes:
//
// - the output matrix (the token embeddings where there is none) is q6_k, or q8_0 where its rows are
//   not a whole number of super-blocks;
// - Q4_K_M and Q5_K_M give q6_k to attn_v and ffn_down in the layers use_more_bits picks: the first
//   and last eighth of the layers and every third layer between;
// - every other matrix gets the mix's base type (q4_k, q5_k, q6_k);
// - a k-quant that does not fit a row (a width that is not a multiple of 256, such as Qwen2.5's 896)
//   falls back: q4_k to q5_0, q5_k to q5_1, q6_k to q8_0, and to f16 where even 32 does not divide.
//
// llama.cpp's recipes for mixture-of-experts models, fused QKV matrices and 70B models differ in
// ways these architectures do not reach; they are not reproduced.
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

#include "efim/core/dtype.hpp"
#include "efim/core/error.hpp"

namespace efim::model {

enum class quant_mix { q4_k_m, q5_k_m, q6_k };

inline constexpr quant_mix all_quant_mixes[] = {quant_mix::q4_k_m, quant_mix::q5_k_m, quant_mix::q6_k};

constexpr std::string_view to_string(quant_mix m) noexcept {
  switch (m) {
    case quant_mix::q4_k_m:
      return "q4_k_m";
    case quant_mix::q5_k_m:
      return "q5_k_m";
    case quant_mix::q6_k:
      return "q6_k";
  }
  return "?";
}

// The mix a name gives (q4_k_m, q5_k_m, q6_k), if it names one.
constexpr std::optional<quant_mix> parse_quant_mix(std::string_view name) noexcept {
  for (const quant_mix m : all_quant_mixes)
    if (to_string(m) == name) return m;
  return std::nullopt;
}

constexpr dtype base_type(quant_mix m) noexcept {
  return m == quant_mix::q4_k_m ? dtype::q4_k : m == quant_mix::q5_k_m ? dtype::q5_k : dtype::q6_k;
}

// Whether layer i of n gets more bits (llama.cpp's use_more_bits).
constexpr bool more_bits(std::size_t i, std::size_t n) noexcept {
  return i < n / 8 || i >= 7 * n / 8 || (i >= n / 8 && (i - n / 8) % 3 == 2);
}

// The type a mix gives the matrix `name` of `cols` columns in a model of `layers` layers;
// `has_output` says whether the model has an output matrix (else the token embeddings serve as it).
inline dtype mixed_type(quant_mix m, std::string_view name, std::size_t cols, std::size_t layers, bool has_output) {
  const dtype base = base_type(m);
  dtype t = base;
  const auto layer = [&] {  // N of "blk.N.", one of the model's layers
    std::size_t i = 0, at = 4;
    for (; name.starts_with("blk.") && at < name.size() && name[at] >= '0' && name[at] <= '9'; ++at)
      i = i * 10 + static_cast<std::size_t>(name[at] - '0');
    if (at == 4 || at >= name.size() || name[at] != '.' || i >= layers)
      throw error(errc::invalid_argument,
                  "quant_mix: '" + std::string(name) + "' names no layer of " + std::to_string(layers));
    return i;
  };
  if (name == "output.weight" || (!has_output && name == "token_embd.weight")) {
    t = cols % info(base).block != 0 ? dtype::q8_0 : dtype::q6_k;
  } else if (name.ends_with(".attn_v.weight") || name.ends_with(".ffn_down.weight")) {
    if (m != quant_mix::q6_k && more_bits(layer(), layers)) t = dtype::q6_k;
  }
  if (cols % info(t).block != 0) {
    t = t == dtype::q4_k ? dtype::q5_0 : t == dtype::q5_k ? dtype::q5_1 : t == dtype::q6_k ? dtype::q8_0 : t;
    if (cols % info(t).block != 0) t = dtype::f16;
  }
  return t;
}

}  // namespace efim::model
