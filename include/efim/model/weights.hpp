#pragma once
// The weights of a Llama-family decoder, viewed in place: matrices stay in the bytes of their GGUF file
// (memory-mapped, or a buffer), in the type they are stored in; norm weights and biases are f32.
//
// `bind` checks every tensor a config implies (name, shape, type) against a GGUF tensor directory and
// builds the views; `gguf_model.hpp` opens files, reads configs and writes models.
#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "efim/core/dtype.hpp"
#include "efim/core/error.hpp"
#include "efim/core/gguf.hpp"
#include "efim/kernels/common.hpp"
#include "efim/model/config.hpp"

namespace efim::model {

using matrix = kernels::weight_view;    // (rows = output features, cols = inputs), rows contiguous
using vector = std::span<const float>;  // empty where the model has no such tensor

struct layer_weights {
  vector attn_norm, attn_norm_b;  // (hidden)
  matrix wq, wk, wv;              // (q_dim, hidden), (kv_dim, hidden), (kv_dim, hidden)
  vector bq, bk, bv;              // (q_dim), (kv_dim), (kv_dim)
  matrix wo;                      // (hidden, q_dim)
  vector bo;                      // (hidden)
  vector ffn_norm, ffn_norm_b;    // (hidden)
  matrix w_gate;                  // (ffn, hidden); swiglu only
  matrix w_up;                    // (ffn, hidden)
  vector b_up;                    // (ffn)
  matrix w_down;                  // (hidden, ffn)
  vector b_down;                  // (hidden)
};

// A layer's matrices in the order a decode step multiplies by them (q, k, v, o, gate, up, down): of any
// layer type with these members (the host's, the CUDA backend's), const or not.
template <class Layer>
constexpr auto layer_matrices(Layer& l) noexcept {
  return std::array{&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down};
}

struct weights {
  config cfg;
  matrix token_embd;  // (vocab, hidden)
  std::vector<layer_weights> layers;
  vector output_norm, output_norm_b;    // (hidden)
  matrix output;                        // (vocab, hidden): the same bytes as token_embd when tied
  vector output_b;                      // (vocab)
  std::uint64_t fingerprint = 0;        // identifies these weights in cache keys
  std::shared_ptr<const void> storage;  // keeps what the views point into alive

  [[nodiscard]] bool tied() const noexcept { return output.data == token_embd.data; }
  // The type most of the matrices are stored in.
  [[nodiscard]] dtype type() const noexcept { return layers.empty() ? token_embd.type : layers.front().w_up.type; }
};

// The matrices a decode step multiplies by, in that order: each layer's, then the output matrix (the
// token embedding is looked up a row a token, not multiplied, unless it is the output matrix too). Of
// any weights type with `layers` and `output` (the host's, the CUDA backend's), const or not; a
// matrix a model does not have (w_gate without swiglu) is there with no data.
template <class Weights>
auto decode_matrices(Weights& w) {
  std::vector<decltype(&w.output)> all;
  all.reserve(w.layers.size() * 7 + 1);
  for (auto& l : w.layers)
    for (auto* m : layer_matrices(l)) all.push_back(m);
  all.push_back(&w.output);
  return all;
}

// What the CUDA backend keeps in device memory for weights (model/device_weights.cuh; host code, so the
// plan is checked without a GPU): every matrix as the file stores it (its products read f32, f16, bf16
// and every block-quantized type as stored: kernels::quant::kept_quantized), norm weights and biases
// as f32, a tied output matrix once.
inline std::size_t device_matrix_bytes(const matrix& m) {
  return m.data == nullptr ? 0 : m.rows * row_bytes(m.type, m.cols);
}
inline std::size_t device_weight_bytes(const weights& w) {
  std::size_t bytes = device_matrix_bytes(w.token_embd) + (w.tied() ? 0 : device_matrix_bytes(w.output));
  const auto floats = [&](vector v) { bytes += v.size() * sizeof(float); };
  floats(w.output_norm);
  floats(w.output_norm_b);
  floats(w.output_b);
  for (const layer_weights& l : w.layers) {
    for (const matrix* m : layer_matrices(l)) bytes += device_matrix_bytes(*m);
    for (const vector v : {l.attn_norm, l.attn_norm_b, l.bq, l.bk, l.bv, l.bo, l.ffn_norm, l.ffn_norm_b, l.b_up, l.b_down})
      floats(v);
  }
  return bytes;
}

// GGUF tensor names.
namespace names {
inline std::string block(std::size_t layer, std::string_view what) {
  return "blk." + std::to_string(layer) + "." + std::string(what);
}
}  // namespace names

namespace detail {

// What a GGUF tensor directory and its data section offer to bind.
class tensor_table {
 public:
  tensor_table(const gguf::file& f, std::span<const std::byte> bytes) : file_(f), bytes_(bytes) {
    for (std::size_t i = 0; i < f.tensors.size(); ++i) by_name_.emplace(f.tensors[i].name, i);
  }

