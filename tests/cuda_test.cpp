// The CUDA backend against the host backend: one test body per op, run on both, compared within a
// relative-error bound fit to f32 (exactly where the op does no arithmetic that could round otherwise). On a machine without a CUDA device every case says so (ctest
// reports the suite skipped); nothing is counted as passed there.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <type_traits>
#include <catch2/catch.hpp>
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "cuda_ops.hpp"
#include "efim/core/random.hpp"
#include "efim/core/config.hpp"
#include "efim/kernels/gelu.hpp"
#include "efim/kernels/host.hpp"
#include "efim/kernels/layernorm.hpp"
#include "efim/kernels/cuda/quant_groups.hpp"
#include "efim/kernels/matmul.hpp"
#include "efim/model/gguf_model.hpp"
#include "efim/model/transformer.hpp"
#include "small_model.hpp"

using namespace efim;

namespace {

#define EFIM_NEED_DEVICE()                                       \
  do {                                                           \
    if (!test_cuda::available()) {                               \
      WARN("skipped: no CUDA device");                           \
      return;                                                    \
    }                                                            \
  } while (0)

std::vector<float> random_floats(rng& r, std::size_t n, float scale = 1.0f) {
  std::vector<float> v(n);
  for (auto& x : v) x = (static_cast<float>(r.below(2000001)) / 1e6f - 1.0f) * scale;
  return v;
}

// A (rows, cols) matrix of random_floats quantized to `type` row by row.
std::vector<std::byte> random_quantized(rng& r, dtype type, std::size_t rows, std::size_t cols) {
  const auto values = random_floats(r, rows * cols);
  const std::size_t rb = row_bytes(type, cols);
  std::vector<std::byte> w(rows * rb);
  for (std::size_t i = 0; i < rows; ++i) quantize_row(type, values.data() + i * cols, w.data() + i * rb, cols);
  return w;
}

// The largest |a - b| / max(|b|, floor) over the elements: f32 sums in another order differ in the
// last bits, near-zero results are compared against `floor`.
float max_relative_error(const std::vector<float>& a, const std::vector<float>& b, float floor = 1e-3f) {
  REQUIRE(a.size() == b.size());
  float worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    worst = std::max(worst, std::abs(a[i] - b[i]) / std::max(std::abs(b[i]), floor));
  return worst;
}

// Each op's test body over a backend: `Ops` is the host kernels or the CUDA ones.
struct host_ops {
  static std::vector<float> rmsnorm(std::vector<float> x, const std::vector<float>& w, std::size_t rows,
                                    std::size_t n, float eps) {
    kernels::rmsnorm(x.data(), w.data(), x.data(), rows, n, eps);
    return x;
  }
  static std::vector<float> layernorm(std::vector<float> x, const std::vector<float>& w, const std::vector<float>& b,
                                      std::size_t rows, std::size_t n, float eps) {
    kernels::layernorm(x.data(), w.data(), b.data(), x.data(), rows, n, eps);
    return x;
  }
  static std::vector<float> gelu(const std::vector<float>& x) {
    std::vector<float> out(x.size());
    kernels::gelu(x.data(), out.data(), x.size());
    return out;
  }
  static std::vector<float> embedding(dtype type, const std::vector<std::byte>& table, std::size_t n,
                                      const std::vector<token_id>& ids) {  // as the transformer looks rows up
    std::vector<float> out(ids.size() * n);
    const std::size_t row = row_bytes(type, n);
    for (std::size_t t = 0; t < ids.size(); ++t)
      dequantize_row(type, table.data() + static_cast<std::size_t>(ids[t]) * row, out.data() + t * n, n);
    return out;
  }
  static std::vector<float> swiglu(const std::vector<float>& g, const std::vector<float>& u) {
    std::vector<float> out(g.size());
    kernels::swiglu(g.data(), u.data(), out.data(), g.size());
    return out;
  }
  static std::vector<float> rope(std::vector<float> x, std::size_t t, std::size_t h, std::size_t d,
                                 const std::vector<float>& c, const std::vector<float>& s, kernels::rope_style st) {
    kernels::rope(x.data(), t, h, d, c.data(), s.data(), st);
    return x;
  }
};
struct cuda_ops {
  static std::vector<float> layernorm(const std::vector<float>& x, const std::vector<float>& w,
                                      const std::vector<float>& b, std::size_t rows, std::size_t n, float eps) {
    return test_cuda::layernorm(x, w, b, rows, n, eps);
  }
  static std::vector<float> gelu(const std::vector<float>& x) { return test_cuda::gelu(x); }
  static std::vector<float> embedding(dtype type, const std::vector<std::byte>& table, std::size_t n,
                                      const std::vector<token_id>& ids) {
    return test_cuda::embedding(type, table, n, ids);
  }
  static std::vector<float> rmsnorm(const std::vector<float>& x, const std::vector<float>& w, std::size_t rows,
                                    std::size_t n, float eps) {
    return test_cuda::rmsnorm(x, w, rows, n, eps);
  }
  static std::vector<float> swiglu(const std::vector<float>& g, const std::vector<float>& u) {
    return test_cuda::swiglu(g, u);
  }
  static std::vector<float> rope(const std::vector<float>& x, std::size_t t, std::size_t h, std::size_t d,
                                 const std::vector<float>& c, const std::vector<float>& s, kernels::rope_style st) {
    return test_cuda::rope(x, t, h, d, c, s, st);
  }
};

template <class Ops>
std::vector<float> rmsnorm_body(std::size_t rows, std::size_t n) {
  rng r(rows * 131 + n);
  const auto x = random_floats(r, rows * n, 3.0f), w = random_floats(r, n);
  return Ops::rmsnorm(x, w, rows, n, 1e-6f);
}
template <class Ops>
std::vector<float> layernorm_body(std::size_t rows, std::size_t n) {
  rng r(rows * 17 + n);
  const auto x = random_floats(r, rows * n, 3.0f), w = random_floats(r, n), b = random_floats(r, n);
  return Ops::layernorm(x, w, b, rows, n, 1e-5f);
}
template <class Ops>
std::vector<float> gelu_body(std::size_t n) {
  rng r(n + 1);
  return Ops::gelu(random_floats(r, n, 12.0f));
}
// A (rows, n) table of `type` elements (f32 values rounded to the type) and ids that repeat.
template <class Ops>
std::vector<float> embedding_body(dtype type, std::size_t rows, std::size_t n) {
  rng r(rows + n);
  const auto values = random_floats(r, rows * n, 4.0f);
  std::vector<std::byte> table(rows * row_bytes(type, n));
  for (std::size_t i = 0; i < values.size() && info(type).block > 1; i += n)  // block-quantized rows
    quantize_row(type, values.data() + i, table.data() + i / n * row_bytes(type, n), n);
  for (std::size_t i = 0; i < values.size() && info(type).block == 1; ++i) {
    if (type == dtype::f32) {
      std::memcpy(table.data() + 4 * i, &values[i], 4);
    } else {
      const std::uint16_t h = type == dtype::f16 ? f32_to_f16(values[i]) : f32_to_bf16(values[i]);
      std::memcpy(table.data() + 2 * i, &h, 2);
    }
  }
  std::vector<token_id> ids;
  for (int i = 0; i < 37; ++i) ids.push_back(static_cast<token_id>(r.below(rows)));
  return Ops::embedding(type, table, n, ids);
}
template <class Ops>
std::vector<float> swiglu_body(std::size_t n) {
  rng r(n);
  return Ops::swiglu(random_floats(r, n, 20.0f), random_floats(r, n));
}
template <class Ops>
std::vector<float> rope_body(std::size_t tokens, std::size_t heads, std::size_t head_dim, kernels::rope_style style) {
  rng r(tokens * 7 + heads);
  std::vector<position> positions(tokens);
  for (std::size_t t = 0; t < tokens; ++t) positions[t] = static_cast<position>(r.below(32768));
  std::vector<float> c(tokens * head_dim / 2), s(c.size());
  kernels::rope_table(positions, head_dim, 1e6, c.data(), s.data());
  return Ops::rope(random_floats(r, tokens * heads * head_dim), tokens, heads, head_dim, c, s, style);
}

}  // namespace

TEST_CASE("cuda: the device is named", "[cuda][gpu]") {
  EFIM_NEED_DEVICE();
  INFO(test_cuda::device_name());
  CHECK_FALSE(test_cuda::device_name().empty());
}

