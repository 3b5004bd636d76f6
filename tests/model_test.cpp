// kv/, kernels/ and model/: the host backend against plain references.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <numeric>
#include <vector>

#include "efim/core/error.hpp"
#include "efim/core/random.hpp"
#include "efim/core/thread_pool.hpp"
#include "efim/kernels/host.hpp"
#include "efim/kv/host_storage.hpp"
#include "efim/model/reference.hpp"
#include "efim/model/transformer.hpp"

using namespace efim;

namespace {
std::vector<float> random_vector(rng& r, std::size_t n) {
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(r.normal());
  return v;
}

float max_relative_error(const std::vector<float>& got, const std::vector<float>& want) {
  REQUIRE(got.size() == want.size());
  float scale = 0.0f, err = 0.0f;
  for (std::size_t i = 0; i < got.size(); ++i) {
    scale = std::max(scale, std::abs(want[i]));
    err = std::max(err, std::abs(got[i] - want[i]));
  }
  return scale == 0.0f ? err : err / scale;
}

model::config small_config(std::size_t hidden = 64) {
  model::config c;
  c.vocab = 50;
  c.hidden = hidden;
  c.layers = 2;
  c.heads = 4;
  c.kv_heads = 2;
  c.ffn = 96;
  c.max_context = 256;
  return c;
}

std::vector<token_id> random_tokens(rng& r, std::size_t n, std::size_t vocab) {
  std::vector<token_id> t(n);
  for (auto& x : t) x = static_cast<token_id>(r.below(vocab));
  return t;
}

// Runs a sequence through the transformer in the given chunks; returns the logits of every chunk's last token.
std::vector<std::vector<float>> run_chunks(model::transformer<kernels::host>& m, kernels::host::context& ctx,
                                           kv::host_storage& kv, const std::vector<token_id>& tokens,
                                           const std::vector<block_id>& table, const std::vector<std::size_t>& chunks,
                                           std::size_t start = 0) {
  std::vector<std::vector<float>> out;
  std::vector<float> logits;
  std::size_t pos = start;
  for (const std::size_t n : chunks) {
    const model::batch_item item{std::span(tokens).subspan(pos, n), static_cast<position>(pos), table, true};
    m.forward(ctx, kv, std::span(&item, 1), logits);
    out.push_back(logits);
    pos += n;
  }
  return out;
}

std::vector<float> reference_row(const std::vector<float>& all, std::size_t row, std::size_t vocab) {
  return {all.begin() + static_cast<std::ptrdiff_t>(row * vocab),
          all.begin() + static_cast<std::ptrdiff_t>((row + 1) * vocab)};
}
}  // namespace

TEST_CASE("matmul equals the plain triple loop, and a row never depends on the batch", "[kernels][matmul]") {
  thread_pool pool(2);
  rng r(1);
  struct shape {
    std::size_t m, n, k;
  };
  for (const auto [m, n, k] :
       {shape{1, 1, 1}, shape{5, 7, 33}, shape{9, 64, 64}, shape{17, 50, 96}, shape{3, 130, 17}}) {
    const auto x = random_vector(r, m * k), w = random_vector(r, n * k);
    std::vector<float> y(m * n), want(y.size());
    for (std::size_t i = 0; i < m; ++i)
      for (std::size_t j = 0; j < n; ++j) {
        double s = 0;
        for (std::size_t t = 0; t < k; ++t) s += static_cast<double>(x[i * k + t]) * w[j * k + t];
        want[i * n + j] = static_cast<float>(s);
      }
    kernels::matmul(pool, x.data(), w.data(), y.data(), m, n, k);
    CHECK(max_relative_error(y, want) < 1e-5f);
    // Each row alone gives the same bits as in the batch.
    for (std::size_t i = 0; i < m; ++i) {
      std::vector<float> row(n);
      kernels::matmul(pool, x.data() + i * k, w.data(), row.data(), 1, n, k);
      CHECK(std::equal(row.begin(), row.end(), y.begin() + static_cast<std::ptrdiff_t>(i * n)));
    }
    // Accumulating adds onto what is there.
    auto acc = y;
    kernels::matmul(pool, x.data(), w.data(), acc.data(), m, n, k, kernels::accumulate::yes);
    for (std::size_t i = 0; i < y.size(); ++i) CHECK(acc[i] == y[i] + y[i]);
  }
}