  [[nodiscard]] const gguf::tensor_info* find(const std::string& name) const {
    const auto it = by_name_.find(name);
    return it == by_name_.end() ? nullptr : &file_.tensors[it->second];
  }

  // A matrix (rows, cols); required, or absent (empty) when `optional`.
  matrix get_matrix(const std::string& name, std::size_t rows, std::size_t cols, bool optional = false) {
    const gguf::tensor_info* t = take(name, optional);
    if (!t) return {};
    require(t->shape.size() == 2 && t->shape[0] == cols && t->shape[1] == rows, errc::invalid_argument,
            "model: tensor '" + name + "' has shape " + shape_text(t->shape) + ", expected [" + std::to_string(cols) +
                ", " + std::to_string(rows) + "]");
    return {type_of(*t), rows, cols, data_of(*t)};
  }

  // A vector of n floats (stored as f32, f16 or bf16; converted to f32 if need be).
  vector get_vector(const std::string& name, std::size_t n, bool optional = false) {
    const gguf::tensor_info* t = take(name, optional);
    if (!t) return {};
    require(
        t->shape.size() == 1 && t->shape[0] == n, errc::invalid_argument,
        "model: tensor '" + name + "' has shape " + shape_text(t->shape) + ", expected [" + std::to_string(n) + "]");
    const dtype type = type_of(*t);
    require(type == dtype::f32 || type == dtype::f16 || type == dtype::bf16, errc::invalid_argument,
            "model: vector tensor '" + name + "' is " + std::string(to_string(type)) + "; f32, f16 or bf16 expected");
    if (type == dtype::f32 && reinterpret_cast<std::uintptr_t>(data_of(*t)) % alignof(float) == 0)
      return {reinterpret_cast<const float*>(data_of(*t)), n};
    auto& owned = converted_.emplace_back(n);
    dequantize_row(type, data_of(*t), owned.data(), n);
    return owned;
  }

  // Every tensor of the file must have been bound: one this decoder does not know would be ignored.
  void require_all_used(std::string_view arch) const {
    for (const auto& t : file_.tensors)
      require(
          used_.contains(t.name), errc::invalid_argument,
          "model: tensor '" + t.name + "' is not part of the " + std::string(arch) + " architecture as computed here");
  }

  std::vector<std::vector<float>> take_converted() { return std::move(converted_); }