TEST_CASE("cuda: RMSNorm equals the host kernel", "[cuda][gpu]") {
  EFIM_NEED_DEVICE();
  for (const auto& [rows, n] : std::vector<std::pair<std::size_t, std::size_t>>{{1, 1}, {3, 7}, {5, 896}, {64, 4096}}) {
    INFO(rows << " x " << n);
    CHECK(max_relative_error(rmsnorm_body<cuda_ops>(rows, n), rmsnorm_body<host_ops>(rows, n)) < 1e-5f);
  }
}

TEST_CASE("cuda: LayerNorm and GELU equal the host kernels", "[cuda][gpu]") {
  EFIM_NEED_DEVICE();
  for (const auto& [rows, n] : std::vector<std::pair<std::size_t, std::size_t>>{{1, 1}, {3, 7}, {5, 768}, {64, 3072}}) {
    INFO(rows << " x " << n);
    // (x - mean) cancels near the mean, where the means of 3072 f32 values summed in another order
    // differ by a few 1e-6 (seen on an H100: 1.0e-6 absolute): there the bound is absolute, 1e-5.
    CHECK(max_relative_error(layernorm_body<cuda_ops>(rows, n), layernorm_body<host_ops>(rows, n), 1e-1f) < 1e-4f);
  }
  // 1 + tanh(u) cancels for negative x (the host takes tanh from its own exp): an absolute 1e-5 below 1.
  for (const std::size_t n : {1, 17, 3072, 1 << 20})
    CHECK(max_relative_error(gelu_body<cuda_ops>(n), gelu_body<host_ops>(n), 1.0f) < 1e-5f);
}

TEST_CASE("cuda: the embedding lookup gives the host's rows (f32, f16, bf16 and quantized tables)", "[cuda][gpu]") {
  EFIM_NEED_DEVICE();
  for (const auto type : {dtype::f32, dtype::f16, dtype::bf16, dtype::q8_0, dtype::q4_0, dtype::q5_0, dtype::q5_1,
                          dtype::q4_k, dtype::q5_k, dtype::q6_k}) {
    INFO(to_string(type));
    const std::size_t n = info(type).block == 256 ? 1024 : 896;
    CHECK(embedding_body<cuda_ops>(type, 1000, n) == embedding_body<host_ops>(type, 1000, n));
  }
}

TEST_CASE("cuda: SwiGLU equals the host kernel", "[cuda][gpu]") {
  EFIM_NEED_DEVICE();
  for (const std::size_t n : {1, 17, 4864, 1 << 20})
    CHECK(max_relative_error(swiglu_body<cuda_ops>(n), swiglu_body<host_ops>(n)) < 1e-5f);
}

TEST_CASE("cuda: RoPE equals the host kernel, both layouts", "[cuda][gpu]") {
  EFIM_NEED_DEVICE();
  for (const auto style : {kernels::rope_style::adjacent, kernels::rope_style::neox})
    for (const auto& [tokens, heads] : std::vector<std::pair<std::size_t, std::size_t>>{{1, 1}, {9, 14}, {300, 2}})
      CHECK(max_relative_error(rope_body<cuda_ops>(tokens, heads, 64, style), rope_body<host_ops>(tokens, heads, 64, style)) <
            1e-6f);
}

namespace {
// A layer's caches with every element distinct, so that a misplaced write shows.
template <class E>
std::vector<E> filled(std::size_t n, float start) {
  std::vector<E> v(n);
  for (std::size_t i = 0; i < n; ++i) kernels::detail::store(start + static_cast<float>(i) * 1e-3f, v[i]);
  return v;
}
template <class E>
std::vector<std::uint32_t> raw(const std::vector<E>& v) {  // the bits, for exact comparison
  std::vector<std::uint32_t> out;
  for (const E& e : v) {
    if constexpr (std::is_same_v<E, float>)
      out.push_back(efim::bit_cast<std::uint32_t>(e));
    else
      out.push_back(e.bits);
  }
  return out;
}

template <class E>
void kv_ops_on_both() {
  const kv::paged_layout l{9, 2, 16, 64};
  rng r(3);
  // 40 tokens of two sequences scattered over the blocks, written on both backends: the same bits.
  std::vector<block_id> table_a{4, 0, 7}, table_b{2, 8};
  std::vector<kernels::token_slot> slots;
  std::vector<kv::slot_ref> refs;
  for (position p = 5; p < 30; ++p) slots.push_back({table_a, p});
  for (position p = 0; p < 15; ++p) slots.push_back({table_b, p});
  for (const auto& s : slots) refs.push_back(kv::locate(s.table, l.block_size, static_cast<std::size_t>(s.pos)));
  const auto k = random_floats(r, slots.size() * l.kv_heads * l.head_dim);
  const auto v = random_floats(r, k.size());
  auto hk = filled<E>(l.elements(), 1.0f), hv = filled<E>(l.elements(), 2.0f);
  auto dk = hk, dv = hv;
  kernels::kv_write<E>(l, hk.data(), hv.data(), k.data(), v.data(), slots);
  test_cuda::kv_write<E>(l, dk, dv, k, v, refs);
  CHECK(raw(dk) == raw(hk));
  CHECK(raw(dv) == raw(hv));
  // Copy-on-write: blocks 4 and 2 into 1 and 3; the reference is a plain copy of each block.
  const std::vector<block_id> from{4, 2}, to{1, 3};
  test_cuda::block_copy<E>(l, dk, dv, from, to);
  for (std::size_t p = 0; p < from.size(); ++p) {
    const auto src = static_cast<std::size_t>(from[p]) * l.block_stride(), dst = static_cast<std::size_t>(to[p]) * l.block_stride();
    std::copy_n(hk.begin() + static_cast<std::ptrdiff_t>(src), l.block_stride(), hk.begin() + static_cast<std::ptrdiff_t>(dst));
    std::copy_n(hv.begin() + static_cast<std::ptrdiff_t>(src), l.block_stride(), hv.begin() + static_cast<std::ptrdiff_t>(dst));
  }
  CHECK(raw(dk) == raw(hk));
  CHECK(raw(dv) == raw(hv));

  // RoPE of q and k and the K/V write in one launch: the bits of the three (both rotary layouts).
  const std::size_t heads = 6, pairs = l.head_dim / 2;
  const auto cos_t = random_floats(r, slots.size() * pairs), sin_t = random_floats(r, slots.size() * pairs);
  for (const auto style : {kernels::rope_style::adjacent, kernels::rope_style::neox}) {
    auto q_apart = random_floats(r, slots.size() * heads * l.head_dim), q_fused = q_apart;
    auto k_apart = filled<E>(l.elements(), 3.0f), v_apart = filled<E>(l.elements(), 4.0f);
    auto k_fused = k_apart, v_fused = v_apart;
    test_cuda::rope_kv_write<E>(l, k_apart, v_apart, q_apart, k, v, refs, heads, cos_t, sin_t, style, false);
    test_cuda::rope_kv_write<E>(l, k_fused, v_fused, q_fused, k, v, refs, heads, cos_t, sin_t, style, true);
    CHECK(raw(q_fused) == raw(q_apart));
    CHECK(raw(k_fused) == raw(k_apart));
    CHECK(raw(v_fused) == raw(v_apart));
  }
}
}  // namespace

TEST_CASE("cuda: KV writes, block copies and the fused RoPE + KV write give the host's bits (f32 and f16 caches)",
          "[cuda][gpu]") {
  EFIM_NEED_DEVICE();
  kv_ops_on_both<float>();
  kv_ops_on_both<half>();
}

TEST_CASE("cuda: greedy sampling picks the host's token, the lowest id of equal logits", "[cuda][gpu]") {
  EFIM_NEED_DEVICE();
  rng r(9);
  const std::size_t rows = 5, n = 151936;
  auto logits = random_floats(r, rows * n, 10.0f);
  logits[1 * n + 70000] = logits[1 * n + 90000] = 50.0f;  // a tie: 70000 wins
  std::fill(logits.begin() + 2 * n, logits.begin() + 3 * n, -3.0f);  // all equal: 0 wins
  const auto got = test_cuda::argmax(logits, rows, n);
  for (std::size_t row = 0; row < rows; ++row)
    CHECK(got[row] == kernels::argmax(std::span<const float>(logits.data() + row * n, n)));
  CHECK(got[1] == 70000);
  CHECK(got[2] == 0);
}