TEST_CASE("rmsnorm, rope and swiglu match their definitions", "[kernels]") {
  rng r(2);
  const std::size_t n = 40;
  const auto x = random_vector(r, 2 * n), g = random_vector(r, n);
  std::vector<float> y(2 * n);
  kernels::rmsnorm(x.data(), g.data(), y.data(), 2, n, 1e-5f);
  for (std::size_t row = 0; row < 2; ++row) {
    double ss = 0;
    for (std::size_t i = 0; i < n; ++i) ss += static_cast<double>(x[row * n + i]) * x[row * n + i];
    const double inv = 1.0 / std::sqrt(ss / n + 1e-5);
    for (std::size_t i = 0; i < n; ++i) CHECK(y[row * n + i] == Approx(x[row * n + i] * inv * g[i]).epsilon(1e-5));
  }

  // RoPE rotates each pair by pos * theta^(-2i/d); the two layouts pair different elements.
  const std::size_t d = 8;
  const std::vector<position> pos{0, 3};
  std::vector<float> cs(2 * d / 2), sn(2 * d / 2);
  kernels::rope_table(pos, d, 10000.0, cs.data(), sn.data());
  for (const auto style : {kernels::rope_style::adjacent, kernels::rope_style::neox}) {
    auto v = random_vector(r, 2 * d);
    const auto orig = v;
    kernels::rope(v.data(), 2, 1, d, cs.data(), sn.data(), style);
    for (std::size_t i = 0; i < d / 2; ++i) {
      const std::size_t a = style == kernels::rope_style::adjacent ? 2 * i : i;
      const std::size_t b = style == kernels::rope_style::adjacent ? 2 * i + 1 : i + d / 2;
      CHECK(v[a] == orig[a]);  // position 0 is not rotated
      const double angle = 3.0 * std::pow(10000.0, -2.0 * i / d);
      CHECK(v[d + a] == Approx(orig[d + a] * std::cos(angle) - orig[d + b] * std::sin(angle)).margin(1e-6));
      CHECK(v[d + b] == Approx(orig[d + a] * std::sin(angle) + orig[d + b] * std::cos(angle)).margin(1e-6));
    }
  }

  const std::vector<float> gate{-2.0f, 0.0f, 3.0f}, up{1.0f, 5.0f, -1.0f};
  std::vector<float> h(3);
  kernels::swiglu(gate.data(), up.data(), h.data(), 3);
  for (std::size_t i = 0; i < 3; ++i) CHECK(h[i] == Approx(gate[i] / (1 + std::exp(-gate[i])) * up[i]));
}

TEST_CASE("exp16 matches std::exp over the softmax range", "[kernels]") {
  double worst = 0;
  for (float x0 = -90.0f; x0 < 1.0f; x0 += 0.37f) {
    float v[16];
    for (int i = 0; i < 16; ++i) v[i] = x0 + 0.0231f * static_cast<float>(i);
    float e[16];
    std::copy(v, v + 16, e);
    kernels::detail::exp16(e);
    for (int i = 0; i < 16; ++i) {
      if (v[i] < -87.3f) continue;  // clamped
      const double want = std::exp(static_cast<double>(v[i]));
      worst = std::max(worst, std::abs(e[i] - want) / want);
    }
  }
  CHECK(worst < 3e-7);
  float zero[16] = {};
  kernels::detail::exp16(zero);
  CHECK(zero[0] == 1.0f);
}

