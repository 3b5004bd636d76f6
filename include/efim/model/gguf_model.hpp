#pragma once
// Model files: a decoder's config from GGUF metadata, its weights bound in place to a memory-mapped
// file (or a buffer), and GGUF files written from a config, tensors and tokenizer metadata, including
// random-weight models made from a seed.
//
// Metadata keys and tensor names are llama.cpp's, so files made here load there and files its tools
// write load here.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "efim/cache/xxhash.hpp"
#include "efim/core/dtype.hpp"
#include "efim/core/error.hpp"
#include "efim/core/gguf.hpp"
#include "efim/core/random.hpp"
#include "efim/core/thread_pool.hpp"
#include "efim/model/config.hpp"
#include "efim/model/quant_mix.hpp"
#include "efim/model/weights.hpp"

namespace efim::model {

using metadata = std::map<std::string, gguf::value, std::less<>>;

namespace detail {

inline const gguf::value* find_key(const gguf::file& f, std::string_view arch, std::string_view key) {
  return f.find(std::string(arch) + "." + std::string(key));
}

// A numeric metadata value of any integer or float type.
inline double number(const gguf::file& f, std::string_view arch, std::string_view key, std::optional<double> fallback) {
  const std::string full = std::string(arch) + "." + std::string(key);
  const gguf::value* v = f.find(full);
  if (!v) {
    require(fallback.has_value(), errc::invalid_argument, "model: no metadata key '" + full + "'");
    return *fallback;
  }
  if (const auto* u = std::get_if<std::uint64_t>(&v->v)) return static_cast<double>(*u);
  if (const auto* i = std::get_if<std::int64_t>(&v->v)) return static_cast<double>(*i);
  if (const auto* d = std::get_if<double>(&v->v)) return *d;
  if (const auto* a = std::get_if<gguf::array_value>(&v->v)) {
    // Per-layer values (some files list head counts per layer): all must be equal here.
    std::vector<double> items;
    std::visit(
        [&](const auto& xs) {
          using X = std::decay_t<decltype(xs)>;
          if constexpr (std::is_same_v<X, std::vector<std::uint64_t>> || std::is_same_v<X, std::vector<std::int64_t>> ||
                        std::is_same_v<X, std::vector<double>>)
            for (const auto x : xs) items.push_back(static_cast<double>(x));
        },
        a->items);
    require(!items.empty() && std::all_of(items.begin(), items.end(), [&](double x) { return x == items[0]; }),
            errc::invalid_argument, "model: metadata '" + full + "' differs between layers, which is not supported");
    return items[0];
  }
  throw error(errc::invalid_argument, "model: metadata '" + full + "' is not a number");
}

inline std::size_t count(const gguf::file& f, std::string_view arch, std::string_view key,
                         std::optional<double> fallback = std::nullopt) {
  const double v = number(f, arch, key, fallback);
  require(v >= 0 && v <= 4294967295.0 && v == std::floor(v), errc::invalid_argument,
          "model: metadata '" + std::string(arch) + "." + std::string(key) + "' is not a count");
  return static_cast<std::size_t>(v);
}

}  // namespace detail

// The decoder a GGUF file describes (general.architecture and its keys); the vocabulary size is the
// row count of token_embd.weight.
inline config read_config(const gguf::file& f) {
  const std::string arch_name(f.string("general.architecture"));
  const architecture a = parse_architecture(arch_name);
  const std::string_view n = arch_name;
  config c = for_architecture(a);
  c.hidden = detail::count(f, n, "embedding_length");
  c.layers = detail::count(f, n, "block_count");
  c.ffn = detail::count(f, n, "feed_forward_length");
  c.heads = detail::count(f, n, "attention.head_count");
  c.kv_heads = detail::count(f, n, "attention.head_count_kv", static_cast<double>(c.heads));
  c.max_context = detail::count(f, n, "context_length");
  require(detail::count(f, n, "expert_count", 0.0) == 0, errc::invalid_argument,
          "model: mixture-of-experts models are not supported");
  if (c.heads > 0) {
    const std::size_t key = detail::count(f, n, "attention.key_length", static_cast<double>(c.hidden / c.heads));
    const std::size_t value = detail::count(f, n, "attention.value_length", static_cast<double>(key));
    require(key == value, errc::invalid_argument, "model: key and value head sizes differ, which is not supported");
    if (key != c.hidden / c.heads || c.hidden % c.heads != 0) c.head_size = key;
    const std::size_t rotary = detail::count(f, n, "rope.dimension_count", static_cast<double>(key));
    require(rotary == key, errc::invalid_argument,
            "model: RoPE over " + std::to_string(rotary) + " of " + std::to_string(key) +
                " head dimensions (partial rotary) is not supported");
  }
  c.rope_theta = detail::number(f, n, "rope.freq_base", 10000.0);
  // As llama.cpp reads it: a scaling factor without a type is linear; the older key says the same.
  std::string scaling = "linear";
  if (const gguf::value* type = detail::find_key(f, n, "rope.scaling.type")) {
    const auto* s = std::get_if<std::string>(&type->v);
    require(s && (*s == "none" || *s == "linear"), errc::invalid_argument,
            "model: RoPE scaling '" + (s ? *s : std::string("?")) + "' is not supported (none, linear)");
    scaling = *s;
  }
  if (scaling == "linear")
    c.rope_scale = detail::number(f, n, "rope.scaling.factor", detail::number(f, n, "rope.scale_linear", 1.0));
  if (c.rope_scale == 0.0) c.rope_scale = 1.0;  // llama.cpp reads a factor of 0 as none
  c.norm_eps = static_cast<float>(detail::number(
      f, n, c.norm == norm_kind::rms ? "attention.layer_norm_rms_epsilon" : "attention.layer_norm_epsilon", 1e-5));
  for (const auto& t : f.tensors)
    if (t.name == "token_embd.weight" && t.shape.size() == 2) c.vocab = static_cast<std::size_t>(t.shape[1]);
  require(c.vocab > 0, errc::invalid_argument, "model: no 2-D tensor 'token_embd.weight'");
  validate(c);
  return c;
}

// A GGUF model held in memory or mapped from a file: its directory and the bytes the views point into.
struct model_file {
  gguf::file meta;
  std::shared_ptr<const void> storage;
  std::span<const std::byte> bytes;
  std::uint64_t fingerprint = 0;  // XXH3 of every byte: identical files share cached KV, others never