namespace {
// Sequences of `lengths` tokens in random pages of a layer's caches (random K and V), and a batch
// that asks for the last `fresh` positions of each (1: a decode step; more: a prefill chunk over
// cached context); attention on both backends.
template <class E>
void attention_on_both(const kv::paged_layout& l, std::size_t heads, const std::vector<std::size_t>& lengths,
                       std::size_t fresh) {
  rng r(l.block_size * 31 + l.head_dim + heads + fresh);
  std::vector<E> k(l.elements()), v(l.elements());
  for (std::size_t i = 0; i < k.size(); ++i) {
    kernels::detail::store(static_cast<float>(r.below(2000001)) / 1e6f - 1.0f, k[i]);
    kernels::detail::store(static_cast<float>(r.below(2000001)) / 1e6f - 1.0f, v[i]);
  }
  std::vector<std::vector<block_id>> tables;
  for (const std::size_t n : lengths) {
    std::vector<block_id> t;
    for (std::size_t b = 0; b < (n + l.block_size - 1) / l.block_size; ++b)
      t.push_back(static_cast<block_id>(r.below(l.blocks)));  // shared pages are fine for reading
    tables.push_back(std::move(t));
  }
  std::vector<kernels::token_slot> tokens;
  for (std::size_t s = 0; s < lengths.size(); ++s)
    for (std::size_t p = lengths[s] - std::min(fresh, lengths[s]); p < lengths[s]; ++p)
      tokens.push_back({tables[s], static_cast<position>(p)});
  const auto q = random_floats(r, tokens.size() * heads * l.head_dim, 2.0f);
  const float scale = 1.0f / std::sqrt(static_cast<float>(l.head_dim));
  std::vector<float> host(q.size());
  thread_pool pool(2);
  kernels::paged_attention<E>(pool, l, k.data(), v.data(), q.data(), host.data(), tokens, heads, scale);
  // One block per tile, then each tile's pages cut into ranges (split-K) as for a decode step; by the
  // pages kernel (a warp per page) and the rows kernel (a warp per row), each planned its own way.
  using test_cuda::decode_kernel;
  for (const auto kernel : {decode_kernel::pages, decode_kernel::rows})
    for (const std::size_t target : {1, 4096}) {
      std::size_t splits = 0;
      const auto device =
          test_cuda::paged_attention<E>(l, k, v, q, tokens, heads, scale, target, splits, false, kernel);
      INFO((kernel == decode_kernel::rows ? "rows" : "pages")
           << " kernel, target " << target << " blocks: " << splits << " page ranges per tile");
      // Weighted means of values in [-1, 1]: an absolute bound, f32 sums in another order.
      CHECK(max_relative_error(device, host, 1.0f) < 2e-6f);
      if (target == 1) CHECK(splits == 1);
      if (target > 1 && fresh == 1) CHECK(splits > 1);  // a decode step over 517 keys: 9 pages or more
      // The ranges merged by the last block of each tile in the same launch: the merge kernel's bits.
      std::size_t folded_splits = 0;
      const auto folded =
          test_cuda::paged_attention<E>(l, k, v, q, tokens, heads, scale, target, folded_splits, true, kernel);
      CHECK(folded_splits == splits);
      REQUIRE(folded.size() == device.size());
      CHECK(std::memcmp(folded.data(), device.data(), folded.size() * sizeof(float)) == 0);
    }
  // The staged kernel on the same tiles and cut (f16 caches it fits), its ranges merged in the launch:
  // the f16 rounding of queries and probabilities (its host emulation, in test_model: 2.6e-4).
  if constexpr (std::is_same_v<E, half>) {
    if (test_cuda::attention_mma_fits(l))
      for (const std::size_t target : {1, 4096}) {
        std::size_t splits = 0;
        const auto staged = test_cuda::paged_attention<E>(l, k, v, q, tokens, heads, scale, target, splits, true,
                                                          decode_kernel::staged);
        INFO("staged decode kernel, target " << target << " blocks: " << splits << " key ranges per tile");
        CHECK(std::all_of(staged.begin(), staged.end(), [](float x) { return std::isfinite(x); }));
        CHECK(max_relative_error(staged, host, 1.0f) < 1e-3f);
        if (target == 1) CHECK(splits == 1);
        if (target > 1 && fresh == 1) CHECK(splits > 1);  // 517 keys: ranges of 64 (32 at 256 dimensions)
      }
  }
  // On tensor cores (f16 caches whose block and head sizes are multiples of 16), by WMMA and by
  // mma.sync over staged K and V: the queries and the probabilities rounded to f16 (host emulations of
  // those roundings on these cases: up to 3.1e-4; of the staged kernel, in test_model: 2.6e-4).
  if constexpr (std::is_same_v<E, half>) {
    if (test_cuda::attention_mma_fits(l))
      for (const bool staged : {false, true}) {
        INFO((staged ? "staged" : "WMMA") << " tensor-core kernel");
        const auto mma = test_cuda::paged_attention_mma(l, k, v, q, tokens, heads, scale, staged);
        CHECK(std::all_of(mma.begin(), mma.end(), [](float x) { return std::isfinite(x); }));
        CHECK(max_relative_error(mma, host, 1.0f) < 1e-3f);
      }
  }
}
}  // namespace

TEST_CASE("cuda: paged attention equals the host kernel (decode, prefill over cached context, GQA)", "[cuda][gpu]") {
  EFIM_NEED_DEVICE();
  struct shape {
    std::size_t blocks, kv_heads, block_size, head_dim, heads;
  };
  for (const shape s : {shape{40, 2, 16, 64, 14}, shape{40, 4, 32, 128, 28}, shape{30, 4, 48, 16, 4},
                        shape{30, 1, 64, 80, 16}, shape{60, 2, 8, 256, 4}, shape{40, 2, 16, 256, 4},
                        shape{30, 2, 16, 13, 6}, shape{30, 2, 16, 66, 4}, shape{30, 1, 16, 132, 1}}) {
    const kv::paged_layout l{s.blocks, s.kv_heads, s.block_size, s.head_dim};
    INFO("block " << s.block_size << ", head_dim " << s.head_dim << ", heads " << s.heads << "/" << s.kv_heads);
    for (const std::size_t fresh : {1, 2, 7, 300}) {  // (2: tiles of 2 rows that see different keys)
      INFO(fresh << " new tokens per sequence");
      attention_on_both<float>(l, s.heads, {1, 33, 301, 517}, fresh);
      attention_on_both<half>(l, s.heads, {1, 33, 301, 517}, fresh);
    }
  }
}

// The slots of a sequence's last page past its keys hold whatever the page held before (unwritten, or
// another sequence's): the tensor-core kernel multiplies whole chunks of 16 values, so it must not let
// an infinity or a NaN there into a row (P is 0 there, but 0 times infinity is not).
TEST_CASE("cuda: tensor-core attention reads nothing past a sequence's keys", "[cuda][gpu]") {
  EFIM_NEED_DEVICE();
  const kv::paged_layout l{8, 1, 16, 64};
  const std::size_t heads = 4, length = 37;  // pages 0, 1, 2 (5 keys of the last)
  rng r(77);
  std::vector<half> k(l.elements()), v(l.elements());
  for (std::size_t i = 0; i < k.size(); ++i) {
    kernels::detail::store(static_cast<float>(r.below(2001)) / 1e3f - 1.0f, k[i]);
    kernels::detail::store(static_cast<float>(r.below(2001)) / 1e3f - 1.0f, v[i]);
  }
  const std::vector<block_id> table{0, 1, 2};
  for (std::size_t slot = length % 16; slot < 16; ++slot)
    for (std::size_t d = 0; d < l.head_dim; ++d) {
      const float junk = slot % 2 == 0 ? INFINITY : NAN;
      kernels::detail::store(junk, k[l.key_offset(2, 0) + d * l.block_size + slot]);
      kernels::detail::store(junk, v[l.offset(2, 0, slot) + d]);
    }
  std::vector<kernels::token_slot> tokens;
  for (std::size_t p = 0; p < length; ++p) tokens.push_back({table, static_cast<position>(p)});
  const auto q = random_floats(r, tokens.size() * heads * l.head_dim, 2.0f);
  const float scale = 0.125f;
  std::vector<float> host(q.size());
  thread_pool pool(2);
  kernels::paged_attention<half>(pool, l, k.data(), v.data(), q.data(), host.data(), tokens, heads, scale);
  for (const bool staged : {false, true}) {
    INFO((staged ? "staged" : "WMMA") << " tensor-core kernel");
    const auto mma = test_cuda::paged_attention_mma(l, k, v, q, tokens, heads, scale, staged);
    CHECK(std::all_of(mma.begin(), mma.end(), [](float x) { return std::isfinite(x); }));
    CHECK(max_relative_error(mma, host, 1.0f) < 1e-3f);
  }
}

