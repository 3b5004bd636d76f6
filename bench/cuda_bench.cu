// CUDA backend benchmark, one run, side by side on one GPU:
// - the device-to-device copy bandwidth (cudaMemcpyAsync, bytes read + written per second);
// - decode: the time of one step (transformer<kernels::cuda>::forward of one token per sequence, the
//   step's uploads, the logits' download and the synchronization included) at a given context, against
//   the bytes it must read (every weight once, each sequence's K and V) as a share of the copy bandwidth;
// - prefill: tokens/s of a chunk from an empty cache (attention on tensor cores, and on the scalar
//   kernel, side by side), against the same chunk's matrix products alone
//   (kernels::device::matmul on the same device weights and shapes: cuBLAS and the 16-bit conversion
//   of its input), the share of prefill time they take;
// - the decode step's matrix products alone (the kernel that decodes weights in registers), and for
//   dense weights the same products through cuBLAS, side by side; above 8 sequences (--batch), for
//   quantized weights, the f16 slices through cuBLAS against the tensor-core tiles (quant_tiles).
// Models are Qwen2-shaped (0.5B: hidden 896, 24 layers, 14/2 heads, ffn 4864, tied embeddings; 7B:
// hidden 3584, 28 layers, 28/4 heads, ffn 18944) with random weights made in memory, or GGUF files
// (--gguf; efim-model make writes them), the files llama.cpp's llama-bench is timed on beside it.
#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "efim/cuda.cuh"
#include "efim/efim.hpp"

using namespace efim;

namespace {

const char* const usage = R"(usage: efim-cuda-bench [options]

