// Kernel lab: each host kernel is checked against a plain reference, then both are timed in the same
// run and the ratio printed. Also the whole model: prefill and decode tokens/s.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <numeric>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "../tests/support.hpp"
#include "efim/efim.hpp"

using namespace efim;

namespace {

double seconds_per_call(const auto& fn, double min_seconds = 0.5) {
  fn();  // warm up
  std::size_t calls = 0;
  const auto start = std::chrono::steady_clock::now();
  double elapsed = 0;
  do {
    fn();
    ++calls;
    elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  } while (elapsed < min_seconds);
  return elapsed / static_cast<double>(calls);
}

std::vector<float> random_vector(rng& r, std::size_t n) {
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(r.normal());
  return v;
}

using efim_test::max_relative_error;

void report(const char* what, double reference_s, double kernel_s, double work, const char* unit, float error) {
  std::printf("%-35s reference %10.2f %s   host %10.2f %s   ratio %6.2fx   max rel err %.1e\n", what,
              work / reference_s, unit, work / kernel_s, unit, reference_s / kernel_s, static_cast<double>(error));
}

void bench_matmul(thread_pool& pool, std::size_t m, std::size_t n, std::size_t k) {
  rng r(1);
  const auto x = random_vector(r, m * k), w = random_vector(r, n * k);
  std::vector<float> want(m * n), got(m * n);
  const auto reference = [&] {
    for (std::size_t i = 0; i < m; ++i)
      for (std::size_t j = 0; j < n; ++j) {
        float s = 0;
        for (std::size_t t = 0; t < k; ++t) s += x[i * k + t] * w[j * k + t];
        want[i * n + j] = s;
      }
  };
  const auto kernel = [&] { kernels::matmul(pool, x.data(), w.data(), got.data(), m, n, k); };
  const double tr = seconds_per_call(reference), tk = seconds_per_call(kernel);
  char name[64];
  std::snprintf(name, sizeof name, "matmul %zux%zux%zu", m, n, k);
  report(name, tr, tk, 2.0 * static_cast<double>(m * n * k) / 1e9, "GFLOP/s", max_relative_error(got, want));
}

// A weight matrix in `type` from random values (64 distinct rows, repeated, so that the output layer
// is quick to make), in `copies` copies: a decode run cycles through them, so its weights come from
// memory as in a real model rather than from a cache that holds one small matrix.
struct bench_weights {
  dtype type;
  std::size_t rows, cols, row_bytes, copies;
  std::vector<std::byte> bytes;
  [[nodiscard]] kernels::weight_view view(std::size_t copy) const {
    return {type, rows, cols, bytes.data() + copy * rows * row_bytes};
  }
};

bench_weights make_bench_weights(rng& r, dtype type, std::size_t rows, std::size_t cols, std::size_t min_bytes) {
  bench_weights w{type, rows, cols, row_bytes(type, cols), 1, {}};
  const std::size_t matrix = rows * w.row_bytes;
  w.copies = std::max<std::size_t>(1, (min_bytes + matrix - 1) / matrix);
  std::vector<std::byte> distinct(64 * w.row_bytes);
  for (std::size_t j = 0; j < 64; ++j) {
    const auto v = random_vector(r, cols);
    quantize_row(type, v.data(), distinct.data() + j * w.row_bytes, cols);
  }
  w.bytes.resize(w.copies * matrix);
  for (std::size_t j = 0; j < w.copies * rows; ++j)
    std::memcpy(w.bytes.data() + j * w.row_bytes, distinct.data() + (j % 64) * w.row_bytes, w.row_bytes);
  return w;
}

struct prefill_total {
  double macs = 0, seconds = 0;
};

// Appended to bench_typed_matmul's row names.
const char* row_tag = "";

// y (m, rows) = x * dequantize(w)^T against the plain loop (dequantize a row, then a float sum per x
// row, 1 thread), checked before timing: relative error against the plain loop, and bit equality
// with the canonical detail::dot on a sample of rows. Prints GMAC/s, and GB/s of weights for decode.
// With products::int8 (the quantized types) the error is against the same plain loop (the activations'
// rounding to 8 bits shows in it), and "canonical" means the bits of the generic path's int8 sums.
// Each row's name ends in `row_tag` (which decode tiles it was timed with).
void bench_typed_matmul(thread_pool& pool, dtype type, std::size_t m, std::size_t rows, std::size_t cols,
                        prefill_total* total = nullptr, kernels::products products = kernels::products::exact,
                        bool cached = false) {
  rng r(4);
  const bool decode = m <= 8;
  const auto w = make_bench_weights(r, type, rows, cols, decode && !cached ? std::size_t{128} << 20 : 0);
  const auto x = random_vector(r, m * cols);
  std::vector<float> want(m * rows), got(m * rows), row(cols);
  const auto reference = [&] {
    const auto v = w.view(0);
    for (std::size_t j = 0; j < rows; ++j) {
      dequantize_row(type, v.data + j * w.row_bytes, row.data(), cols);
      for (std::size_t i = 0; i < m; ++i) {
        float s = 0;
        for (std::size_t k = 0; k < cols; ++k) s += x[i * cols + k] * row[k];
        want[i * rows + j] = s;
      }
    }
  };
  std::size_t copy = 0;
  const auto kernel = [&] {
    kernels::matmul(pool, x.data(), w.view(copy), got.data(), m, kernels::accumulate::no, products);
    copy = (copy + 1) % w.copies;
  };
  reference();
  kernel();
  std::size_t differ = 0;
  const bool int8 = products == kernels::products::int8 && kernels::int8_products(type);
  if (int8) {
    std::vector<float> generic(m * rows);
    const kernels::isa was = kernels::active_isa();
    kernels::select_isa(kernels::isa::generic);
    kernels::matmul(pool, x.data(), w.view(0), generic.data(), m, kernels::accumulate::no, products);
    kernels::select_isa(was);
    for (std::size_t e = 0; e < got.size(); ++e) differ += got[e] != generic[e];
  } else {
    for (std::size_t j = 0; j < rows; j += std::max<std::size_t>(1, rows / 64)) {
      dequantize_row(type, w.view(0).data + j * w.row_bytes, row.data(), cols);
      for (std::size_t i = 0; i < m; ++i)
        differ += kernels::detail::dot(x.data() + i * cols, row.data(), cols) != got[i * rows + j];
    }
  }
  const float error = max_relative_error(got, want);
  const double tr = seconds_per_call(reference, 0.2), tk = seconds_per_call(kernel);
  const double macs = static_cast<double>(m) * static_cast<double>(rows) * static_cast<double>(cols);
  char name[64];
  std::snprintf(name, sizeof name, "matmul %-4s%s %zux%zux%zu%s", std::string(to_string(type)).c_str(),
                int8 ? "*q8" : "", m, rows, cols, row_tag);
  std::printf("%-35s reference %10.2f GMAC/s   host %10.2f GMAC/s   ratio %6.2fx   max rel err %.1e   %s", name,
              macs / tr / 1e9, macs / tk / 1e9, tr / tk, static_cast<double>(error),
              differ == 0 ? (int8 ? "generic's int8 bits" : "canonical")
                          : (int8 ? "NOT THE GENERIC INT8 BITS" : "NOT CANONICAL"));
  if (decode)
    std::printf("   %6.1f GB/s of weights%s", static_cast<double>(rows * w.row_bytes) / tk / 1e9,
                w.copies > 1 ? "" : " (one copy)");
  std::printf("\n");
  if (int8 && decode && kernels::interleavable(type)) {
    // The same matrices with 8 rows interleaved (kernels/interleave.hpp), timed after the rows as
    // stored, their bits against the rows' (got).
    std::vector<std::byte> il(w.bytes.size());
    for (std::size_t c = 0; c < w.copies; ++c) kernels::interleave8(w.view(c), il.data() + (il.size() / w.copies) * c);
    const auto view = [&](std::size_t c) {
      return kernels::weight_view{type, rows, cols, il.data() + (il.size() / w.copies) * c,
                                  kernels::weight_layout::interleaved8};
    };
    std::vector<float> yi(m * rows);
    kernels::matmul(pool, x.data(), view(0), yi.data(), m, kernels::accumulate::no, products);
    const bool same = std::memcmp(yi.data(), got.data(), yi.size() * sizeof(float)) == 0;
    copy = 0;
    const double ti = seconds_per_call([&] {
      kernels::matmul(pool, x.data(), view(copy), yi.data(), m, kernels::accumulate::no, products);
      copy = (copy + 1) % w.copies;
    });
    std::printf("%-34s interleaved rows     host %10.2f GMAC/s   %5.2fx the rows as stored   %s   %6.1f GB/s of weights\n",
                "", macs / ti / 1e9, tk / ti, same ? "same bits" : "BITS DIFFER", static_cast<double>(rows * w.row_bytes) / ti / 1e9);
  }
  if (total) {
    total->macs += macs;
    total->seconds += tk;
  }
}

// Queries at positions [first, first + queries) of one sequence (prefill), or one query in each of
// `queries` sequences at position `first` (decode).
void bench_attention(thread_pool& pool, bool prefill, std::size_t queries, std::size_t first) {
  const std::size_t heads = 4, kv_heads = 2, d = 32, block = 16;
  const std::size_t len = first + (prefill ? queries : 1);
  const std::size_t seqs = prefill ? 1 : queries;
  const std::size_t per_seq = (len + block - 1) / block;
  const kv::paged_layout layout{seqs * per_seq, kv_heads, block, d};
  rng r(2);
  auto kc = random_vector(r, layout.elements()), vc = random_vector(r, layout.elements());
  const auto q = random_vector(r, queries * heads * d);
  std::vector<block_id> ids(seqs * per_seq);
  std::iota(ids.begin(), ids.end(), block_id{0});
  for (std::size_t i = ids.size(); i > 1; --i) std::swap(ids[i - 1], ids[r.below(i)]);
  std::vector<kernels::token_slot> slots(queries);
  for (std::size_t t = 0; t < queries; ++t) {
    const std::size_t s = prefill ? 0 : t;
    slots[t] = {std::span(ids).subspan(s * per_seq, per_seq), static_cast<position>(prefill ? first + t : first)};
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  std::vector<float> want(queries * heads * d), got(want.size());
  const auto reference = [&] {
    std::vector<float> p;
    for (std::size_t t = 0; t < queries; ++t)
      for (std::size_t h = 0; h < heads; ++h) {
        const std::size_t g = h / (heads / kv_heads), n = static_cast<std::size_t>(slots[t].pos) + 1;
        p.assign(n, 0.0f);
        float top = -INFINITY, sum = 0;
        for (std::size_t j = 0; j < n; ++j) {
          const auto at = kv::locate(slots[t].table, block, j);
          const float* key = &kc[layout.key_offset(at.block, g) + at.slot];
          float s = 0;
          for (std::size_t i = 0; i < d; ++i) s += q[(t * heads + h) * d + i] * key[i * block];
          p[j] = s * scale;
          top = std::max(top, p[j]);
        }
        for (auto& x : p) sum += x = std::exp(x - top);
        float* out = &want[(t * heads + h) * d];
        std::fill_n(out, d, 0.0f);
        for (std::size_t j = 0; j < n; ++j) {
          const auto at = kv::locate(slots[t].table, block, j);
          const float* val = &vc[layout.offset(at.block, g, at.slot)];
          for (std::size_t i = 0; i < d; ++i) out[i] += p[j] / sum * val[i];
        }
      }
  };
  const auto kernel = [&] {
    kernels::paged_attention(pool, layout, kc.data(), vc.data(), q.data(), got.data(), slots, heads, scale);
  };
  const double tr = seconds_per_call(reference), tk = seconds_per_call(kernel);
  char name[64];
  std::snprintf(name, sizeof name, "attention %s %zu q @ %zu", prefill ? "prefill" : "decode", queries, first);
  report(name, tr, tk, static_cast<double>(queries) / 1e3, "kq/s", max_relative_error(got, want));
}

void bench_model(thread_pool& pool) {
  model::config c;
  c.vocab = 263;
  c.hidden = 128;
  c.layers = 4;
  c.heads = 4;
  c.kv_heads = 2;
  c.ffn = 384;
  const auto w = model::random_weights(c, 1);
  model::transformer<kernels::host> m(w);
  kernels::host::context ctx{pool};
  const std::size_t prompt = 2048, chunk = 512, decode = 64;
  kv::host_storage kv(c.layers, m.kv_layout((prompt + decode) / 16 + 1, 16));
  std::vector<block_id> table((prompt + decode) / 16 + 1);
  std::iota(table.begin(), table.end(), block_id{0});
  rng r(3);
  std::vector<token_id> tokens(prompt + decode);
  for (auto& t : tokens) t = static_cast<token_id>(r.below(c.vocab));
  std::vector<float> logits;
  const auto prefill = [&] {
    for (std::size_t p = 0; p < prompt; p += chunk) {
      const model::batch_item item{std::span(tokens).subspan(p, chunk), static_cast<position>(p), table, true};
      m.forward(ctx, kv, std::span(&item, 1), logits);
    }
  };
  const auto decode_run = [&] {
    for (std::size_t p = prompt; p < prompt + decode; ++p) {
      const model::batch_item item{std::span(tokens).subspan(p, 1), static_cast<position>(p), table, true};
      m.forward(ctx, kv, std::span(&item, 1), logits);
    }
  };
  const double tp = seconds_per_call(prefill, 1.0), td = seconds_per_call(decode_run, 1.0);
  std::printf(
      "model hidden %zu x %zu layers: prefill %zu tokens in chunks of %zu: %8.0f tokens/s; decode at %zu: %8.0f "
      "tokens/s\n",
      c.hidden, c.layers, prompt, chunk, static_cast<double>(prompt) / tp, prompt, static_cast<double>(decode) / td);
}

// Typed matmul at the shapes of a Qwen2-like model (hidden 768, 12 heads / 2 KV heads, FFN 2048,
// vocabulary 151936): prefill of 512 tokens, and decode.
// `words`: the command line's section words; type names among them (q4_k, q6_k, ...) keep those types
// alone, "decode" skips the prefill rows, "int8" adds rows with products::int8 after each exact one for
// the quantized types (kernels::int8_products), and "cached" a decode row of a 512 x 768 matrix that
// stays in the caches (the kernels' arithmetic rather than the memory's speed). "tiles" times each exact
// one-row decode of a type with the choice (f32, f16, bf16, q8_0) on the AVX-512 path twice, with each kind of decode
// tiles (kernels::decode_tiles: the AVX2 path's streams and the AVX-512 path's prefetched 8-row tiles; outside this
// lab the pipeline chooses between them by timing, see engine::pipeline_options::tune_decode_tiles), and prints their
// ratio.
void bench_typed(thread_pool& pool, const std::vector<std::string>& words) {
  struct shape {
    std::size_t rows, cols;
  };
  const auto named = [&](std::string_view w) { return std::find(words.begin(), words.end(), w) != words.end(); };
  const bool some =
      std::any_of(std::begin(all_dtypes), std::end(all_dtypes), [&](dtype t) { return named(to_string(t)); });
  const auto int8 = [&](dtype t) { return named("int8") && kernels::int8_products(t); };
  for (const dtype t : all_dtypes) {
    if (some && !named(to_string(t))) continue;
    if (!named("decode")) {
      prefill_total total, total8;
      for (const auto [rows, cols] : {shape{768, 768}, shape{128, 768}, shape{2048, 768}, shape{768, 2048}}) {
        bench_typed_matmul(pool, t, 512, rows, cols, &total);
        if (int8(t)) bench_typed_matmul(pool, t, 512, rows, cols, &total8, kernels::products::int8);
      }
      std::printf("matmul %-4s prefill m=512, 4 shapes   host %10.2f GMAC/s in all\n",
                  std::string(to_string(t)).c_str(), total.macs / total.seconds / 1e9);
      if (int8(t))
        std::printf("matmul %-4s*q8 prefill m=512, 4 shapes   host %10.2f GMAC/s in all (%.2fx the exact products)\n",
                    std::string(to_string(t)).c_str(), total8.macs / total8.seconds / 1e9,
                    total.seconds / total8.seconds);
    }
    // An exact decode row, or (one x row, "tiles", the AVX-512 path) one with each kind of decode tiles.
    const auto decode = [&](std::size_t m, std::size_t rows, std::size_t cols, bool cached) {
      if (!named("tiles") || m != 1 || kernels::active_isa() != kernels::isa::avx512 ||
          !kernels::has_decode_tiles_choice(t)) {
        bench_typed_matmul(pool, t, m, rows, cols, nullptr, kernels::products::exact, cached);
        return;
      }
      const kernels::decode_tiles before = kernels::active_decode_tiles();
      prefill_total streams, prefetched;  // (their seconds)
      row_tag = " streams";
      kernels::select_decode_tiles(kernels::decode_tiles::streams);
      bench_typed_matmul(pool, t, m, rows, cols, &streams, kernels::products::exact, cached);
      row_tag = " prefetched";
      kernels::select_decode_tiles(kernels::decode_tiles::prefetched);
      bench_typed_matmul(pool, t, m, rows, cols, &prefetched, kernels::products::exact, cached);
      row_tag = "";
      kernels::select_decode_tiles(before);
      std::printf("%-34s speed of the streams over the prefetched tiles: %.2fx\n", "",
                  prefetched.seconds / streams.seconds);
    };
    for (const auto [rows, cols] : {shape{2048, 768}, shape{768, 2048}, shape{151936, 768}}) {
      decode(1, rows, cols, false);
      if (int8(t)) bench_typed_matmul(pool, t, 1, rows, cols, nullptr, kernels::products::int8);
    }
    decode(4, 2048, 768, false);
    if (int8(t)) bench_typed_matmul(pool, t, 4, 2048, 768, nullptr, kernels::products::int8);
    if (named("cached")) {  // one weight matrix of 512 x 768, in the caches after the first call
      decode(1, 512, 768, true);
      if (int8(t)) bench_typed_matmul(pool, t, 1, 512, 768, nullptr, kernels::products::int8, true);
    }
  }
}

#if EFIM_KERNELS_DISPATCHED
// int8 products of m x rows on one thread, a 2048 x 768 matrix from memory: the streaming kernels
// (kq_rows, q32_rows: decode) against the panels (prefill), both called directly on the active path in
// the form it takes, to place int8_stream_rows (below it matmul streams, above it packs panels); then,
// for the types that interleave, the same on the rows interleaved (il8_rows against the panels packed
// from them) at up to 256 x rows, to place il8_stream_rows.
template <dtype T, kernels::int8_dot D, bool Avx512>
void bench_crossover(rng& r) {
  namespace kd = kernels::detail;
  constexpr bool per32 = kernels::int8_products_32(T);
  using block = std::conditional_t<per32, kquant::block_q8_32, kquant::block_q8_k>;
  const std::size_t rows = 2048, cols = 768, per = per32 ? 32 : qk_k, nb = cols / per;
  const auto w = make_bench_weights(r, T, rows, cols, std::size_t{128} << 20);
  std::vector<std::byte> il(kernels::interleavable(T) ? w.bytes.size() : 0);
  for (std::size_t c = 0; !il.empty() && c < w.copies; ++c)
    kernels::interleave8(w.view(c), il.data() + c * rows * w.row_bytes);
  const auto il_view = [&](std::size_t c) {  // copy c of the matrix, its rows interleaved
    return kernels::weight_view{T, rows, cols, il.data() + c * rows * w.row_bytes,
                                kernels::weight_layout::interleaved8};
  };
  constexpr auto no = kernels::accumulate::no;
  const auto panels_on = [&](const block* xq, std::size_t m, const kernels::weight_view& v, float* y) {
    if constexpr (per32 && Avx512)
      kd::isa_avx512::q32_panels<T, D>(xq, m, v, 0, rows, y, no);
    else if constexpr (per32)
      kd::isa_avx2::q32_panels<T, D>(xq, m, v, 0, rows, y, no);
    else if constexpr (Avx512 && D == kernels::int8_dot::evex)
      kd::isa_avx512::int8_panels<T>(xq, m, v, 0, rows, y, no);
    else if constexpr (Avx512)
      kd::isa_avx512::int8_panels256<T, D>(xq, m, v, 0, rows, y, no);
    else
      kd::isa_avx2::int8_panels256<T, D>(xq, m, v, 0, rows, y, no);
  };
  const auto quantized = [&](std::size_t m) {
    const auto x = random_vector(r, m * cols);
    std::vector<block> xq(m * nb);
    for (std::size_t b = 0; b < xq.size(); ++b) kquant::quantize(x.data() + b * per, xq[b]);
    return xq;
  };
  const auto run = [&](std::size_t m, bool interleaved) {
    const std::vector<block> xq = quantized(m);
    std::vector<float> ys(m * rows), yp(m * rows);
    std::size_t copy = 0;
    const auto view = [&] {
      const auto v = interleaved ? il_view(copy) : w.view(copy);
      copy = (copy + 1) % w.copies;
      return v;
    };
    const auto stream = [&] {
      const auto v = view();
      if constexpr (kernels::interleavable(T) && Avx512) {
        if constexpr (per32) {
          if (interleaved) return kd::isa_avx512::q32_il8_rows<T, D>(xq.data(), m, v, 0, rows, ys.data(), no);
        } else {
          if (interleaved) return kd::isa_avx512::kq_il8_rows<T, D>(xq.data(), m, v, 0, rows, ys.data(), no);
        }
      } else if constexpr (kernels::interleavable(T)) {
        using kernel = std::conditional_t<per32, kd::isa_avx2::q32_il8_kernel<T, D>, kd::isa_avx2::kq_il8_kernel<T, D>>;
        if (interleaved) return kd::isa_avx2::il8_rows<kernel>(xq.data(), m, v, nb, 0, rows, ys.data(), no);
      }
      if constexpr (per32 && Avx512)
        kd::isa_avx512::q32_rows<T, D>(xq.data(), m, v, 0, rows, ys.data(), no);
      else if constexpr (per32)
        kd::isa_avx2::q32_rows<T, D>(xq.data(), m, v, 0, rows, ys.data(), no);
      else if constexpr (Avx512)
        kd::isa_avx512::kq_rows<T, D>(xq.data(), m, v, 0, rows, ys.data(), no);
      else
        kd::isa_avx2::kq_rows<T, D>(xq.data(), m, v, 0, rows, ys.data(), no);
    };
    const auto panels = [&] { panels_on(xq.data(), m, view(), yp.data()); };
    const double ts = seconds_per_call(stream, 0.3), tp = seconds_per_call(panels, 0.3);
    std::printf(
        "int8 %-4s %s %3zu x rows x 2048x768, 1 thread: stream %8.1f us   panels %8.1f us   stream %5.2fx "
        "the panels' speed   %s\n",
        std::string(to_string(T)).c_str(), interleaved ? "interleaved" : "as stored  ", m, ts * 1e6, tp * 1e6, tp / ts,
        std::memcmp(ys.data(), yp.data(), ys.size() * sizeof(float)) == 0 ? "same bits" : "BITS DIFFER");
  };
  for (const std::size_t m : {1, 4, 8, 12, 16, 24, 32}) run(m, false);
  if (!il.empty())
    for (const std::size_t m : {12, 16, 32, 48, 64, 96, 128, 192, 256}) run(m, true);
  // Two ways a and b of the product of m x rows, each from memory (the next copy every call), timed in
  // turn: a(xq, copy, y), b(xq, copy, y); prints what each is and b's speed over a's.
  const auto in_turn = [&](std::size_t m, const char* what, const char* a_name, const char* b_name, auto&& a,
                           auto&& b) {
    const std::vector<block> xq = quantized(m);
    std::vector<float> ya(m * rows), yb(m * rows);
    std::size_t ca = 0, cb = 0;
    const auto run_a = [&] {
      a(xq.data(), ca, ya.data());
      ca = (ca + 1) % w.copies;
    };
    const auto run_b = [&] {
      b(xq.data(), cb, yb.data());
      cb = (cb + 1) % w.copies;
    };
    const double ta = seconds_per_call(run_a, 0.3), tb = seconds_per_call(run_b, 0.3);
    std::printf("int8 %-4s %s %3zu x rows x 2048x768, 1 thread: %s %8.1f us   %s %8.1f us   %s %5.2fx the speed   %s\n",
                std::string(to_string(T)).c_str(), what, m, a_name, ta * 1e6, b_name, tb * 1e6, b_name, ta / tb,
                std::memcmp(ya.data(), yb.data(), ya.size() * sizeof(float)) == 0 ? "same bits" : "BITS DIFFER");
  };
  // On the AVX-512 path with VNNI, the interleaved streams of q8_0, q4_0 and the k-quants two groups of 8
  // rows at a time in 512-bit registers (q32_il8x2, kq_il8x2: what matmul takes from a few x rows)
  // against one group in 256-bit registers.
  if constexpr (Avx512 && D == kernels::int8_dot::evex && kernels::interleavable(T)) {
    namespace k5 = kd::isa_avx512;
    using one = std::conditional_t<per32, k5::q32_il8_kernel<T, D>, k5::kq_il8_kernel<T, D>>;
    using two = std::conditional_t<per32, k5::q32_il8x2_kernel<T>, k5::kq_il8x2_kernel<T>>;
    for (const std::size_t m : {1, 2, 4, 6, 8, 12, 16, 32, 64, 128})
      in_turn(
          m, "interleaved", "one group", "two groups",
          [&](const block* xq, std::size_t c, float* y) { k5::il8_rows<one>(xq, m, il_view(c), nb, 0, rows, y, no); },
          [&](const block* xq, std::size_t c, float* y) { k5::il8_rows<two>(xq, m, il_view(c), nb, 0, rows, y, no); });
  }
  // Where the process runs AMX (int8_dot::amx, a Xeon), the interleaved streams of q8_0 and q4_0 against
  // the AMX panels that matmul takes above int8_stream_rows x rows (whole tiles of 16 x rows on AMX, the
  // rest on the VNNI panels), to place the streams' bound there.
  if constexpr (Avx512 && per32 && kernels::interleavable(T)) {
    if (kernels::int8_dot_for(kernels::isa::avx512) == kernels::int8_dot::amx) {
      namespace k5 = kd::isa_avx512;
      for (const std::size_t m : {13, 16, 24, 32, 48, 64, 96, 128})
        in_turn(
            m, "interleaved", "amx panels", "stream",
            [&](const block* xq, std::size_t c, float* y) { k5::q32_amx_panels<T>(xq, m, il_view(c), 0, rows, y, no); },
            [&](const block* xq, std::size_t c, float* y) {
              k5::q32_il8_rows<T, D>(xq, m, il_view(c), 0, rows, y, no);
            });
    }
  }
  // The panels packed from the rows as stored against the panels packed from the rows interleaved (the
  // packing's share of a prefill).
  for (const std::size_t m : {64, 512}) {
    if (il.empty()) continue;
    in_turn(
        m, "panels", "as stored", "interleaved",
        [&](const block* xq, std::size_t c, float* y) { panels_on(xq, m, w.view(c), y); },
        [&](const block* xq, std::size_t c, float* y) { panels_on(xq, m, il_view(c), y); });
  }
}

template <kernels::int8_dot D, bool Avx512>
void bench_crossovers() {
  rng r(5);
  bench_crossover<dtype::q4_k, D, Avx512>(r);
  bench_crossover<dtype::q5_k, D, Avx512>(r);
  bench_crossover<dtype::q6_k, D, Avx512>(r);
  bench_crossover<dtype::q8_0, D, Avx512>(r);
  bench_crossover<dtype::q4_0, D, Avx512>(r);
}
#endif

// "crossover": bench_crossover for the active path and its int8 form.
void bench_crossover_section() {
  const kernels::isa path = kernels::active_isa();
  const kernels::int8_dot d = kernels::int8_dot_for(path);
  std::printf("int8 streaming against panels: path %s, int8 form %s\n", std::string(kernels::isa_name(path)).c_str(),
              std::string(kernels::int8_dot_name(d)).c_str());
#if EFIM_KERNELS_DISPATCHED
  using kernels::int8_dot;
  if (path == kernels::isa::avx512)
    return d == int8_dot::evex || d == int8_dot::amx ? bench_crossovers<int8_dot::evex, true>()  // (VNNI panels)
                                                     : bench_crossovers<int8_dot::madd, true>();
  if (path == kernels::isa::avx2)
    return d == int8_dot::vex    ? bench_crossovers<int8_dot::vex, false>()
           : d == int8_dot::evex ? bench_crossovers<int8_dot::evex, false>()
                                 : bench_crossovers<int8_dot::madd, false>();
#endif
  std::printf("(the generic path has one int8 kernel: nothing to compare)\n");
}

constexpr const char* usage = R"(usage: efim-kernels-bench [THREADS [WORD...]]

Kernel lab: each host kernel checked against a plain reference, then both timed in the same run and
their ratio printed; also the whole model's prefill and decode tokens/s.
  THREADS   threads of the pool (0, the default: one per hardware thread)
  WORD      sections to run (default: matmul typed attention model): matmul, typed, attention, model,
            crossover (the two-group streams, panels and bounds, one thread from memory; never by
            default); for typed also element types (f32 f16 bf16 q8_0 q4_0 q5_0 q5_1 q4_k q5_k q6_k:
            those alone), decode (no prefill rows), int8 (rows with int8 products too), cached (a decode
            row from the caches) and tiles (each exact one-row decode with both kinds of decode tiles,
            on the AVX-512 path). Words may come as one argument: efim-kernels-bench 2 "typed decode q4_k"
)";

// What words the command line may name (usage).
bool known_word(std::string_view w) {
  for (const char* k : {"matmul", "typed", "attention", "model", "crossover", "decode", "int8", "cached", "tiles"})
    if (w == k) return true;
  return std::any_of(std::begin(all_dtypes), std::end(all_dtypes), [&](dtype t) { return to_string(t) == w; });
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && (std::string_view(argv[1]) == "--help" || std::string_view(argv[1]) == "-h")) {
    std::fputs(usage, stdout);
    return 0;
  }
  std::size_t threads = 0;
  if (argc > 1) {
    const std::string_view a = argv[1];
    if (a.empty() || a.size() > 4 || !std::all_of(a.begin(), a.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      std::fprintf(stderr, "efim-kernels-bench: THREADS must be a number of threads (0-9999), not '%s'\n%s", argv[1],
                   usage);
      return 2;
    }
    threads = std::stoul(std::string(a));
  }
  std::vector<std::string> words;
  for (int i = 2; i < argc; ++i) {
    std::istringstream in(argv[i]);
    for (std::string w; in >> w;) {
      if (!known_word(w)) {
        std::fprintf(stderr, "efim-kernels-bench: unknown word '%s'\n%s", w.c_str(), usage);
        return 2;
      }
      words.push_back(w);
    }
  }
  if (words.empty()) words = {"matmul", "typed", "attention", "model"};
  const auto run = [&](const char* section) { return std::find(words.begin(), words.end(), section) != words.end(); };
  thread_pool pool(threads);
  std::printf("efim kernel lab, %zu threads (reference: plain loops, 1 thread)\n", pool.size());
  if (run("matmul")) {
    bench_matmul(pool, 512, 384, 128);
    bench_matmul(pool, 512, 128, 384);
    bench_matmul(pool, 16, 384, 128);
  }
  if (run("typed")) bench_typed(pool, words);
  if (run("attention")) {
    bench_attention(pool, true, 512, 1536);
    bench_attention(pool, false, 16, 2048);
  }
  if (run("model")) bench_model(pool);
  if (run("crossover")) bench_crossover_section();
  return 0;
}