TEST_CASE("cuda: temperature, top-k and top-p sampling draw the host's token for the same u", "[cuda][gpu]") {
  EFIM_NEED_DEVICE();
  rng r(21);
  for (const std::size_t n : {1, 2, 50, 1000, 151936}) {
    const std::size_t rows = 8;
    auto logits = random_floats(r, rows * n, 8.0f);
    if (n > 10) logits[3 * n + 7] = logits[3 * n + 9] = logits[3 * n + 2];  // ties: the lower id first
    std::vector<kernels::sample_params> params;
    const float temperatures[] = {0.0f, 0.2f, 0.7f, 1.0f, 1.5f, 0.7f, 1.0f, 0.3f};
    const std::uint32_t top_ks[] = {0, 0, 40, 0, 5, 1, 0, 1000};
    const float top_ps[] = {1.0f, 0.95f, 1.0f, 0.5f, 0.9f, 1.0f, 1e-6f, 0.99f};
    for (int draw = 0; draw < 25; ++draw) {
      params.clear();
      for (std::size_t row = 0; row < rows; ++row)
        params.push_back({temperatures[row], top_ks[row], top_ps[row], static_cast<double>(r.below(1u << 30)) / (1u << 30)});
      const auto got = test_cuda::sample(logits, rows, n, params);
      std::vector<std::pair<float, token_id>> scratch;
      for (std::size_t row = 0; row < rows; ++row) {
        INFO(n << " logits, row " << row << ", draw " << draw);
        const std::span<const float> l(logits.data() + row * n, n);
        const auto& p = params[row];
        CHECK(got[row] == kernels::sample(l, p.temperature, p.top_k, p.top_p, p.u, scratch));
      }
    }
  }
}

// Dense weights: decode (up to 8 x rows, rows of whole chunks of 8 values) multiplies in registers, the
// lanes' sums of quant::lane_dots added as a warp adds them, which the host emulates bit for bit;
// prefill, and decode of rows of other widths (100 values here), through cuBLAS. Both within f32
// rounding (and cuBLAS's rounding of x to 16 bits) of the host's products.
TEST_CASE("cuda: matrix products of f32, f16, bf16 weights equal the host's, decode its emulation bit for bit",
          "[cuda][gpu]") {
  EFIM_NEED_DEVICE();
  for (const dtype type : {dtype::f32, dtype::f16, dtype::bf16})
    for (const auto& [m, rows, cols] : std::vector<std::tuple<std::size_t, std::size_t, std::size_t>>{
             {1, 1, 32}, {1, 896, 896}, {3, 4864, 896}, {8, 300, 104}, {2, 50, 100}, {64, 896, 4864}, {130, 257, 96}})
      for (const bool acc : {false, true}) {
        INFO(to_string(type) << " " << m << " x " << rows << " x " << cols << (acc ? ", accumulating" : ""));
        rng r(m * 7 + rows + cols);
        const auto w = random_quantized(r, type, rows, cols);
        const auto x = random_floats(r, m * cols, 2.0f);
        const auto y0 = random_floats(r, m * rows);
        auto host = y0;
        thread_pool pool(2);
        kernels::matmul(pool, x.data(), kernels::weight_view{type, rows, cols, w.data()}, host.data(), m,
                        acc ? kernels::accumulate::yes : kernels::accumulate::no);
        const auto device = test_cuda::matmul(type, w, rows, cols, x, m, y0, acc);
        const bool in_registers = m <= kernels::quant::decode_rows && cols % 8 == 0;
        if (in_registers) {
          std::size_t differ = 0;
          const std::size_t rb = row_bytes(type, cols);
          for (std::size_t j = 0; j < rows; ++j) {
            float sums[8];
            kernels::quant::warp_dots(type, reinterpret_cast<const std::uint8_t*>(w.data() + j * rb), cols, x.data(),
                                      static_cast<int>(m), sums);
            for (std::size_t i = 0; i < m; ++i) {
              const float want = acc ? y0[i * rows + j] + sums[i] : sums[i];
              if (std::memcmp(&want, &device[i * rows + j], sizeof want) != 0) ++differ;
            }
          }
          CHECK(differ == 0);
        }
        // Each output against the sum of its terms' magnitudes: f32 sums in another order, or x rounded
        // to the weights' 16-bit type by cuBLAS (2^-11 relative for f16, 2^-8 for bf16).
        const float bound = type == dtype::f32 || in_registers ? 1e-5f : type == dtype::f16 ? 1e-3f : 8e-3f;
        std::vector<float> dequantized(cols);
        float worst = 0;
        for (std::size_t i = 0; i < m; ++i)
          for (std::size_t j = 0; j < rows; ++j) {
            dequantize_row(type, w.data() + j * row_bytes(type, cols), dequantized.data(), cols);
            float magnitude = acc ? std::abs(y0[i * rows + j]) : 0.0f;
            for (std::size_t k = 0; k < cols; ++k) magnitude += std::abs(x[i * cols + k] * dequantized[k]);
            worst = std::max(worst, std::abs(device[i * rows + j] - host[i * rows + j]) / (magnitude + 1e-6f));
          }
        CHECK(worst < bound);
      }
}

namespace {
// The largest error of the device's y (m, rows) against the exact sum of x times the dequantized
// weights ([+ y0] [+ bias]), relative to the sum of the magnitudes of its terms.
double worst_relative(dtype type, const std::vector<std::byte>& w, std::size_t rows, std::size_t cols,
                      const std::vector<float>& x, std::size_t m, const std::vector<float>& y0, bool acc,
                      const std::vector<float>& bias, const std::vector<float>& device) {
  const std::size_t rb = row_bytes(type, cols);
  std::vector<float> dequantized(cols);
  double worst = 0;
  for (std::size_t j = 0; j < rows; ++j) {
    dequantize_row(type, w.data() + j * rb, dequantized.data(), cols);
    for (std::size_t i = 0; i < m; ++i) {
      double exact = acc ? y0[i * rows + j] : 0.0, magnitude = acc ? std::abs(y0[i * rows + j]) : 0.0;
      if (!bias.empty()) exact += bias[j], magnitude += std::abs(bias[j]);
      for (std::size_t k = 0; k < cols; ++k) {
        const double p = static_cast<double>(x[i * cols + k]) * dequantized[k];
        exact += p;
        magnitude += std::abs(p);
      }
      worst = std::max(worst, std::abs(device[i * rows + j] - exact) / (magnitude + 1e-6));
    }
  }
  return worst;
}
}  // namespace

// Quantized weights stay as the file stores them: the decode product (up to 8 x rows) is the lanes'
// sums of quant::lane_dots added as a warp adds them, which the host emulates bit for bit; prefill
// multiplies f16 slices of the dequantized weights (several slices for the largest matrix here) by x
// rounded to f16, within that rounding of the double-precision sum.
TEST_CASE("cuda: quantized weights kept as stored: decode equals its host emulation bit for bit, prefill the host",
          "[cuda][gpu]") {
  EFIM_NEED_DEVICE();
  for (const dtype type : {dtype::q8_0, dtype::q4_0, dtype::q5_0, dtype::q5_1, dtype::q4_k, dtype::q5_k, dtype::q6_k})
    for (const auto& [m, rows, cols] : std::vector<std::tuple<std::size_t, std::size_t, std::size_t>>{
             {1, 1, 256}, {1, 896, 1024}, {2, 37, 768}, {3, 300, 512}, {5, 64, 256}, {8, 130, 1536},
             {9, 70, 512}, {64, 300, 768}, {16, 33000, 1024}})
      for (const bool acc : {false, true}) {
        if (acc && rows > 10000) continue;  // (the three-slice matrix once: its host reference is the slow part)
        INFO(to_string(type) << " " << m << " x " << rows << " x " << cols << (acc ? ", accumulating" : ""));
        rng r(m * 7 + rows + cols);
        const std::size_t rb = row_bytes(type, cols);
        const auto w = random_quantized(r, type, rows, cols);
        const auto x = random_floats(r, m * cols, 2.0f);
        const auto y0 = random_floats(r, m * rows);
        const auto device = test_cuda::matmul(type, w, rows, cols, x, m, y0, acc);
        if (m <= kernels::quant::decode_rows) {
          std::size_t differ = 0;
          for (std::size_t j = 0; j < rows; ++j) {
            float sums[8];
            kernels::quant::warp_dots(type, reinterpret_cast<const std::uint8_t*>(w.data() + j * rb), cols, x.data(),
                                      static_cast<int>(m), sums);
            for (std::size_t i = 0; i < m; ++i) {
              const float v = sums[i];
              const float want = acc ? y0[i * rows + j] + v : v;
              if (std::memcmp(&want, &device[i * rows + j], sizeof want) != 0) ++differ;
            }
          }
          CHECK(differ == 0);
        } else {
          CHECK(worst_relative(type, w, rows, cols, x, m, y0, acc, {}, device) < 1e-3);
        }
      }
}

