// Kernel lab: each host kernel is checked against a plain reference, then both are timed in the same
// run and the ratio printed. Also the whole model: prefill and decode tokens/s.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

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

float max_relative_error(const std::vector<float>& got, const std::vector<float>& want) {
  float scale = 0, err = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    scale = std::max(scale, std::abs(want[i]));
    err = std::max(err, std::abs(got[i] - want[i]));
  }
  return scale > 0 ? err / scale : err;
}

void report(const char* what, double reference_s, double kernel_s, double work, const char* unit, float error) {
  std::printf("%-34s reference %10.2f %s   host %10.2f %s   ratio %6.2fx   max rel err %.1e\n", what,
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

}  // namespace

int main(int argc, char** argv) {
  const std::size_t threads = argc > 1 ? static_cast<std::size_t>(std::stoul(argv[1])) : 0;
  thread_pool pool(threads);
  std::printf("efim kernel lab, %zu threads (reference: plain loops, 1 thread)\n", pool.size());
  bench_matmul(pool, 512, 384, 128);
  bench_matmul(pool, 512, 128, 384);
  bench_matmul(pool, 16, 384, 128);
  bench_attention(pool, true, 512, 1536);
  bench_attention(pool, false, 16, 2048);
  bench_model(pool);
  return 0;
}