TEST_CASE("sampling: greedy, top-k, top-p and seeded draws", "[kernels][sampling]") {
  const std::vector<float> logits{1.0f, 3.0f, 3.0f, 0.5f, 2.0f};
  CHECK(kernels::argmax(logits) == 1);  // lowest id among ties
  std::vector<std::pair<float, token_id>> scratch;
  CHECK(kernels::sample(logits, 0.0f, 0, 1.0f, 0.99, scratch) == 1);
  CHECK(kernels::sample(logits, 1.0f, 1, 1.0f, 0.99, scratch) == 1);   // top-1 is greedy
  CHECK(kernels::sample(logits, 1.0f, 0, 0.01f, 0.99, scratch) == 1);  // tiny nucleus keeps the top token
  for (const double u : {0.0, 0.3, 0.6, 0.9999}) {
    const token_id t = kernels::sample(logits, 1.0f, 3, 1.0f, u, scratch);
    CHECK((t == 1 || t == 2 || t == 4));  // top-3
  }
  // Frequencies follow softmax(logits / T).
  rng r(5);
  std::vector<int> counts(logits.size());
  const int draws = 40000;
  for (int i = 0; i < draws; ++i)
    ++counts[static_cast<std::size_t>(kernels::sample(logits, 0.7f, 0, 1.0f, r.uniform(), scratch))];
  double z = 0;
  for (const float l : logits) z += std::exp(l / 0.7);
  for (std::size_t i = 0; i < logits.size(); ++i)
    CHECK(counts[i] / static_cast<double>(draws) == Approx(std::exp(logits[i] / 0.7) / z).margin(0.01));
}

TEST_CASE("paged attention equals dense attention for random block tables", "[kernels][attention]") {
  thread_pool pool(2);
  rng r(3);
  // (heads, kv heads): grouped, one KV head per query head, and groups larger than a tile of 8 rows.
  for (const auto& [heads, kv_heads, block_size] : {std::tuple<std::size_t, std::size_t, std::size_t>{4, 2, 1},
                                                    {4, 2, 3},
                                                    {4, 2, 16},
                                                    {3, 3, 16},
                                                    {12, 1, 16},
                                                    {24, 2, 5}}) {
    const std::size_t d = 12, len = 37;
    const std::size_t blocks_needed = (len + block_size - 1) / block_size;
    const kv::paged_layout layout{blocks_needed + 5, kv_heads, block_size, d};
    // Dense K/V (position, kv_head, dim) and queries for every position.
    const auto k = random_vector(r, len * kv_heads * d), v = random_vector(r, len * kv_heads * d);
    const auto q = random_vector(r, len * heads * d);
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));

    std::vector<float> want(len * heads * d, 0.0f);
    for (std::size_t t = 0; t < len; ++t)
      for (std::size_t h = 0; h < heads; ++h) {
        const std::size_t g = h / (heads / kv_heads);
        std::vector<double> p(t + 1);
        double top = -1e30, z = 0;
        for (std::size_t j = 0; j <= t; ++j) {
          double s = 0;
          for (std::size_t i = 0; i < d; ++i)
            s += static_cast<double>(q[(t * heads + h) * d + i]) * k[(j * kv_heads + g) * d + i];
          p[j] = s * scale;
          top = std::max(top, p[j]);
        }
        for (auto& x : p) z += x = std::exp(x - top);
        for (std::size_t j = 0; j <= t; ++j)
          for (std::size_t i = 0; i < d; ++i)
            want[(t * heads + h) * d + i] += static_cast<float>(p[j] / z * v[(j * kv_heads + g) * d + i]);
      }

    const auto run = [&](const std::vector<block_id>& table) {
      std::vector<float> kc(layout.elements()), vc(layout.elements()), out(len * heads * d);
      std::vector<kernels::token_slot> slots(len);
      for (std::size_t t = 0; t < len; ++t) slots[t] = {table, static_cast<position>(t)};
      kernels::kv_write(layout, kc.data(), vc.data(), k.data(), v.data(), slots);
      kernels::paged_attention(pool, layout, kc.data(), vc.data(), q.data(), out.data(), slots, heads, scale);
      return out;
    };
    std::vector<block_id> identity(layout.blocks);
    std::iota(identity.begin(), identity.end(), block_id{0});
    const auto in_order = run(identity);
    CHECK(max_relative_error(in_order, want) < 1e-5f);
    for (int trial = 0; trial < 3; ++trial) {
      auto shuffled = identity;
      for (std::size_t i = shuffled.size(); i > 1; --i) std::swap(shuffled[i - 1], shuffled[r.below(i)]);
      CHECK(run(shuffled) == in_order);  // bit-identical wherever the blocks lie
    }
  }
}