TEST_CASE("cuda: quantized products on tensor cores, the weights dequantized in shared memory, agree with the host",
          "[cuda][gpu]") {
  EFIM_NEED_DEVICE();
  using shape = std::tuple<std::size_t, std::size_t, std::size_t>;
  for (const dtype type : {dtype::q8_0, dtype::q4_0, dtype::q5_0, dtype::q5_1, dtype::q4_k, dtype::q5_k, dtype::q6_k}) {
    // x rows in one tile, several, two blocks of 64; weight rows past a block's; a last step of 96, 32
    // or 64 columns (k steps of 128) for the types of 32-weight blocks.
    std::vector<shape> shapes{{9, 70, 512},  {16, 130, 768}, {64, 300, 1024},
                              {65, 64, 256}, {100, 33, 256}, {1, 20, 256}};
    if (info(type).block == 32) shapes.insert(shapes.end(), {{12, 45, 96}, {20, 17, 160}, {33, 40, 192}});
    for (const auto& [m, rows, cols] : shapes)
      for (const int variant : {0, 1, 2}) {  // y written, y + bias, y accumulated + bias
        const bool acc = variant == 2, with_bias = variant > 0;
        INFO(to_string(type) << " " << m << " x " << rows << " x " << cols << (acc ? ", accumulating" : "")
                             << (with_bias ? ", bias" : ""));
        rng r(m * 11 + rows + cols);
        const auto w = random_quantized(r, type, rows, cols);
        const auto x = random_floats(r, m * cols, 2.0f);
        const auto y0 = random_floats(r, m * rows);
        const auto bias = with_bias ? random_floats(r, rows) : std::vector<float>{};
        const auto device = test_cuda::quant_tiles(type, w, rows, cols, x, m, y0, acc, bias);
        CHECK(worst_relative(type, w, rows, cols, x, m, y0, acc, bias, device) < 1e-3);  // x and w rounded to f16
        // x rounded to f16 before: the same bits
        const auto from_f16 = test_cuda::quant_tiles(type, w, rows, cols, x, m, y0, acc, bias, true);
        CHECK(std::memcmp(from_f16.data(), device.data(), device.size() * sizeof(float)) == 0);
        // An element's sum does not depend on m or on where its x row falls: the last rows alone, from
        // the first row of the first tile, give the same bits. (The kernel's order of sums is fixed; that
        // a tensor-core product's element does not depend on its row within the fragment is the
        // hardware's, which this checks on the GPU it runs on.)
        const std::size_t from = m / 2, tail = m - from;
        const auto alone =
            test_cuda::quant_tiles(type, w, rows, cols, std::vector<float>(x.begin() + from * cols, x.end()), tail,
                                   std::vector<float>(y0.begin() + from * rows, y0.end()), acc, bias);
        CHECK(std::memcmp(alone.data(), device.data() + from * rows, tail * rows * sizeof(float)) == 0);
      }
  }
  const std::vector<std::byte> dense(4 * 64 * 2);
  CHECK_THROWS_AS(
      test_cuda::quant_tiles(dtype::f16, dense, 4, 64, std::vector<float>(9 * 64), 9, std::vector<float>(9 * 4), false),
      efim::error);
}

namespace {
// Two roundings to 8 bits hold the same bytes: quants, scales (bit for bit) and sums.
bool same_x8(const kernels::quant::x8_host& a, const kernels::quant::x8_host& b) {
  return a.q == b.q && a.d.size() == b.d.size() && std::memcmp(a.d.data(), b.d.data(), a.d.size() * sizeof(float)) == 0 &&
         a.sums == b.sums;
}
}  // namespace

// The int8 decode product: x rounded to 8 bits on the device as the host's int8 products round it
// (kquant::quantize into q8_0 / q8_K blocks), byte for byte: per 32 and per 256, with an all-zero
// block, magnitudes tied between signs (the first one sets the sign of a q8_K scale) and a wide range.
TEST_CASE("cuda: activations rounded to 8 bits on the device are the host's bytes", "[cuda][gpu]") {
  EFIM_NEED_DEVICE();
  for (const dtype type : {dtype::q8_0, dtype::q4_k})
    for (const std::size_t m : {1, 3, 8}) {
      const std::size_t cols = 1024;
      INFO(to_string(type) << " m " << m);
      rng r(m + 90);
      auto x = random_floats(r, m * cols, 3.0f);
      for (std::size_t k = 0; k < 256; ++k) x[k] = 0.0f;  // a zero block of either span
      x[300] = 7.5f, x[301] = -7.5f, x[520] = -7.5f, x[600] = 7.5f;
      for (std::size_t k = 768; k < cols; ++k) x[k] *= 1e-6f;
      CHECK(same_x8(test_cuda::quantize_x8(type, x, m, cols), kernels::quant::make_x8(type, x.data(), m, cols)));
    }
}

// RMSNorm and the 8-bit rounding of its rows in one launch (rmsnorm_x8, what a decode step with int8
// products runs before its first product): the bits of the two kernels apart, per 32 and per 256, and
// the host's rounding of the device's normed rows.
TEST_CASE("cuda: RMSNorm fused with the 8-bit rounding gives the bits of the two apart", "[cuda][gpu]") {
  EFIM_NEED_DEVICE();
  for (const dtype type : {dtype::q8_0, dtype::q4_k})
    for (const auto& [rows, n] : std::vector<std::pair<std::size_t, std::size_t>>{{1, 896}, {3, 3584}, {8, 256}}) {
      if (n % kernels::quant::x8_span(type) != 0) continue;
      INFO(to_string(type) << " " << rows << " x " << n);
      rng r(rows * 13 + n);
      const auto x = random_floats(r, rows * n, 3.0f), weight = random_floats(r, n);
      for (const bool in_place : {false, true}) {  // (in place: as the output norm runs)
        INFO((in_place ? "in place" : "into another buffer"));
        std::vector<float> y_fused, y_apart;
        const auto fused = test_cuda::rmsnorm_x8(type, x, weight, rows, n, 1e-6f, true, in_place, y_fused);
        const auto apart = test_cuda::rmsnorm_x8(type, x, weight, rows, n, 1e-6f, false, in_place, y_apart);
        CHECK(std::memcmp(y_fused.data(), y_apart.data(), y_apart.size() * sizeof(float)) == 0);
        CHECK(same_x8(fused, apart));
        CHECK(same_x8(fused, kernels::quant::make_x8(type, y_fused.data(), rows, n)));
      }
    }
}

// The int8 decode product (products::int8, up to 8 x rows) is the lanes' sums of quant::lane_idots
// added as a warp adds them, which the host emulates bit for bit (and test_model bounds against the
// host's int8 products); a bias is added after, as add_bias adds it.
TEST_CASE("cuda: the int8 decode product equals its host emulation bit for bit", "[cuda][gpu]") {
  EFIM_NEED_DEVICE();
  for (const dtype type : {dtype::q8_0, dtype::q4_0, dtype::q5_0, dtype::q5_1, dtype::q4_k, dtype::q5_k, dtype::q6_k})
    for (const auto& [m, rows, cols] : std::vector<std::tuple<std::size_t, std::size_t, std::size_t>>{
             {1, 1, 256}, {1, 896, 1024}, {2, 37, 768}, {3, 300, 512}, {5, 64, 256}, {8, 130, 1536}, {7, 9, 9216}})
      for (const bool acc : {false, true}) {
        INFO(to_string(type) << " " << m << " x " << rows << " x " << cols << (acc ? ", accumulating" : ""));
        rng r(m * 5 + rows + cols);
        const std::size_t rb = row_bytes(type, cols);
        const auto w = random_quantized(r, type, rows, cols);
        const auto x = random_floats(r, m * cols, 2.0f);
        const auto y0 = random_floats(r, m * rows);
        const auto bias = acc ? random_floats(r, rows) : std::vector<float>{};  // added as add_bias adds it
        const auto device = test_cuda::matmul(type, w, rows, cols, x, m, y0, acc, kernels::products::int8, bias);
        const auto xq = kernels::quant::make_x8(type, x.data(), m, cols);
        std::size_t differ = 0;
        for (std::size_t j = 0; j < rows; ++j) {
          float sums[8];
          kernels::quant::warp_idots(type, reinterpret_cast<const std::uint8_t*>(w.data() + j * rb), xq.view(),
                                     static_cast<int>(m), sums);
          for (std::size_t i = 0; i < m; ++i) {
            const float v = sums[i];
            float want = acc ? y0[i * rows + j] + v : v;
            if (!bias.empty()) want += bias[j];
            if (std::memcmp(&want, &device[i * rows + j], sizeof want) != 0) ++differ;
          }
        }
        CHECK(differ == 0);
      }
}