 private:
  static std::string shape_text(const std::vector<std::uint64_t>& s) {
    std::string out = "[";
    for (std::size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
    return out + "]";
  }

  static dtype type_of(const gguf::tensor_info& t) {
    const auto type = dtype_of_ggml(t.type);
    require(type.has_value(), errc::invalid_argument,
            "model: tensor '" + t.name + "' has ggml type " + std::to_string(t.type) +
                ", which is not supported (f32, f16, bf16, q8_0, q4_0, q5_0, q5_1, q4_k, q5_k, q6_k)");
    return *type;
  }

  const std::byte* data_of(const gguf::tensor_info& t) const {
    return bytes_.data() + static_cast<std::ptrdiff_t>(file_.data_offset + t.offset);
  }

  // The tensor `name`, marked as bound; null if it is absent and `optional`.
  const gguf::tensor_info* take(const std::string& name, bool optional) {
    const gguf::tensor_info* t = find(name);
    require(t || optional, errc::invalid_argument, "model: tensor '" + name + "' is missing");
    if (t) used_.insert(name);
    return t;
  }

  const gguf::file& file_;
  std::span<const std::byte> bytes_;
  std::unordered_map<std::string, std::size_t> by_name_;
  std::unordered_set<std::string> used_;
  std::vector<std::vector<float>> converted_;
};

// Rows [first, first + n) of a matrix, in place.
inline matrix rows_of(const matrix& m, std::size_t first, std::size_t n) {
  return {m.type, n, m.cols, m.data + first * row_bytes(m.type, m.cols)};
}

}  // namespace detail

// Views of the tensors of a GGUF file (`f`, parsed from `bytes`) for the decoder `c` describes. Every
// tensor is checked for its name, shape and type; biases are optional, Q/K/V may be one fused
// matrix, and a missing output matrix means it is tied to the token embeddings. `storage` must own
// `bytes`; the weights keep it alive.
inline weights bind(const config& c, const gguf::file& f, std::span<const std::byte> bytes,
                    std::shared_ptr<const void> storage, std::uint64_t fingerprint) {
  validate(c);
  detail::tensor_table t(f, bytes);
  const std::size_t h = c.hidden, q = c.q_dim(), kv = c.kv_dim();
  const bool layer_norm = c.norm == norm_kind::layer;
  weights w;
  w.cfg = c;
  w.fingerprint = fingerprint;
  w.token_embd = t.get_matrix("token_embd.weight", c.vocab, h);
  for (std::size_t l = 0; l < c.layers; ++l) {
    const auto name = [l](std::string_view what) { return names::block(l, what); };
    layer_weights lw;
    lw.attn_norm = t.get_vector(name("attn_norm.weight"), h);
    if (layer_norm) lw.attn_norm_b = t.get_vector(name("attn_norm.bias"), h);
    if (t.find(name("attn_qkv.weight"))) {
      const matrix qkv = t.get_matrix(name("attn_qkv.weight"), q + 2 * kv, h);
      lw.wq = detail::rows_of(qkv, 0, q);
      lw.wk = detail::rows_of(qkv, q, kv);
      lw.wv = detail::rows_of(qkv, q + kv, kv);
      if (const vector b = t.get_vector(name("attn_qkv.bias"), q + 2 * kv, true); !b.empty()) {
        lw.bq = b.subspan(0, q);
        lw.bk = b.subspan(q, kv);
        lw.bv = b.subspan(q + kv, kv);
      }
    } else {
      lw.wq = t.get_matrix(name("attn_q.weight"), q, h);
      lw.wk = t.get_matrix(name("attn_k.weight"), kv, h);
      lw.wv = t.get_matrix(name("attn_v.weight"), kv, h);
    }
    if (lw.bq.empty()) {
      lw.bq = t.get_vector(name("attn_q.bias"), q, true);
      lw.bk = t.get_vector(name("attn_k.bias"), kv, true);
      lw.bv = t.get_vector(name("attn_v.bias"), kv, true);
    }
    lw.wo = t.get_matrix(name("attn_output.weight"), h, q);
    lw.bo = t.get_vector(name("attn_output.bias"), h, true);
    lw.ffn_norm = t.get_vector(name("ffn_norm.weight"), h);
    if (layer_norm) lw.ffn_norm_b = t.get_vector(name("ffn_norm.bias"), h);
    if (c.mlp == mlp_kind::swiglu) lw.w_gate = t.get_matrix(name("ffn_gate.weight"), c.ffn, h);
    lw.w_up = t.get_matrix(name("ffn_up.weight"), c.ffn, h);
    lw.b_up = t.get_vector(name("ffn_up.bias"), c.ffn, true);
    lw.w_down = t.get_matrix(name("ffn_down.weight"), h, c.ffn);
    lw.b_down = t.get_vector(name("ffn_down.bias"), h, true);
    w.layers.push_back(lw);
  }
  w.output_norm = t.get_vector("output_norm.weight", h);
  if (layer_norm) w.output_norm_b = t.get_vector("output_norm.bias", h);
  w.output = t.get_matrix("output.weight", c.vocab, h, true);
  if (!w.output.data) w.output = w.token_embd;
  w.output_b = t.get_vector("output.bias", c.vocab, true);
  t.require_all_used(to_string(c.arch));

  auto converted = t.take_converted();
  if (converted.empty()) {
    w.storage = std::move(storage);
  } else {  // keep both the file and the converted vectors
    struct both {
      std::shared_ptr<const void> file;
      std::vector<std::vector<float>> vectors;
    };
    w.storage = std::make_shared<const both>(both{std::move(storage), std::move(converted)});
  }
  return w;
}

}  // namespace efim::model