TEST_CASE("paged attention refuses head counts that do not group over the KV heads", "[kernels][attention]") {
  thread_pool pool(1);
  const std::size_t d = 4;
  for (const auto& [heads, kv_heads] : {std::pair<std::size_t, std::size_t>{6, 4}, {3, 4}, {4, 0}}) {
    const kv::paged_layout layout{2, kv_heads, 4, d};
    std::vector<float> kc(layout.elements(), 0.1f), vc(layout.elements(), 0.1f);
    const std::vector<block_id> table{0};
    const std::vector<kernels::token_slot> slots{{table, 0}};
    std::vector<float> q(heads * d, 1.0f), out(heads * d, 0.0f);
    CHECK_THROWS_WITH(
        kernels::paged_attention(pool, layout, kc.data(), vc.data(), q.data(), out.data(), slots, heads, 0.5f),
        Catch::Contains("do not split into groups"));
  }
}

TEST_CASE("transformer equals the reference decoder", "[model]") {
  thread_pool pool(2);
  kernels::host::context ctx{pool};
  rng r(4);
  for (const auto hidden : {64u, 48u}) {
    for (const auto style : {kernels::rope_style::adjacent, kernels::rope_style::neox}) {
      auto cfg = small_config(hidden);
      cfg.rope = style;
      const auto w = model::random_weights(cfg, 11);
      model::transformer<kernels::host> m(w);
      kv::host_storage kv(cfg.layers, m.kv_layout(8, 8));
      const auto tokens = random_tokens(r, 40, cfg.vocab);
      const std::vector<block_id> table{5, 1, 7, 0, 2};
      const auto want = model::reference_forward(w, tokens);
      std::vector<std::size_t> ones(40, 1);  // token by token: logits at every position
      const auto got = run_chunks(m, ctx, kv, tokens, table, ones);
      for (std::size_t t = 0; t < tokens.size(); ++t)
        CHECK(max_relative_error(got[t], reference_row(want, t, cfg.vocab)) < 1e-4f);
      // Logits are not degenerate: a spread of values, not one-hot.
      const auto [lo, hi] = std::minmax_element(got.back().begin(), got.back().end());
      CHECK(*hi - *lo > 1.0f);
      CHECK(*hi - *lo < 50.0f);
    }
  }
}

TEST_CASE("chunked prefill equals one-shot prefill", "[model]") {
  thread_pool pool(2);
  kernels::host::context ctx{pool};
  rng r(5);
  const auto cfg = small_config();
  const auto w = model::random_weights(cfg, 12);
  model::transformer<kernels::host> m(w);
  const auto tokens = random_tokens(r, 61, cfg.vocab);
  const std::vector<block_id> table{3, 0, 6, 1, 4, 2, 5, 7};
  kv::host_storage kv_a(cfg.layers, m.kv_layout(8, 8)), kv_b(cfg.layers, m.kv_layout(8, 8));
  const auto one_shot = run_chunks(m, ctx, kv_a, tokens, table, {61});
  const auto chunked = run_chunks(m, ctx, kv_b, tokens, table, {7, 1, 16, 20, 17});
  CHECK(max_relative_error(chunked.back(), one_shot.back()) < 1e-5f);
  CHECK(chunked.back() == one_shot.back());  // the same operations in the same order: the same bits
}