// A decode step's FFN products and SwiGLU in one launch (quant_decode_swiglu): the bits of the two
// products (bias on the up product), then the SwiGLU kernel, with exact and int8 products.
TEST_CASE("cuda: the fused FFN decode (gate, up, SwiGLU) gives the bits of the three apart, quantized and dense",
          "[cuda][gpu]") {
  EFIM_NEED_DEVICE();
  for (const dtype type : {dtype::q8_0, dtype::q4_0, dtype::q5_0, dtype::q5_1, dtype::q4_k, dtype::q5_k, dtype::q6_k,
                           dtype::f16, dtype::bf16, dtype::f32})
    for (const auto products : {kernels::products::exact, kernels::products::int8})
      for (const auto& [m, cols] : std::vector<std::pair<std::size_t, std::size_t>>{{1, 512}, {1, 4608}, {3, 512}, {8, 1024}}) {
        if (products == kernels::products::int8 && !kernels::quant::kept_quantized(type))
          continue;  // (exact for dense)
        INFO(to_string(type) << (products == kernels::products::int8 ? " int8" : " exact") << " m " << m << " cols " << cols);
        const std::size_t rows = 300, rb = row_bytes(type, cols);
        rng r(m + rows + static_cast<std::size_t>(type));
        std::vector<std::byte> gate(rows * rb), up(rows * rb);
        const auto gv = random_floats(r, rows * cols), uv = random_floats(r, rows * cols);
        for (std::size_t i = 0; i < rows; ++i) {
          quantize_row(type, gv.data() + i * cols, gate.data() + i * rb, cols);
          quantize_row(type, uv.data() + i * cols, up.data() + i * rb, cols);
        }
        const auto x = random_floats(r, m * cols, 2.0f);
        for (const bool with_bias : {false, true}) {
          const auto bias = with_bias ? random_floats(r, rows) : std::vector<float>{};
          const auto fused = test_cuda::ffn_gate_up(type, gate, up, rows, cols, x, m, bias, products, true);
          const auto apart = test_cuda::ffn_gate_up(type, gate, up, rows, cols, x, m, bias, products, false);
          REQUIRE(fused.size() == apart.size());
          CHECK(std::memcmp(fused.data(), apart.data(), fused.size() * sizeof(float)) == 0);
        }
      }
}

// A one-sequence decode step's q, k and v of one type in one launch: each matrix's products the bits
// of its product alone, exact and int8, with and without biases, parts of uneven sizes (the last block
// of a part's warps partly idle); one launch takes one x row only.
TEST_CASE("cuda: several decode products in one launch give the bits of each apart", "[cuda][gpu]") {
  EFIM_NEED_DEVICE();
  for (const dtype type : {dtype::q8_0, dtype::q4_0, dtype::q5_0, dtype::q5_1, dtype::q4_k, dtype::q5_k, dtype::q6_k,
                           dtype::f16, dtype::bf16, dtype::f32})
    for (const auto products : {kernels::products::exact, kernels::products::int8})
      for (const auto& [m, rows] : std::vector<std::pair<std::size_t, std::vector<std::size_t>>>{
               {1, {896, 130, 130}}, {1, {257, 31, 66}}, {1, {64, 64}}, {1, {3}}, {2, {64, 64}}}) {
        if (products == kernels::products::int8 && !kernels::quant::kept_quantized(type))
          continue;  // (exact for dense)
        const std::size_t cols = 512;
        INFO(to_string(type) << (products == kernels::products::int8 ? " int8" : " exact") << " m " << m << ", "
                             << rows.size() << " parts");
        rng r(m + rows[0] + static_cast<std::size_t>(type));
        const std::size_t rb = row_bytes(type, cols);
        std::vector<std::vector<std::byte>> ws;
        for (const std::size_t n : rows) {
          const auto values = random_floats(r, n * cols);
          auto& w = ws.emplace_back(n * rb);
          for (std::size_t i = 0; i < n; ++i) quantize_row(type, values.data() + i * cols, w.data() + i * rb, cols);
        }
        const auto x = random_floats(r, m * cols, 2.0f);
        for (const bool with_bias : {false, true}) {
          std::vector<std::vector<float>> biases;
          for (const std::size_t n : rows) biases.push_back(with_bias ? random_floats(r, n) : std::vector<float>{});
          const std::vector<dtype> types(rows.size(), type);
          if (m > 1 && rows.size() > 1) {
            CHECK_THROWS_AS(test_cuda::matmul_parts(types, ws, rows, cols, x, m, biases, products, true), error);
            continue;
          }
          const auto one = test_cuda::matmul_parts(types, ws, rows, cols, x, m, biases, products, true);
          const auto apart = test_cuda::matmul_parts(types, ws, rows, cols, x, m, biases, products, false);
          REQUIRE(one.size() == apart.size());
          for (std::size_t k = 0; k < one.size(); ++k) {
            REQUIRE(one[k].size() == apart[k].size());
            CHECK(std::memcmp(one[k].data(), apart[k].data(), one[k].size() * sizeof(float)) == 0);
          }
        }
      }
}

// A llama.cpp mix's q, k and v at one decode row: q and k of the base type, v of its type of more bits
// (q4_k / q5_k and q6_k; q5_0 / q5_1 and q8_0 where rows are not whole super-blocks), multiplied in one
// int8 launch: each matrix's products the bits of its product alone. Exact products, and types that
// are no such pair, are refused one launch.
TEST_CASE("cuda: a mix's q, k and v of two types in one int8 launch give the bits of each apart", "[cuda][gpu]") {
  EFIM_NEED_DEVICE();
  struct mix {
    dtype base, more;
  };
  for (const mix t : {mix{dtype::q4_k, dtype::q6_k}, mix{dtype::q5_k, dtype::q6_k}, mix{dtype::q5_0, dtype::q8_0},
                      mix{dtype::q5_1, dtype::q8_0}})
    for (const auto& [types, rows] : std::vector<std::pair<std::vector<dtype>, std::vector<std::size_t>>>{
             {{t.base, t.base, t.more}, {896, 130, 130}},
             {{t.base, t.more, t.more}, {257, 31, 66}},
             {{t.base, t.more}, {64, 5}}}) {
      const std::size_t cols = 512;
      INFO(to_string(t.base) << " + " << to_string(t.more) << ", " << rows.size() << " parts");
      rng r(rows[0] + static_cast<std::size_t>(t.base));
      std::vector<std::vector<std::byte>> ws;
      for (std::size_t k = 0; k < rows.size(); ++k) {
        const std::size_t rb = row_bytes(types[k], cols);
        const auto values = random_floats(r, rows[k] * cols);
        auto& w = ws.emplace_back(rows[k] * rb);
        for (std::size_t i = 0; i < rows[k]; ++i)
          quantize_row(types[k], values.data() + i * cols, w.data() + i * rb, cols);
      }
      const auto x = random_floats(r, cols, 2.0f);
      std::vector<std::vector<float>> biases;
      for (const std::size_t n : rows) biases.push_back(random_floats(r, n));
      const auto one = test_cuda::matmul_parts(types, ws, rows, cols, x, 1, biases, kernels::products::int8, true);
      const auto apart = test_cuda::matmul_parts(types, ws, rows, cols, x, 1, biases, kernels::products::int8, false);
      REQUIRE(one.size() == apart.size());
      for (std::size_t k = 0; k < one.size(); ++k) {
        REQUIRE(one[k].size() == apart[k].size());
        CHECK(std::memcmp(one[k].data(), apart[k].data(), one[k].size() * sizeof(float)) == 0);
      }
      CHECK_THROWS_AS(test_cuda::matmul_parts(types, ws, rows, cols, x, 1, biases, kernels::products::exact, true),
                      error);
    }
  // Not a pair: the second type first, or two types of different spans.
  const std::size_t cols = 512;
  rng r(3);
  for (const auto& types : {std::vector<dtype>{dtype::q6_k, dtype::q4_k}, std::vector<dtype>{dtype::q4_k, dtype::q8_0},
                            std::vector<dtype>{dtype::q4_k, dtype::q6_k, dtype::q4_k}}) {
    std::vector<std::vector<std::byte>> ws;
    std::vector<std::size_t> rows;
    for (const dtype t : types) {
      const auto values = random_floats(r, 4 * cols);
      auto& w = ws.emplace_back(4 * row_bytes(t, cols));
      for (std::size_t i = 0; i < 4; ++i)
        quantize_row(t, values.data() + i * cols, w.data() + i * row_bytes(t, cols), cols);
      rows.push_back(4);
    }
    const std::vector<std::vector<float>> biases(types.size());
    CHECK_THROWS_AS(test_cuda::matmul_parts(types, ws, rows, cols, random_floats(r, cols, 2.0f), 1, biases,
                                            kernels::products::int8, true),
                    error);
  }
}