  [[nodiscard]] config cfg() const { return read_config(meta); }
  // The weights for `c` (by default the file's own config), viewing this file's bytes.
  [[nodiscard]] weights bind(const config& c) const { return model::bind(c, meta, bytes, storage, fingerprint); }
  [[nodiscard]] weights bind() const { return bind(cfg()); }
};

// Parses bytes the caller hands over (a model made in memory).
inline model_file open_model(std::vector<std::byte> bytes) {
  auto owned = std::make_shared<const std::vector<std::byte>>(std::move(bytes));
  model_file m;
  m.meta = gguf::parse(*owned);
  m.bytes = *owned;
  m.fingerprint = XXH3_64bits(m.bytes.data(), m.bytes.size());
  m.storage = std::move(owned);
  return m;
}

// Opens a GGUF file, its bytes mapped or read into memory as `how` says (gguf::residency); tensors
// are read in place when they are used.
inline model_file open_model(const std::string& path, gguf::residency how = gguf::residency::map) {
  auto mapped = std::make_shared<const gguf::file_bytes>(path, how);
  model_file m;
  try {
    m.meta = gguf::parse(mapped->bytes());
  } catch (const error& e) {
    throw error(e.code(), std::string(e.what()) + " ('" + path + "')");
  }
  m.bytes = mapped->bytes();
  m.fingerprint = XXH3_64bits(m.bytes.data(), m.bytes.size());
  m.storage = std::move(mapped);
  return m;
}

// ---- writing -----------------------------------------------------------------------------------

// The architecture keys llama.cpp reads for `c`.
inline metadata config_metadata(const config& c) {
  validate(c);
  const config fixed = for_architecture(c.arch);
  require(c.rope == fixed.rope && c.norm == fixed.norm && c.mlp == fixed.mlp, errc::invalid_argument,
          "model: the " + std::string(to_string(c.arch)) +
              " architecture fixes its norm, MLP and RoPE pairing; this config changes them, so no file can say it");
  const std::string a(to_string(c.arch));
  const auto u32 = [](std::size_t v) {
    require(v <= 0xffffffffu, errc::invalid_argument,
            "model: " + std::to_string(v) + " does not fit the file's 32 bits");
    return gguf::make_u32(static_cast<std::uint32_t>(v));
  };
  metadata m;
  m["general.architecture"] = gguf::make_string(a);
  m[a + ".context_length"] = u32(c.max_context);
  m[a + ".embedding_length"] = u32(c.hidden);
  m[a + ".block_count"] = u32(c.layers);
  m[a + ".feed_forward_length"] = u32(c.ffn);
  m[a + ".attention.head_count"] = u32(c.heads);
  m[a + ".attention.head_count_kv"] = u32(c.kv_heads);
  m[a + ".rope.freq_base"] = gguf::make_f32(static_cast<float>(c.rope_theta));
  m[a + (c.norm == norm_kind::rms ? ".attention.layer_norm_rms_epsilon" : ".attention.layer_norm_epsilon")] =
      gguf::make_f32(c.norm_eps);
  if (c.head_size != 0) {
    m[a + ".attention.key_length"] = u32(c.head_size);
    m[a + ".attention.value_length"] = u32(c.head_size);
  }
  if (c.rope_scale != 1.0) {
    m[a + ".rope.scaling.type"] = gguf::make_string("linear");
    m[a + ".rope.scaling.factor"] = gguf::make_f32(static_cast<float>(c.rope_scale));
  }
  return m;
}

// ---- random-weight models ----------------------------------------------------------------------

struct random_spec {
  dtype type = dtype::f32;  // of every matrix, token embeddings and output included
  bool tied = false;        // no output matrix: logits come from the token embeddings
  std::optional<quant_mix> mix = std::nullopt;  // llama.cpp's recipe instead of `type` (quant_mix.hpp)
};

namespace detail {

// One tensor of a random model: its name, shape (rows, cols; rows = 1 for a vector) and how it is drawn.
struct random_tensor {
  std::string name;
  std::size_t rows = 1, cols = 0;
  double stddev = 1.0;
  double mean = 0.0;  // norm weights are drawn around one
};

// The tensors the architecture of `c` has, with scales that keep activations O(1): each projection
// by 1/sqrt(fan-in), residual branches also by 1/sqrt(2 * layers), so logits are neither flat nor
// one-hot. A tied model has small embeddings (else every token would predict itself, its own row
// being in the residual stream) and a final norm that scales them back up.
inline std::vector<random_tensor> random_layout(const config& c, const random_spec& s) {
  const auto h = static_cast<double>(c.hidden);
  const double branch = 1.0 / std::sqrt(2.0 * static_cast<double>(c.layers));
  const bool layer_norm = c.norm == norm_kind::layer;
  const bool qkv_bias = c.arch != architecture::llama, all_bias = c.arch == architecture::starcoder2;
  std::vector<random_tensor> out;
  const auto add = [&](std::string name, std::size_t rows, std::size_t cols, double stddev, double mean = 0.0) {
    out.push_back({std::move(name), rows, cols, stddev, mean});
  };
  add("token_embd.weight", c.vocab, c.hidden, s.tied ? 1.0 / std::sqrt(h) : 1.0);
  for (std::size_t l = 0; l < c.layers; ++l) {
    const auto n = [l](std::string_view what) { return names::block(l, what); };
    add(n("attn_norm.weight"), 1, c.hidden, 0.1, 1.0);
    if (layer_norm) add(n("attn_norm.bias"), 1, c.hidden, 0.02);
    add(n("attn_q.weight"), c.q_dim(), c.hidden, 1.0 / std::sqrt(h));
    add(n("attn_k.weight"), c.kv_dim(), c.hidden, 1.0 / std::sqrt(h));
    add(n("attn_v.weight"), c.kv_dim(), c.hidden, 1.0 / std::sqrt(h));
    if (qkv_bias) {
      add(n("attn_q.bias"), 1, c.q_dim(), 0.1);
      add(n("attn_k.bias"), 1, c.kv_dim(), 0.1);
      add(n("attn_v.bias"), 1, c.kv_dim(), 0.1);
    }
    add(n("attn_output.weight"), c.hidden, c.q_dim(), branch / std::sqrt(static_cast<double>(c.q_dim())));
    if (all_bias) add(n("attn_output.bias"), 1, c.hidden, 0.02);
    add(n("ffn_norm.weight"), 1, c.hidden, 0.1, 1.0);
    if (layer_norm) add(n("ffn_norm.bias"), 1, c.hidden, 0.02);
    if (c.mlp == mlp_kind::swiglu) add(n("ffn_gate.weight"), c.ffn, c.hidden, 1.0 / std::sqrt(h));
    add(n("ffn_up.weight"), c.ffn, c.hidden, 1.0 / std::sqrt(h));
    if (all_bias) add(n("ffn_up.bias"), 1, c.ffn, 0.02);
    add(n("ffn_down.weight"), c.hidden, c.ffn, branch / std::sqrt(static_cast<double>(c.ffn)));
    if (all_bias) add(n("ffn_down.bias"), 1, c.hidden, 0.02);
  }
  const double out_scale = s.tied ? 2.0 : 1.0;
  add("output_norm.weight", 1, c.hidden, 0.1 * out_scale, out_scale);
  if (layer_norm) add("output_norm.bias", 1, c.hidden, 0.02);
  if (!s.tied) add("output.weight", c.vocab, c.hidden, 2.0 / std::sqrt(h));
  return out;
}

// GGUF bytes with `meta` and random tensors for `c` (see random_model).
inline std::vector<std::byte> random_gguf(const config& c, std::uint64_t seed, const random_spec& s, metadata meta,
                                          std::size_t threads) {
  const std::string_view format = s.mix ? to_string(*s.mix) : to_string(s.type);
  meta.try_emplace("general.name", gguf::make_string("efim random " + std::string(to_string(c.arch)) + ", seed " +
                                                     std::to_string(seed) + ", " + std::string(format)));
  thread_pool pool(threads);
  constexpr std::size_t run = 1u << 16;
  const auto layout = random_layout(c, s);
  std::vector<std::vector<std::byte>> data(layout.size());
  std::vector<gguf::tensor_data> tensors;
  std::vector<float> values;
  for (std::size_t i = 0; i < layout.size(); ++i) {
    const auto& t = layout[i];
    const std::size_t n = t.rows * t.cols;
    const dtype type = t.rows == 1 ? dtype::f32 : s.mix ? mixed_type(*s.mix, t.name, t.cols, c.layers, !s.tied) : s.type;
    const std::size_t row = row_bytes(type, t.cols);
    values.resize(n);
    const std::uint64_t tensor_seed = XXH3_64bits_withSeed(t.name.data(), t.name.size(), seed);
    pool.parallel_for((n + run - 1) / run, [&](std::size_t begin, std::size_t end) {
      for (std::size_t r = begin; r < end; ++r) {
        rng g(tensor_seed + r * 0x9E3779B97F4A7C15ull);
        for (std::size_t j = r * run; j < std::min(n, (r + 1) * run); ++j)
          values[j] = static_cast<float>(t.mean + t.stddev * g.normal());
      }
    });
    data[i].resize(t.rows * row);
    pool.parallel_for(t.rows, [&](std::size_t begin, std::size_t end) {
      for (std::size_t r = begin; r < end; ++r)
        quantize_row(type, values.data() + r * t.cols, data[i].data() + r * row, t.cols);
    });
    std::vector<std::uint64_t> shape{t.cols};
    if (t.rows > 1) shape.push_back(t.rows);
    tensors.push_back({t.name, std::move(shape), static_cast<std::uint32_t>(type), data[i]});
  }
  return gguf::serialize(meta, tensors);
}
}  // namespace detail

// A random-weight model as the bytes of a GGUF file: `c`'s architecture keys, `extra` metadata (a
// tokenizer's, say), and every tensor drawn from `seed`. Each run of 64Ki values has a generator of its
// own (seeded from the seed, the tensor's name and the run), so the bytes are the same for a seed
// whatever the number of threads. Vectors stay f32; matrices are stored as `s.type`, or as `s.mix`
// chooses (llama.cpp's recipe: the same types and bytes as its quantizer on the f32 model).
inline std::vector<std::byte> random_model(const config& c, std::uint64_t seed, const random_spec& s = {},
                                           const metadata& extra = {}, std::size_t threads = 0) {
  metadata meta = config_metadata(c);
  for (const auto& [key, value] : extra) meta.insert_or_assign(key, value);
  return detail::random_gguf(c, seed, s, std::move(meta), threads);
}

// Random weights in memory, bound with `c` itself, so that a config no file could describe (another
// RoPE pairing for an architecture, say) still gets weights.
inline weights random_weights(const config& c, std::uint64_t seed, const random_spec& s = {}) {
  config described = c;
  const config fixed = for_architecture(c.arch);
  described.rope = fixed.rope;
  described.norm = fixed.norm;
  described.mlp = fixed.mlp;
  return open_model(detail::random_gguf(c, seed, s, config_metadata(described), 1)).bind(c);
}

// Writes bytes to `path` through a temporary file, so a failed write leaves no half file behind.
inline void write_file(const std::string& path, std::span<const std::byte> bytes) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    require(out.good(), errc::io, "cannot create '" + tmp + "'");
    out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    out.flush();
    if (!out.good()) {
      std::remove(tmp.c_str());
      throw error(errc::io, "cannot write '" + tmp + "'");
    }
  }
  require(std::rename(tmp.c_str(), path.c_str()) == 0, errc::io, "cannot rename '" + tmp + "' to '" + path + "'");
}

}  // namespace efim::model