TEST_CASE("logits after a cache hit equal logits recomputed from scratch", "[model][cache]") {
  thread_pool pool(2);
  kernels::host::context ctx{pool};
  rng r(6);
  const auto cfg = small_config();
  const auto w = model::random_weights(cfg, 13);
  model::transformer<kernels::host> m(w);
  kv::host_storage kv(cfg.layers, m.kv_layout(16, 4));
  // First request: 20 tokens in blocks 9, 3, 12, 0, 5.
  auto tokens = random_tokens(r, 20, cfg.vocab);
  run_chunks(m, ctx, kv, tokens, {9, 3, 12, 0, 5}, {20});
  // Second request shares the first 16 tokens (4 full blocks), then differs.
  auto second = std::vector<token_id>(tokens.begin(), tokens.begin() + 16);
  const auto tail = random_tokens(r, 11, cfg.vocab);
  second.insert(second.end(), tail.begin(), tail.end());
  const std::vector<block_id> hit_table{9, 3, 12, 0, 7, 8, 10};
  const auto reused = run_chunks(m, ctx, kv, second, hit_table, {11}, 16);

  kv::host_storage fresh(cfg.layers, m.kv_layout(16, 4));
  const auto scratch = run_chunks(m, ctx, fresh, second, {1, 2, 4, 6, 11, 13, 14}, {27});
  CHECK(reused.back() == scratch.back());
  const auto want = model::reference_forward(w, second);
  CHECK(max_relative_error(reused.back(), reference_row(want, 26, cfg.vocab)) < 1e-4f);
}

TEST_CASE("a batch of several sequences equals each sequence alone, on any thread count", "[model]") {
  rng r(7);
  const auto cfg = small_config();
  const auto w = model::random_weights(cfg, 14);
  const auto a = random_tokens(r, 23, cfg.vocab), b = random_tokens(r, 9, cfg.vocab);
  const std::vector<block_id> ta{0, 1, 2}, tb{3, 4};

  thread_pool one(1), two(2);
  kernels::host::context c1{one}, c2{two};
  model::transformer<kernels::host> m(w);
  kv::host_storage kv_alone(cfg.layers, m.kv_layout(8, 8)), kv_batch(cfg.layers, m.kv_layout(8, 8));
  const auto alone_a = run_chunks(m, c1, kv_alone, a, ta, {23});
  const auto alone_b = run_chunks(m, c1, kv_alone, b, tb, {9});
  const model::batch_item items[] = {{a, 0, ta, true}, {b, 0, tb, true}};
  std::vector<float> logits;
  m.forward(c2, kv_batch, items, logits);
  REQUIRE(logits.size() == 2 * cfg.vocab);
  CHECK(std::equal(alone_a.back().begin(), alone_a.back().end(), logits.begin()));
  CHECK(std::equal(alone_b.back().begin(), alone_b.back().end(),
                   logits.begin() + static_cast<std::ptrdiff_t>(cfg.vocab)));
}

TEST_CASE("model input errors are reported, not crashed on", "[model]") {
  thread_pool pool(1);
  kernels::host::context ctx{pool};
  auto cfg = small_config();
  const auto w = model::random_weights(cfg, 15);
  model::transformer<kernels::host> m(w);
  kv::host_storage kv(cfg.layers, m.kv_layout(4, 4));
  std::vector<float> logits;
  const std::vector<token_id> bad{1, 2, 50};
  const std::vector<block_id> table{0};
  const model::batch_item unknown{bad, 0, table, true};
  CHECK_THROWS_AS(m.forward(ctx, kv, std::span(&unknown, 1), logits), efim::error);
  const std::vector<token_id> five{1, 2, 3, 4, 5};
  const model::batch_item uncovered{five, 0, table, true};  // 5 tokens, one block of 4
  CHECK_THROWS_AS(m.forward(ctx, kv, std::span(&uncovered, 1), logits), efim::error);
  const model::batch_item past_context{five, 254, table, true};
  CHECK_THROWS_AS(m.forward(ctx, kv, std::span(&past_context, 1), logits), efim::error);
  kv::host_storage wrong(cfg.layers + 1, m.kv_layout(4, 4));
  const model::batch_item fine{std::span(five).first(3), 0, table, true};
  CHECK_THROWS_AS(m.forward(ctx, wrong, std::span(&fine, 1), logits), efim::error);
  cfg.heads = 3;  // 64 is not a multiple of 3
  CHECK_THROWS_AS(model::random_weights(cfg, 1), efim::error);
  CHECK_THROWS_AS(kv::host_storage(1, kv::paged_layout{0, 1, 1, 1}), efim::error);
}