namespace {

// Owned tokens and tables for the passes the decoder tests run: sequence s has `lengths[s]` tokens,
// its own blocks; a pass computes, for each sequence, the positions [from, to).
struct passes_spec {
  std::vector<std::vector<token_id>> tokens;
  std::vector<std::vector<block_id>> tables;
  std::vector<std::vector<model::batch_item>> passes;

  passes_spec(const model::config& c, const std::vector<std::size_t>& lengths, std::size_t block_size, rng& r) {
    block_id next = 0;
    for (const std::size_t n : lengths) {
      auto& t = tokens.emplace_back();
      for (std::size_t i = 0; i < n; ++i) t.push_back(static_cast<token_id>(r.below(c.vocab)));
      auto& table = tables.emplace_back();
      for (std::size_t b = 0; b < (n + block_size - 1) / block_size; ++b) table.push_back(next++);
    }
  }
  // One pass: sequence s from position ranges[s].first to ranges[s].second (empty: not in the pass).
  void add(const std::vector<std::pair<std::size_t, std::size_t>>& ranges) {
    auto& items = passes.emplace_back();
    for (std::size_t s = 0; s < ranges.size(); ++s) {
      const auto [from, to] = ranges[s];
      if (from == to) continue;
      items.push_back({std::span<const token_id>(tokens[s]).subspan(from, to - from), static_cast<position>(from),
                       tables[s], true});
    }
  }
};

std::vector<std::vector<float>> host_forward(const model::weights& w, dtype kv_type, std::size_t blocks,
                                             std::size_t block_size,
                                             const std::vector<std::vector<model::batch_item>>& passes,
                                             kernels::products products = kernels::products::exact) {
  thread_pool pool(2);
  kernels::host::context ctx{pool};
  model::transformer<kernels::host> m(w, products);
  kv::host_storage kv(w.cfg.layers, m.kv_layout(blocks, block_size), kv_type);
  std::vector<std::vector<float>> out;
  for (const auto& items : passes) m.forward(ctx, kv, items, out.emplace_back());
  return out;
}

// The largest |a - b| over a pass's logits, against the largest |b|.
float logit_error(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  float worst = 0, top = 1e-6f;
  for (std::size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, std::abs(a[i] - b[i]));
    top = std::max(top, std::abs(b[i]));
  }
  return worst / top;
}

// Rows of whole blocks of `weights` (super-blocks of 256 for the k-quants).
model::config decoder_config(model::architecture arch, dtype weights = dtype::f16) {
  auto c = model::for_architecture(arch);
  c.vocab = 300;
  c.hidden = info(weights).block == 256 ? 256 : 128;
  c.layers = 2;
  c.heads = 8;
  c.kv_heads = 2;
  c.ffn = 2 * c.hidden;
  c.max_context = 512;
  return c;
}

// The bound on logit_error for weights of `type` (f32 sums in another order; 16-bit types: the
// activations are rounded to the weights' type for cuBLAS; block-quantized types go up as f16).
float logit_bound(dtype type) { return type == dtype::f32 ? 1e-4f : type == dtype::bf16 ? 3e-2f : 1e-2f; }

}  // namespace

TEST_CASE("cuda: the decoder's logits equal the host's (every architecture, weight and KV type)", "[cuda][gpu][model]") {
  EFIM_NEED_DEVICE();
  for (const auto arch : {model::architecture::llama, model::architecture::qwen2, model::architecture::starcoder2})
    for (const auto type : all_dtypes)
      for (const auto kv_type : {dtype::f32, dtype::f16}) {
        INFO(model::to_string(arch) << ", " << to_string(type) << " weights, " << to_string(kv_type) << " KV");
        const auto c = decoder_config(arch, type);
        const auto w = model::random_weights(c, 7, {type, arch == model::architecture::qwen2});
        rng r(11);
        passes_spec spec(c, {70, 33, 1}, 16, r);
        spec.add({{0, 50}, {0, 33}, {0, 1}});  // prefill of three sequences in one pass
        spec.add({{50, 51}});                   // decode
        spec.add({{51, 70}});                   // a chunk over cached context
        const auto device = test_cuda::forward(w, kv_type, 64, 16, spec.passes);
        const auto host = host_forward(w, kv_type, 64, 16, spec.passes);
        for (std::size_t i = 0; i < host.size(); ++i) {
          INFO("pass " << i);
          CHECK(logit_error(device[i], host[i]) < logit_bound(type));
        }
        // The decode attention by the rows kernel (its own split plan, graphs keyed apart), and by the
        // staged kernel (f16 KV; f32 KV runs the pages kernel for it).
        const auto rows =
            test_cuda::forward(w, kv_type, 64, 16, spec.passes, {.decode_attention = test_cuda::decode_kernel::rows});
        const auto staged =
            test_cuda::forward(w, kv_type, 64, 16, spec.passes, {.decode_attention = test_cuda::decode_kernel::staged});
        for (std::size_t i = 0; i < host.size(); ++i) {
          INFO("pass " << i << ", rows and staged decode attention kernels");
          CHECK(logit_error(rows[i], host[i]) < logit_bound(type));
          CHECK(logit_error(staged[i], host[i]) < std::max(logit_bound(type), 1e-3f));
        }
        if (kv_type == dtype::f16) {  // prefill attention on tensor cores too (these steps are too small to take it)
          // (Queries and probabilities rounded to f16: a host emulation put qwen2's f32 logits 3.3e-4 off.)
          for (const bool staged : {false, true}) {
            const auto tensor = test_cuda::forward(w, kv_type, 64, 16, spec.passes,
                                                   {.tensor_cores_always = true, .staged_attention = staged});
            for (std::size_t i = 0; i < host.size(); ++i) {
              INFO("pass " << i << ", tensor-core attention, " << (staged ? "staged" : "WMMA"));
              CHECK(logit_error(tensor[i], host[i]) < std::max(logit_bound(type), 1e-3f));
            }
          }
        }
      }
}

// With int8 products the device rounds the activations of every product of up to 8 rows to 8 bits
// (prefill stays on f16 slices), the host those of every product. Over passes of decode steps alone
// both multiply the same integers: the logits differ from the exact ones', and agree with the host's
// int8 logits but for an activation whose f32 value, a few ulps apart on the two sides (sums in
// another order), lies at a rounding boundary: one 8-bit step (1/127 of its block's largest) moves
// these small random models' logits by about what the f16 rounding of the exact test moves them
// (1.05e-2 seen for q5_k on an H200, where the host's own int8 logits are 1.3e-2 to 3.7e-2 from its
// exact ones), so the bound is twice the exact products'.
TEST_CASE("cuda: the decoder with int8 products: decode logits equal the host's int8 logits", "[cuda][gpu][model]") {
  EFIM_NEED_DEVICE();
  for (const auto type : {dtype::q8_0, dtype::q4_0, dtype::q5_0, dtype::q5_1, dtype::q4_k, dtype::q5_k, dtype::q6_k}) {
    INFO(to_string(type) << " weights");
    const auto c = decoder_config(model::architecture::qwen2, type);
    const auto w = model::random_weights(c, 7, {type, true});
    rng r(13);
    passes_spec spec(c, {9, 6}, 16, r);
    for (std::size_t i = 0; i < 9; ++i)  // decode steps of two rows, then of one (the fused FFN kernel)
      spec.add({{i, i + 1}, i < 6 ? std::pair<std::size_t, std::size_t>{i, i + 1} : std::pair<std::size_t, std::size_t>{}});
    const auto int8 = test_cuda::forward(w, dtype::f32, 64, 16, spec.passes, {.products = kernels::products::int8});
    const auto exact = test_cuda::forward(w, dtype::f32, 64, 16, spec.passes);
    const auto host = host_forward(w, dtype::f32, 64, 16, spec.passes, kernels::products::int8);
    const auto host_exact = host_forward(w, dtype::f32, 64, 16, spec.passes);
    float off = 0, rounding = 0;  // over the passes: from the host's int8 logits, and its exact ones from them
    for (std::size_t i = 0; i < host.size(); ++i) {
      INFO("pass " << i);
      CHECK(int8[i] != exact[i]);  // the integer products ran
      CHECK(logit_error(int8[i], host[i]) < 2 * logit_bound(type));
      off += logit_error(int8[i], host[i]);
      rounding += logit_error(host_exact[i], host[i]);
    }
    // The device's int8 logits follow the host's int8 numerics, not the exact ones: on average nearer
    // to them than half of what the 8-bit rounding moves the host's.
    CHECK(off < 0.5f * rounding);
  }
}