  --model 0.5b|7b     Qwen2-shaped random-weight model (default 0.5b; repeatable)
  --type T           weights: f16, bf16, f32, q8_0, q4_0, q5_0, q5_1, q4_k, q5_k, q6_k (every
                     matrix), or q4_k_m, q5_k_m (llama.cpp's mixes); default f16
  --gguf FILE         a model file instead (repeatable; with --model too): the weights and types it
                      holds, as llama.cpp's llama-bench reads the same file
  --kv f16|f32        KV cache elements (default f16)
  --context N         tokens already in the cache when decode is timed (default 1024; 0: decode from
                      an empty cache, as llama-bench's tg runs)
  --batch N           sequences decoded together (default 1)
  --prefill N         tokens of the timed prefill chunk (default 512)
  --steps N           decode steps timed (default 64)
  --products P        exact, int8 or both (default): how quantized weights multiply a decode step
                      (kernels::products); both times each in turn on the same file and prints the
                      decode ratio int8 / exact (models with no quantized matrix run exact only)
  --graphs G          on, off or both (default): decode steps run as CUDA graphs (captured once per
                      step shape, replayed after) or launched kernel by kernel; both times each and
                      prints the decode ratio graphs / launches
  --attention A       pages, rows, staged, both (pages and rows) or all (default): the attention
                      kernel of decode steps (kernels::device::attention_kernel; staged takes f16 KV);
                      more than one times the decode steps with each in turn, three rounds on the
                      same model and cache, and prints each / the first
  --mma-attention K   wmma, staged or both (default): the tensor-core attention kernel of prefill
                      (kernels::device::mma_attention); both times the prefill chunk with each in
                      turn, three rounds, and prints staged / wmma
)";

[[noreturn]] void fail(const std::string& why) {
  std::fprintf(stderr, "efim-cuda-bench: %s\n", why.c_str());
  std::exit(2);
}

std::size_t count(const char* flag, const char* v, bool zero_too = false) {
  char* end = nullptr;
  const unsigned long long n = std::strtoull(v, &end, 10);
  if (end == v || *end != '\0' || (n == 0 && !zero_too))
    fail(std::string(flag) + " needs a positive number, not '" + v + "'");
  return static_cast<std::size_t>(n);
}

model::config qwen2_shape(std::string_view size) {
  auto c = model::for_architecture(model::architecture::qwen2);
  c.vocab = 151936;
  c.rope_theta = 1e6;
  c.norm_eps = 1e-6f;
  c.max_context = 32768;
  if (size == "0.5b") {
    c.hidden = 896, c.layers = 24, c.heads = 14, c.kv_heads = 2, c.ffn = 4864;
  } else if (size == "7b") {
    c.hidden = 3584, c.layers = 28, c.heads = 28, c.kv_heads = 4, c.ffn = 18944, c.vocab = 152064;
  } else {
    fail("--model is 0.5b or 7b, not '" + std::string(size) + "'");
  }
  return c;
}

// Views of random weights: the matrices of one type read (the start of) one host buffer of random
// values of that type, each is uploaded to its own device memory. Norm weights are one, biases zero.
// Block-quantized matrices are random bytes with every block's f16 scales set to 2^-10 (and a q5_1
// offset, a k-quant's dmin, to 0): finite weights of the file's layout, for timing. A mix (q4_k_m,
// q5_k_m) gives each matrix llama.cpp's type for it (model::mixed_type), as efim-model writes files.
struct shaped_weights {
  std::vector<std::pair<dtype, std::vector<std::byte>>> pools;  // one per type, as large as its largest use
  std::vector<float> ones, zeros;
  model::weights w;

  shaped_weights(const model::config& c, std::string_view type, bool tied) {
    const auto mix = model::parse_quant_mix(type);
    const dtype uniform = mix && *mix != model::quant_mix::q6_k ? dtype::f32 : parse_dtype(type);
    const auto type_of = [&](const std::string& name, std::size_t cols) {
      return mix && *mix != model::quant_mix::q6_k ? model::mixed_type(*mix, name, cols, c.layers, !tied) : uniform;
    };
    // Two passes: the first sizes each type's pool, the second makes the views.
    for (const bool views : {false, true}) {
      const auto m = [&](const std::string& name, std::size_t rows, std::size_t cols, std::size_t skip_rows = 0) {
        const dtype t = type_of(name, cols);
        const std::size_t bytes = (rows + skip_rows) * row_bytes(t, cols);
        auto at = std::find_if(pools.begin(), pools.end(), [&](const auto& p) { return p.first == t; });
        if (!views) {
          if (at == pools.end()) at = pools.emplace(pools.end(), t, std::vector<std::byte>{});
          if (at->second.size() < bytes) at->second.resize(bytes);
          return model::matrix{};
        }
        return model::matrix{t, rows, cols, at->second.data() + skip_rows * row_bytes(t, cols)};
      };
      if (views) fill();
      ones.assign(std::max(c.hidden, c.ffn), 1.0f);
      zeros.assign(std::max({c.hidden, c.q_dim(), c.ffn}), 0.0f);
      const auto ones_n = [&](std::size_t n) { return model::vector(ones.data(), n); };
      const auto zeros_n = [&](std::size_t n) { return model::vector(zeros.data(), n); };
      w = {};
      w.cfg = c;
      w.token_embd = m("token_embd.weight", c.vocab, c.hidden);
      w.output = tied ? w.token_embd : m("output.weight", c.vocab, c.hidden, 1);  // another pointer: untied
      w.output_norm = ones_n(c.hidden);
      for (std::size_t l = 0; l < c.layers; ++l) {
        const auto name = [&](const char* what) { return model::names::block(l, what); };
        model::layer_weights lw;
        lw.attn_norm = ones_n(c.hidden);
        lw.wq = m(name("attn_q.weight"), c.q_dim(), c.hidden);
        lw.wk = m(name("attn_k.weight"), c.kv_dim(), c.hidden);
        lw.wv = m(name("attn_v.weight"), c.kv_dim(), c.hidden);
        lw.bq = zeros_n(c.q_dim());
        lw.bk = zeros_n(c.kv_dim());
        lw.bv = zeros_n(c.kv_dim());
        lw.wo = m(name("attn_output.weight"), c.hidden, c.q_dim());
        lw.ffn_norm = ones_n(c.hidden);
        lw.w_gate = m(name("ffn_gate.weight"), c.ffn, c.hidden);
        lw.w_up = m(name("ffn_up.weight"), c.ffn, c.hidden);
        lw.w_down = m(name("ffn_down.weight"), c.hidden, c.ffn);
        w.layers.push_back(lw);
      }
    }
  }

 private:
  void fill() {
    std::uint64_t s = 0x9E3779B97F4A7C15ull;
    const auto next = [&] {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      return s;
    };
    const std::uint16_t scale = 0x1400, zero = 0;  // 2^-10 in f16; 0
    for (auto& [t, bytes] : pools) {
      if (info(t).block == 1) {
        const std::size_t n = bytes.size() / info(t).bytes;
        for (std::size_t i = 0; i < n; ++i) {
          const float v = (static_cast<float>(next() >> 40) / 16777216.0f - 0.5f) * 0.1f;
          if (t == dtype::f32) {
            std::memcpy(bytes.data() + 4 * i, &v, 4);
          } else {
            const std::uint16_t h = t == dtype::f16 ? f32_to_f16(v) : f32_to_bf16(v);
            std::memcpy(bytes.data() + 2 * i, &h, 2);
          }
        }
        continue;
      }
      for (std::size_t i = 0; i + 8 <= bytes.size(); i += 8) {
        const std::uint64_t r = next();
        std::memcpy(bytes.data() + i, &r, 8);
      }
      const std::size_t block = info(t).bytes;
      for (std::size_t b = 0; b + block <= bytes.size(); b += block) {
        std::byte* p = bytes.data() + b;
        if (t == dtype::q6_k) {
          std::memcpy(p + 208, &scale, 2);
        } else {
          std::memcpy(p, &scale, 2);
          if (t == dtype::q5_1 || t == dtype::q4_k || t == dtype::q5_k) std::memcpy(p + 2, &zero, 2);
        }
      }
    }
  }
};

struct timer {
  cudaEvent_t a{}, b{};
  timer() {
    device::check(cudaEventCreate(&a), "cudaEventCreate");
    device::check(cudaEventCreate(&b), "cudaEventCreate");
  }
  ~timer() {
    (void)cudaEventDestroy(a);
    (void)cudaEventDestroy(b);
  }
  void start(cudaStream_t s) { device::check(cudaEventRecord(a, s), "cudaEventRecord"); }
  double stop_ms(cudaStream_t s) {
    device::check(cudaEventRecord(b, s), "cudaEventRecord");
    device::check(cudaEventSynchronize(b), "cudaEventSynchronize");
    float ms = 0;
    device::check(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
    return ms;
  }
};

// Bytes read + written per second by device-to-device copies of 1 GiB.
double copy_bandwidth(cudaStream_t s) {
  const std::size_t bytes = std::size_t{1} << 30;
  device::buffer<std::byte> from(bytes), to(bytes);
  device::check(cudaMemsetAsync(from.data(), 1, bytes, s), "cudaMemset");
  timer t;
  double best = 1e30;
  for (int i = 0; i < 6; ++i) {
    t.start(s);
    device::check(cudaMemcpyAsync(to.data(), from.data(), bytes, cudaMemcpyDeviceToDevice, s), "cudaMemcpyAsync");
    best = std::min(best, t.stop_ms(s));
  }
  return 2.0 * static_cast<double>(bytes) / (best / 1e3);
}

struct options {
  std::vector<std::string> models, files;
  std::string type = "f16";
  dtype kv = dtype::f16;
  std::size_t context = 1024, batch = 1, prefill = 512, steps = 64;
  std::vector<kernels::products> products{kernels::products::exact, kernels::products::int8};
  std::vector<bool> graphs{true, false};
  std::vector<kernels::device::attention_kernel> attention{kernels::device::attention_kernel::pages,
                                                           kernels::device::attention_kernel::rows,
                                                           kernels::device::attention_kernel::staged};
  std::vector<kernels::device::mma_attention> mma{kernels::device::mma_attention::wmma,
                                                  kernels::device::mma_attention::staged};
};

const char* attention_name(kernels::device::attention_kernel k) {
  using kernels::device::attention_kernel;
  return k == attention_kernel::rows ? "rows" : k == attention_kernel::staged ? "staged" : "pages";
}

const char* mma_name(kernels::device::mma_attention k) {
  return k == kernels::device::mma_attention::staged ? "staged" : "wmma";
}

bool any_quantized(const model::weights& w) {
  for (const auto* m : model::decode_matrices(w))
    if (kernels::quant::kept_quantized(m->type)) return true;
  return false;
}

// One model's row with one kind of products: `name` and `type` label it, `w` are its host weights
// (made in memory or a file's). Returns the decode step's milliseconds.
double run(const options& o, const std::string& name, const std::string& type, const model::weights& w,
           double copy_bps, kernels::products p, bool graphs) {
  const auto& c = w.cfg;
  kernels::cuda::context ctx;
  model::transformer<kernels::cuda> m(w, p);
  m.set_graphs(graphs);
  if (m.uploaded().bytes() != model::device_weight_bytes(w))
    fail("device weights take " + std::to_string(m.uploaded().bytes()) + " bytes, not the planned " +
         std::to_string(model::device_weight_bytes(w)));
  const std::size_t block = 16;
  const std::size_t per_seq = (std::max(o.context, o.prefill) + o.steps + block) / block + 1;
  kv::device_storage kv(c.layers, m.kv_layout(per_seq * o.batch, block), o.kv);

  // Sequence s: blocks [s * per_seq, (s + 1) * per_seq), random tokens.
  std::vector<std::vector<block_id>> tables(o.batch);
  std::vector<std::vector<token_id>> tokens(o.batch);
  std::uint64_t r = 7;
  for (std::size_t s = 0; s < o.batch; ++s) {
    for (std::size_t b = 0; b < per_seq; ++b) tables[s].push_back(static_cast<block_id>(s * per_seq + b));
    for (std::size_t i = 0; i < std::max(o.context, o.prefill) + o.steps + 1; ++i) {
      r = r * 6364136223846793005ull + 1442695040888963407ull;
      tokens[s].push_back(static_cast<token_id>((r >> 33) % c.vocab));
    }
  }
  std::vector<float> logits;
  const auto now = [] { return std::chrono::steady_clock::now(); };
  const auto ms_since = [&](auto t0) { return std::chrono::duration<double, std::milli>(now() - t0).count(); };

  // Prefill: one chunk of o.prefill tokens of sequence 0 from position 0 (warmed up once).
  const auto chunk = [&](std::size_t from, std::size_t n) {
    const model::batch_item item{std::span<const token_id>(tokens[0]).subspan(from, n), static_cast<position>(from),
                                 tables[0], true};
    m.forward(ctx, kv, std::span(&item, 1), logits);
  };
  // Prefill with the attention on tensor cores where the step fills the GPU (the default), by each
  // tensor-core kernel asked for, then on the scalar kernel: in turn, three rounds.
  using decoder = model::transformer<kernels::cuda>;
  std::vector<double> mma_ms(o.mma.size(), 1e30);
  double scalar_ms = 1e30;
  for (int round = 0; round < 3; ++round)
    for (std::size_t k = 0; k <= o.mma.size(); ++k) {
      const bool scalar = k == o.mma.size();
      m.set_tensor_core_attention(scalar ? decoder::tensor_cores::never : decoder::tensor_cores::when_filled);
      if (!scalar) m.set_mma_attention(o.mma[k]);
      if (round == 0) chunk(0, o.prefill);  // (warm-up)
      const auto t0 = now();
      chunk(0, o.prefill);
      double& best = scalar ? scalar_ms : mma_ms[k];
      best = std::min(best, ms_since(t0));
    }
  m.set_tensor_core_attention(decoder::tensor_cores::when_filled);
  m.set_mma_attention(o.mma[0]);
  const double prefill_ms = mma_ms[0];

  // The same chunk's matrix products alone, on the same device weights.
  const auto& dw = m.uploaded();
  const std::size_t widest = std::max({c.hidden, c.q_dim(), c.ffn}), x_rows = std::max(o.prefill, o.batch);
  device::buffer<float> x(x_rows * widest), y(x_rows * c.vocab);
  device::check(cudaMemsetAsync(x.data(), 0, x.size() * sizeof(float), ctx.stream()), "cudaMemset");
  // (and the decode rows converted to 16 bits for cuBLAS, timed below against the decode kernel, and
  // the f16 slices of o.batch rows, timed against the tiles whatever matmul takes)
  std::size_t slices_bytes = 0;
  for (const auto* w : {&dw.output, &dw.layers[0].w_gate, &dw.layers[0].w_down})
    slices_bytes = std::max(slices_bytes, kernels::device::quant_matmul_workspace(w->rows, w->cols, o.batch));
  device::buffer<std::byte> conv(
      std::max({dw.workspace(o.prefill), dw.workspace(1), dw.workspace(o.batch), o.batch * widest * 2, slices_bytes}));
  // The step's matrices: each layer's seven, then the output matrix.
  const std::vector<const kernels::device::matrix*> step_matrices = model::decode_matrices(dw);
  timer t;
  const auto best_ms = [&](int reps, const auto& pass) {  // (after one untimed pass)
    pass();
    double best = 1e30;
    for (int i = 0; i < reps; ++i) {
      t.start(ctx.stream());
      pass();
      best = std::min(best, t.stop_ms(ctx.stream()));
    }
    return best;
  };
  const double products_ms = best_ms(3, [&] {  // (the output matrix: the chunk's last row only)
    for (const auto* w : step_matrices)
      kernels::device::matmul(ctx.blas(), x.data(), *w, y.data(), w == &dw.output ? 1 : o.prefill, conv.data(),
                              ctx.stream());
  });

  // The decode step's matrix products alone (o.batch x rows, up to 8: the kernel that decodes weights
  // in registers), and for a model of dense weights the same products through cuBLAS (x converted to
  // 16 bits first), as that type's decode ran before: the weights' bytes a second each way.
  // Above 8 rows, for a model of quantized weights, the f16 slices (cuBLAS) against the tensor-core
  // tiles that dequantize in shared memory (quant_tiles), whichever matmul takes.
  double step_matrix_bytes = 0;
  bool dense = true, in_registers = true, quantized = true;
  for (const auto* w : step_matrices) {
    step_matrix_bytes += static_cast<double>(w->rows * row_bytes(w->type, w->cols));
    dense = dense && kernels::quant::dense_type(w->type);
    quantized = quantized && kernels::quant::kept_quantized(w->type);
    in_registers = in_registers && kernels::device::decodes_in_registers(*w, o.batch);
  }
  enum class path { matmul, blas, tiles, tiles16 };  // (tiles16: x rounded to f16 first, then the tiles)
  const auto time_products = [&](path how, std::span<const kernels::device::matrix* const> matrices) {
    return best_ms(5, [&] {
      for (const auto* w : matrices)
        if (how == path::blas)
          kernels::device::detail::cublas_product<kernels::device::policy::convert>(
              ctx.blas(), x.data(), *w, y.data(), o.batch, conv.data(), ctx.stream(), kernels::accumulate::no);
        else if (how == path::tiles)
          kernels::device::quant_tiles(w->type, w->data, w->rows, w->cols, x.data(), o.batch, y.data(), ctx.stream());
        else if (how == path::tiles16) {
          kernels::device::to_16bit(x.data(), conv.data(), o.batch * w->cols, false, ctx.stream());
          kernels::device::quant_tiles(w->type, w->data, w->rows, w->cols, reinterpret_cast<const __half*>(conv.data()),
                                       o.batch, y.data(), ctx.stream());
        } else
          kernels::device::matmul(ctx.blas(), x.data(), *w, y.data(), o.batch, conv.data(), ctx.stream(),
                                  kernels::accumulate::no, p);
    });
  };
  const bool tiles_or_slices = quantized && !in_registers;
  const double decode_products_ms = in_registers ? time_products(path::matmul, step_matrices) : 0.0;
  const double decode_blas_ms =
      (in_registers && dense) || tiles_or_slices ? time_products(path::blas, step_matrices) : 0.0;
  const double decode_tiles_ms = tiles_or_slices ? time_products(path::tiles, step_matrices) : 0.0;
  const double decode_tiles16_ms = tiles_or_slices ? time_products(path::tiles16, step_matrices) : 0.0;
  // and each kind of matrix alone (wq of every layer, then wk, ...; the output matrix), for a rule by
  // shape: every layer's, so that a kind's bytes come from memory as in a step, not from L2
  std::string by_matrix;
  if (tiles_or_slices)
    for (std::size_t kind = 0; kind < 8; ++kind) {
      std::vector<const kernels::device::matrix*> same;
      if (kind == 7)
        same.push_back(&dw.output);
      else
        for (const auto& lw : dw.layers) same.push_back(model::layer_matrices(lw)[kind]);
      const double slices = time_products(path::blas, same), tiles = time_products(path::tiles, same),
                   tiles16 = time_products(path::tiles16, same);
      const auto* w = same.front();
      const bool one_type = std::all_of(same.begin(), same.end(), [&](const auto* v) { return v->type == w->type; });
      char line[224];
      std::snprintf(
          line, sizeof line,
          "      %zu x %zu %s (%zu of them): slices %.3f ms, tiles %.3f ms (%.2fx), x in f16 first %.3f ms (%.2fx)\n",
          w->rows, w->cols, one_type ? std::string(to_string(w->type)).c_str() : "mixed", same.size(), slices, tiles,
          slices / tiles, tiles16, slices / tiles16);
      by_matrix += line;
    }

  // Decode: fill each sequence to o.context, then time o.steps steps of one token per sequence.
  for (std::size_t s = 0; s < o.batch; ++s)
    for (std::size_t from = 0; from < o.context; from += o.prefill) {
      const std::size_t n = std::min(o.prefill, o.context - from);
      const model::batch_item item{std::span<const token_id>(tokens[s]).subspan(from, n), static_cast<position>(from),
                                   tables[s], false};
      m.forward(ctx, kv, std::span(&item, 1), logits);
    }
  std::vector<model::batch_item> step(o.batch);
  const auto decode = [&](std::size_t at) {
    for (std::size_t s = 0; s < o.batch; ++s)
      step[s] = {std::span<const token_id>(tokens[s]).subspan(at, 1), static_cast<position>(at), tables[s], true};
    m.forward(ctx, kv, step, logits);
  };
  // Each attention kernel in turn, three rounds (the same positions again: their K/V are written again
  // with the same values), the best round of each; the first kernel's is the row's decode.
  std::vector<double> attention_ms(o.attention.size(), 1e30);
  for (int round = 0; round < (o.attention.size() > 1 ? 3 : 1); ++round)
    for (std::size_t a = 0; a < o.attention.size(); ++a) {
      m.set_scalar_attention(o.attention[a]);
      decode(o.context);  // warm-up (its KV is written again by the first timed step)
      const auto t0 = now();
      for (std::size_t i = 0; i < o.steps; ++i) decode(o.context + i);
      attention_ms[a] = std::min(attention_ms[a], ms_since(t0) / static_cast<double>(o.steps));
    }
  m.set_scalar_attention(o.attention[0]);
  const double step_ms = attention_ms[0];

  const double kv_elem = static_cast<double>(info(o.kv).bytes);
  const double kv_bytes = static_cast<double>(o.batch) * static_cast<double>(c.layers) * 2.0 *
                          static_cast<double>(c.kv_dim()) * (static_cast<double>(o.context) + o.steps / 2.0) * kv_elem;
  const double read = static_cast<double>(dw.bytes()) + kv_bytes;
  const double bps = read / (step_ms / 1e3);
  std::printf("%-5s %-6s %-5s %-8s KV %-3s | weights %.2f GB | decode batch %zu at %zu: %.3f ms/step, %.1f tok/s, %.0f GB/s "
              "= %.1f%% of copy | prefill %zu: %.1f ms, %.0f tok/s (scalar attention %.1f ms: tensor cores %.2fx); "
              "products alone %.1f ms (%.1f%% of prefill)\n",
              name.c_str(), type.c_str(), p == kernels::products::int8 ? "int8" : "exact",
              graphs ? "graphs" : "launches",
              std::string(to_string(o.kv)).c_str(),
              static_cast<double>(dw.bytes()) / 1e9, o.batch, o.context, step_ms,
              static_cast<double>(o.batch) * 1e3 / step_ms, bps / 1e9, 100.0 * bps / copy_bps, o.prefill, prefill_ms,
              static_cast<double>(o.prefill) * 1e3 / prefill_ms, scalar_ms, scalar_ms / prefill_ms, products_ms,
              100.0 * products_ms / prefill_ms);
  if (in_registers) {
    const double bps_products = step_matrix_bytes / (decode_products_ms / 1e3);
    std::printf(
        "%-5s %-6s       decode products alone (%zu x rows, in registers, %s): %.3f ms, %.0f GB/s = %.1f%% of copy",
        name.c_str(), type.c_str(), o.batch, p == kernels::products::int8 ? "int8" : "exact", decode_products_ms,
        bps_products / 1e9, 100.0 * bps_products / copy_bps);
    if (dense)
      std::printf("; through cuBLAS %.3f ms: registers / cuBLAS %.2fx", decode_blas_ms,
                  decode_blas_ms / decode_products_ms);
    std::printf("\n");
  }
  if (tiles_or_slices)
    std::printf(
        "%-5s %-6s       decode products alone (%zu x rows): f16 slices %.3f ms, tensor-core tiles %.3f ms "
        "(%.0f GB/s of weights): tiles / slices %.2fx; x in f16 first %.3f ms: %.2fx\n",
        name.c_str(), type.c_str(), o.batch, decode_blas_ms, decode_tiles_ms,
        step_matrix_bytes / (decode_tiles_ms / 1e3) / 1e9, decode_blas_ms / decode_tiles_ms, decode_tiles16_ms,
        decode_blas_ms / decode_tiles16_ms);
  std::printf("%s", by_matrix.c_str());
  for (std::size_t k = 1; k < o.mma.size(); ++k)
    std::printf(
        "%-5s %-6s %-5s %-8s prefill %zu, tensor-core attention %s: %.1f ms, %.0f tok/s, %s / %s %.3fx tokens/s\n",
        name.c_str(), type.c_str(), p == kernels::products::int8 ? "int8" : "exact", graphs ? "graphs" : "launches",
        o.prefill, mma_name(o.mma[k]), mma_ms[k], static_cast<double>(o.prefill) * 1e3 / mma_ms[k], mma_name(o.mma[k]),
        mma_name(o.mma[0]), mma_ms[0] / mma_ms[k]);
  for (std::size_t a = 1; a < o.attention.size(); ++a)
    std::printf("%-5s %-6s %-5s %-8s decode attention %s: %.3f ms/step, %s / %s %.3fx tokens/s\n", name.c_str(),
                type.c_str(), p == kernels::products::int8 ? "int8" : "exact", graphs ? "graphs" : "launches",
                attention_name(o.attention[a]), attention_ms[a], attention_name(o.attention[a]),
                attention_name(o.attention[0]), attention_ms[0] / attention_ms[a]);
  std::fflush(stdout);
  return step_ms;
}

// A model's rows for each kind of products asked for (exact alone where no matrix is quantized) and
// each way of launching a step, then the decode ratios (tokens/s) where both of a pair ran.
void run_all(const options& o, const std::string& name, const std::string& type, const model::weights& w,
             double copy_bps) {
  double ms[2][2] = {};  // [int8][graphs]
  for (const kernels::products p : o.products) {
    if (p == kernels::products::int8 && !any_quantized(w)) continue;
    for (const bool g : o.graphs) ms[p == kernels::products::int8][g] = run(o, name, type, w, copy_bps, p, g);
  }
  for (const int i : {0, 1})
    if (ms[i][0] > 0 && ms[i][1] > 0)
      std::printf("%-5s %-6s %-5s decode graphs / launches: %.2fx tokens/s\n", name.c_str(), type.c_str(),
                  i == 1 ? "int8" : "exact", ms[i][0] / ms[i][1]);
  for (const int g : {1, 0})
    if (ms[0][g] > 0 && ms[1][g] > 0)
      std::printf("%-5s %-6s %-8s decode int8 / exact: %.2fx tokens/s\n", name.c_str(), type.c_str(),
                  g == 1 ? "graphs" : "launches", ms[0][g] / ms[1][g]);
}

}  // namespace

int main(int argc, char** argv) try {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string_view flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::fputs(usage, stdout);
      return 0;
    }
    if (std::string_view(usage).find("  " + std::string(flag) + " ") == std::string_view::npos)
      fail("unknown option " + std::string(flag) + " (see --help)");
    if (i + 1 >= argc) fail(std::string(flag) + " needs a value (see --help)");
    const char* v = argv[++i];
    if (flag == "--model") {
      o.models.emplace_back(v);
    } else if (flag == "--type") {
      o.type = v;
      if (!model::parse_quant_mix(v)) (void)parse_dtype(v);  // throws for a name that is neither
    } else if (flag == "--kv") {
      o.kv = parse_dtype(v);
      if (o.kv != dtype::f16 && o.kv != dtype::f32) fail("--kv is f16 or f32");
    } else if (flag == "--gguf") {
      o.files.emplace_back(v);
    } else if (flag == "--context") {
      o.context = count(argv[i - 1], v, true);
    } else if (flag == "--batch") {
      o.batch = count(argv[i - 1], v);
    } else if (flag == "--prefill") {
      o.prefill = count(argv[i - 1], v);
    } else if (flag == "--steps") {
      o.steps = count(argv[i - 1], v);
    } else if (flag == "--products") {
      if (std::string_view(v) == "both")
        o.products = {kernels::products::exact, kernels::products::int8};
      else
        o.products = {kernels::parse_products(v)};
    } else if (flag == "--graphs") {
      const std::string_view g = v;
      if (g != "on" && g != "off" && g != "both") fail("--graphs is on, off or both, not '" + std::string(g) + "'");
      o.graphs = g == "both" ? std::vector<bool>{true, false} : std::vector<bool>{g == "on"};
    } else if (flag == "--attention") {
      using kernels::device::attention_kernel;
      const std::string_view a = v;
      if (a == "both")
        o.attention = {attention_kernel::pages, attention_kernel::rows};
      else if (a == "all")
        o.attention = {attention_kernel::pages, attention_kernel::rows, attention_kernel::staged};
      else if (a == "pages" || a == "rows" || a == "staged")
        o.attention = {a == "rows"     ? attention_kernel::rows
                       : a == "staged" ? attention_kernel::staged
                                       : attention_kernel::pages};
      else
        fail("--attention is pages, rows, staged, both or all, not '" + std::string(a) + "'");
    } else if (flag == "--mma-attention") {
      using kernels::device::mma_attention;
      const std::string_view a = v;
      if (a == "both")
        o.mma = {mma_attention::wmma, mma_attention::staged};
      else if (a == "wmma" || a == "staged")
        o.mma = {a == "staged" ? mma_attention::staged : mma_attention::wmma};
      else
        fail("--mma-attention is wmma, staged or both, not '" + std::string(a) + "'");
    } else {
      fail("unknown option " + std::string(flag) + " (see --help)");
    }
  }
  if (o.models.empty() && o.files.empty()) o.models.emplace_back("0.5b");
  if (!device::available()) fail("no CUDA device");
  kernels::cuda::context ctx;
  const double copy = copy_bandwidth(ctx.stream());
  std::printf("efim-cuda-bench on %s: device-to-device copy %.0f GB/s (read + write)\n", device::device_name().c_str(),
              copy / 1e9);
  for (const auto& size : o.models) {
    const shaped_weights sw(qwen2_shape(size), o.type, size == "0.5b");
    run_all(o, size, o.type, sw.w, copy);
  }
  for (const auto& path : o.files) {
    const auto file = model::open_model(path);
    run_all(o, path.substr(path.find_last_of('/') + 1), "file", file.bind(), copy);
  }
  return 0;
} catch (const std::exception& e) {  // efim::error: a bad option value, a CUDA or cuBLAS failure
  fail(e.what());
}