// Decode steps run as CUDA graphs (captured once per step shape, replayed after) give the bits of the
// same kernels launched one by one: over steps whose batch shrinks from two sequences to one, whose
// contexts cross pages (the attention split changes with them), with f16 and quantized weights (int8
// products too), f16 and f32 KV.
TEST_CASE("cuda: decode steps replayed as CUDA graphs give the bits of eager launches", "[cuda][gpu][model]") {
  EFIM_NEED_DEVICE();
  for (const auto type : {dtype::f16, dtype::q4_k})
    for (const auto products : {kernels::products::exact, kernels::products::int8})
      for (const auto kv_type : {dtype::f16, dtype::f32}) {
        if (type == dtype::f16 && products == kernels::products::int8) continue;
        INFO(to_string(type) << (products == kernels::products::int8 ? " int8" : " exact") << ", "
                             << to_string(kv_type) << " KV");
        const auto c = decoder_config(model::architecture::qwen2, type);
        const auto w = model::random_weights(c, 5, {type, true});
        rng r(17);
        passes_spec spec(c, {100, 60}, 16, r);
        spec.add({{0, 40}, {0, 40}});  // prefill (eager)
        for (std::size_t i = 40; i < 100; ++i)
          spec.add({{i, i + 1}, i < 60 ? std::pair<std::size_t, std::size_t>{i, i + 1} : std::pair<std::size_t, std::size_t>{}});
        test_cuda::graph_stats stats;
        const auto graphed = test_cuda::forward(w, kv_type, 64, 16, spec.passes, {.products = products, .stats = &stats});
        const auto eager = test_cuda::forward(w, kv_type, 64, 16, spec.passes, {.products = products, .graphs = false});
        std::size_t differ = 0;
        for (std::size_t i = 0; i < eager.size(); ++i)
          if (graphed[i].size() != eager[i].size() ||
              std::memcmp(graphed[i].data(), eager[i].data(), eager[i].size() * sizeof(float)) != 0)
            ++differ;
        CHECK(differ == 0);
        CHECK(stats.direct + stats.captures + stats.replays == 60);  // every decode step, none of the prefill
        CHECK(stats.replays > stats.captures + stats.direct);
        // The same with the rows and the staged decode attention kernels (their split plans change
        // every 32 and 64 keys).
        for (const auto kernel : {test_cuda::decode_kernel::rows, test_cuda::decode_kernel::staged}) {
          INFO((kernel == test_cuda::decode_kernel::rows ? "rows" : "staged") << " decode attention kernel");
          const auto k_graphed =
              test_cuda::forward(w, kv_type, 64, 16, spec.passes, {.products = products, .decode_attention = kernel});
          const auto k_eager = test_cuda::forward(w, kv_type, 64, 16, spec.passes,
                                                  {.products = products, .graphs = false, .decode_attention = kernel});
          differ = 0;
          for (std::size_t i = 0; i < k_eager.size(); ++i)
            if (k_graphed[i].size() != k_eager[i].size() ||
                std::memcmp(k_graphed[i].data(), k_eager[i].data(), k_eager[i].size() * sizeof(float)) != 0)
              ++differ;
          CHECK(differ == 0);
        }
      }
}

// The graph cache itself, with room for one graph over steps of changing sizes: a size's first step
// runs directly, its second is captured (into the one slot, updated in place from the graph of another
// size), its later ones replay; every step's bits are those of launching the same ops directly.
TEST_CASE("cuda: a graph cache replays, captures and updates with the bits of direct launches", "[cuda][gpu]") {
  EFIM_NEED_DEVICE();
  const std::vector<std::size_t> sizes{1000, 1000, 1000, 5000, 5000, 1000, 1000, 5000, 70000, 70000, 70000};
  std::vector<std::vector<float>> graphed, eager;
  test_cuda::graph_stats stats;
  test_cuda::graph_cache_steps(1, sizes, graphed, eager, stats);
  REQUIRE(graphed.size() == sizes.size());
  REQUIRE(eager.size() == sizes.size());
  std::size_t differ = 0;
  for (std::size_t i = 0; i < sizes.size(); ++i)
    if (std::memcmp(graphed[i].data(), eager[i].data(), sizes[i] * sizeof(float)) != 0) ++differ;
  CHECK(differ == 0);
  // 1000: direct, captured, replayed; 5000: direct, captured (the slot updated); 1000: captured again
  // (updated), replayed; 5000: captured (updated); 70000: direct, captured (updated), replayed.
  CHECK(stats.direct == 3);
  CHECK(stats.captures == 5);
  CHECK(stats.replays == 3);
  CHECK(stats.updates == 4);
}

TEST_CASE("cuda: chunked prefill equals one pass, a batch equals each sequence alone", "[cuda][gpu][model]") {
  EFIM_NEED_DEVICE();
  const auto c = decoder_config(model::architecture::qwen2);
  const auto w = model::random_weights(c, 3, {dtype::f16});
  rng r(5);
  passes_spec whole(c, {200, 90}, 16, r);
  whole.add({{0, 200}, {0, 90}});
  passes_spec chunked = whole, alone = whole;
  chunked.passes.clear();
  chunked.add({{0, 64}, {0, 64}});
  chunked.add({{64, 128}, {64, 90}});
  chunked.add({{128, 200}, {}});
  alone.passes.clear();
  alone.add({{0, 200}, {}});
  alone.add({{}, {0, 90}});
  const auto one = test_cuda::forward(w, dtype::f16, 64, 16, whole.passes);
  const auto parts = test_cuda::forward(w, dtype::f16, 64, 16, chunked.passes);
  const auto each = test_cuda::forward(w, dtype::f16, 64, 16, alone.passes);
  const std::size_t v = c.vocab;
  const std::vector<float> first(one[0].begin(), one[0].begin() + v), second(one[0].begin() + v, one[0].end());
  // Chunked: sequence 1 ends in pass 1 (its second row), sequence 0 in pass 2.
  CHECK(logit_error(std::vector<float>(parts[1].begin() + v, parts[1].end()), second) < 1e-3f);
  CHECK(logit_error(parts[2], first) < 1e-3f);
  CHECK(logit_error(each[0], first) < 1e-3f);
  CHECK(logit_error(each[1], second) < 1e-3f);
  CHECK(kernels::argmax(parts[2]) == kernels::argmax(first));
}

TEST_CASE("cuda: the pipeline on the GPU: a cache hit gives the tokens of a recompute, and the host's tokens",
          "[cuda][gpu][model]") {
  EFIM_NEED_DEVICE();
  const auto w = efim_test::small_weights();
  std::vector<engine::request> requests;
  for (const char* prefix : {"def add(a, b):\n    return ", "def add(a, b):\n    return ", "x = [1, 2, 3]\nfor "}) {
    engine::request req;
    req.infill = true;
    req.prefix = prefix;
    req.suffix = "\n\nprint(add(1, 2))\n";
    req.max_tokens = 24;
    requests.push_back(req);
  }
  auto cached = efim_test::small_options();
  auto fresh = efim_test::small_options(256, false);
  const auto hit = test_cuda::complete_each(w, cached, requests);
  const auto miss = test_cuda::complete_each(w, fresh, requests);
  REQUIRE(hit.size() == 3);
  CHECK(hit[1].cached_tokens > 0);  // the repeated request found its prompt in the device cache
  CHECK(miss[1].cached_tokens == 0);
  efim_test::efim_pipeline host(efim_test::qwen_tokenizer(), w, fresh);
  for (std::size_t i = 0; i < requests.size(); ++i) {
    INFO("request " << i);
    CHECK(hit[i].tokens == miss[i].tokens);
    engine::completion h;
    host.submit(requests[i], {{}, [&](engine::completion&& c) { h = std::move(c); }});
    host.run();
    CHECK(hit[i].tokens == h.tokens);  // f32 weights and KV: the greedy tokens of the host backend
    CHECK(hit[i].text == h.text);
  }
}
