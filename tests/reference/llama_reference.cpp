// efim-llama-reference: llama.cpp as the reference implementation of the llama, qwen2 and
// starcoder2 architectures, over its public C API (llama.h) and its prebuilt CPU libraries, which
// .ci/setup lays out in .cache/llama.cpp (nothing of llama.cpp is in the repository or copied here).
//
//   quantize IN OUT TYPE [--threads N]             TYPE: f16 bf16 q8_0 q4_0 q4_k_m q5_k_m q6_k
//   quantize-rows TYPE N IN OUT                    ggml's quantizer on raw f32 rows of N (TYPE: a ggml type)
//   logits MODEL --ids "i j ..." [--all] [--threads N] [--kv f32|f16] [--batch N]
//   generate MODEL --ids "i j ..." --n N [--threads N] [--kv f32|f16]
//   bench MODEL [--pp 512] [--tg 128] [--threads N] [--reps 3] [--kv f16|f32] [--fa auto|on|off] [--ubatch 512]
//   info MODEL
//   smoke --make-model SCRIPT --vocab-dir DIR --work DIR [--python PY]... [--threads N]
//
// Every subcommand takes --verbose (llama.cpp's log on stderr; otherwise only its errors). Bad use:
// a message on stderr and exit code 2; a failure (a model that does not load, a decode error): 1.
//
// What `logits` computes, and what stays approximate. It asks llama.cpp for its most exact path:
// no flash attention (which would cast K and V to f16), an f32 KV cache unless --kv f16, no weight
// repacking (use_extra_bufts = false), every batch one micro-batch. What remains is ggml's CPU
// arithmetic:
//   - matrix products convert the activations to the weights' "vec_dot" type first: f16 weights
//     multiply f16-rounded activations, bf16 weights bf16-rounded ones, and q8_0 / q4_0 / k-quant
//     weights activations quantized to q8_0 (q8_K for k-quants) blocks; only f32 weights see f32
//     activations. Sums run in SIMD order (float lanes), not sequentially;
//   - GELU (starcoder2's MLP) is the tanh approximation looked up in a table indexed by the input
//     rounded to f16 (output f16-rounded); inputs <= -10 give 0 and >= 10 pass through;
//   - SiLU and softmax use ggml's vectorised expf (softmax of kq * scale + mask, summed in
//     double); RMSNorm sums squares in double, then x * (1 / sqrtf(mean + eps)) in float, times
//     the weight; LayerNorm is two-pass: the mean (summed in double, kept as float), then the mean
//     squared deviation (float SIMD partial sums added in double), x - mean times
//     1 / sqrtf(var + eps), times the weight, plus the bias;
//   - rope's angle for pair i is pos * base^(-2i/d) built by repeated float multiplication
//     (theta *= base^(-2/d)), times the linear scaling factor's inverse, then cosf / sinf;
//   - with --kv f16 the K and V rows are stored as f16, and q and the softmax weights are rounded
//     to f16 before their products with them.
// Outputs are bit-for-bit reproducible for one machine, thread count and batch split; other batch
// splits agree to rounding (the smoke test checks 1e-4 of the largest logit).

#include <ggml-backend.h>
#include <ggml.h>
#include <gguf.h>
#include <llama-cpp.h>
#include <llama.h>

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

extern char** environ;

#ifndef EFIM_LLAMA_LIB_DIR
#define EFIM_LLAMA_LIB_DIR ""
#endif
#ifndef EFIM_LLAMA_VERSION
#define EFIM_LLAMA_VERSION "unknown"
#endif

namespace {

constexpr const char* usage_text =
    "usage: efim-llama-reference COMMAND ...\n"
    "  quantize IN OUT TYPE [--threads N]            TYPE: f16 bf16 q8_0 q4_0 q4_k_m q5_k_m q6_k\n"
    "  quantize-rows TYPE N IN OUT                   ggml_quantize_chunk on IN's f32 rows of N; TYPE q4_0 q5_0\n"
    "                                                q5_1 q8_0 q4_k q5_k q6_k\n"
    "  logits MODEL --ids \"i j ...\" [--all] [--threads N] [--kv f32|f16] [--batch N]\n"
    "  generate MODEL --ids \"i j ...\" --n N [--threads N] [--kv f32|f16]\n"
    "  bench MODEL [--pp 512] [--tg 128] [--threads N] [--reps 3] [--kv f16|f32] [--fa auto|on|off] [--ubatch 512]\n"
    "  info MODEL\n"
    "  tokenize VOCAB TEXT_FILE                       llama.cpp's ids for the file's text\n"
    "  tokenize-bench VOCAB DIR [--repeat 3] [--ids OUT]  llama_tokenize on every DIR/*.txt, timed (JSON)\n"
    "  smoke --make-model SCRIPT --vocab-dir DIR --work DIR [--python PY]... [--threads N]\n"
    "every command also takes --verbose (llama.cpp's log on stderr)\n";

struct usage_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// ---------------------------------------------------------------------------------------------
// Command lines

struct arguments {
  std::vector<std::string> positional;
  std::map<std::string, std::vector<std::string>> values;
  std::set<std::string> flags;

  bool has(const std::string& name) const { return values.count(name) != 0 || flags.count(name) != 0; }

  const std::string* value(const std::string& name) const {
    auto it = values.find(name);
    return it == values.end() ? nullptr : &it->second.back();
  }
};

arguments parse_arguments(int argc, char** argv, int first, std::size_t n_positional,
                          std::initializer_list<std::string_view> value_options,
                          std::initializer_list<std::string_view> flag_options) {
  arguments args;
  for (int i = first; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.size() > 2 && arg.starts_with("--")) {
      if (std::find(flag_options.begin(), flag_options.end(), arg) != flag_options.end() || arg == "--verbose") {
        args.flags.insert(arg);
      } else if (std::find(value_options.begin(), value_options.end(), arg) != value_options.end()) {
        if (i + 1 >= argc) {
          throw usage_error(arg + " needs a value");
        }
        args.values[arg].push_back(argv[++i]);
      } else {
        throw usage_error("unknown option " + arg);
      }
    } else {
      args.positional.push_back(arg);
    }
  }
  if (args.positional.size() != n_positional) {
    throw usage_error(std::string(argv[first - 1]) + " takes " + std::to_string(n_positional) + " argument" +
                      (n_positional == 1 ? "" : "s") + ", not " + std::to_string(args.positional.size()));
  }
  return args;
}

long parse_integer(const std::string& text, const std::string& what, long min, long max) {
  errno = 0;
  char* end = nullptr;
  const long value = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || errno != 0 || value < min || value > max) {
    throw usage_error(what + " must be an integer in [" + std::to_string(min) + ", " + std::to_string(max) +
                      "], not '" + text + "'");
  }
  return value;
}

long integer_option(const arguments& args, const std::string& name, long fallback, long min, long max) {
  const std::string* v = args.value(name);
  return v ? parse_integer(*v, name, min, max) : fallback;
}

int default_threads() { return static_cast<int>(std::max(1u, std::thread::hardware_concurrency())); }

int threads_option(const arguments& args) {
  return static_cast<int>(integer_option(args, "--threads", default_threads(), 1, 1024));
}

std::vector<llama_token> parse_ids(const std::string& text) {
  std::vector<llama_token> ids;
  std::string item;
  std::istringstream in(text);
  while (in >> item) {
    std::string part;
    std::istringstream items(item);
    while (std::getline(items, part, ',')) {
      if (!part.empty()) {
        ids.push_back(static_cast<llama_token>(parse_integer(part, "a token id", 0, INT32_MAX)));
      }
    }
  }
  if (ids.empty()) {
    throw usage_error("--ids holds no token ids");
  }
  return ids;
}

ggml_type kv_type_option(const arguments& args, const char* fallback) {
  const std::string* v = args.value("--kv");
  const std::string name = v ? *v : fallback;
  if (name == "f32") {
    return GGML_TYPE_F32;
  }
  if (name == "f16") {
    return GGML_TYPE_F16;
  }
  throw usage_error("--kv must be f32 or f16, not '" + name + "'");
}

// ---------------------------------------------------------------------------------------------
// llama.cpp

struct log_state {
  bool verbose = false;
  ggml_log_level last = GGML_LOG_LEVEL_INFO;
  std::string cpu_backend;  // the ggml-cpu variant loaded for this CPU
};

void on_log(ggml_log_level level, const char* text, void* data) {
  auto& state = *static_cast<log_state*>(data);
  if (level == GGML_LOG_LEVEL_CONT) {
    level = state.last;
  } else {
    state.last = level;
  }
  const std::string_view line = text;
  constexpr std::string_view marker = "loaded CPU backend from ";
  if (const auto at = line.find(marker); at != std::string_view::npos) {
    std::string path(line.substr(at + marker.size()));
    while (!path.empty() && (path.back() == '\n' || path.back() == '\r')) {
      path.pop_back();
    }
    state.cpu_backend = std::filesystem::path(path).filename().string();
  }
  if (state.verbose || level == GGML_LOG_LEVEL_ERROR) {
    std::fputs(text, stderr);
  }
}

log_state g_log;

// Loads the CPU backend variants (ggml-cpu-<microarchitecture>.so) from the library directory (the
// best one for this CPU is kept) and initialises llama.cpp; once per process.
void start_llama(bool verbose) {
  g_log.verbose = verbose;
  llama_log_set(on_log, &g_log);
  const char* env = std::getenv("EFIM_LLAMA_LIB_DIR");
  const std::string dir = env && *env ? env : EFIM_LLAMA_LIB_DIR;
  ggml_backend_load_all_from_path(dir.c_str());
  llama_backend_init();
  if (ggml_backend_dev_count() == 0) {
    throw std::runtime_error("no ggml backend could be loaded from " + dir);
  }
}

std::string llama_version() {
  std::string v =
      std::string("llama.cpp ") + EFIM_LLAMA_VERSION + ", ggml " + ggml_version() + " (" + ggml_commit() + ")";
  if (!g_log.cpu_backend.empty()) {
    v += ", " + g_log.cpu_backend;
  }
  return v;
}

using model_ptr = llama_model_ptr;  // llama-cpp.h's owners
using context_ptr = llama_context_ptr;

model_ptr load_model(const std::string& path, bool extra_buffer_types) {
  if (!std::filesystem::exists(path)) {
    throw std::runtime_error(path + ": no such file");
  }
  llama_model_params params = llama_model_default_params();
  params.n_gpu_layers = 0;
  params.use_extra_bufts = extra_buffer_types;
  model_ptr model(llama_model_load_from_file(path.c_str(), params));
  if (!model) {
    throw std::runtime_error(path + ": llama.cpp could not load the model (--verbose shows why)");
  }
  return model;
}

struct context_options {
  uint32_t n_ctx = 0;
  uint32_t n_batch = 0;
  uint32_t n_ubatch = 0;
  int threads = 1;
  ggml_type kv = GGML_TYPE_F32;
  llama_flash_attn_type flash_attn = LLAMA_FLASH_ATTN_TYPE_DISABLED;
};

context_ptr make_context(llama_model* model, const context_options& o) {
  llama_context_params params = llama_context_default_params();
  params.n_ctx = std::max<uint32_t>(o.n_ctx, 8);
  params.n_batch = o.n_batch;
  params.n_ubatch = o.n_ubatch;
  params.n_seq_max = 1;
  params.n_threads = o.threads;
  params.n_threads_batch = o.threads;
  params.flash_attn_type = o.flash_attn;
  params.type_k = o.kv;
  params.type_v = o.kv;
  params.embeddings = false;
  params.no_perf = true;
  context_ptr ctx(llama_init_from_model(model, params));
  if (!ctx) {
    throw std::runtime_error("llama.cpp could not make a context (--verbose shows why)");
  }
  return ctx;
}

int32_t vocab_size(const llama_model* model) { return llama_vocab_n_tokens(llama_model_get_vocab(model)); }

void check_ids(const std::vector<llama_token>& ids, int32_t n_vocab) {
  for (const llama_token id : ids) {
    if (id < 0 || id >= n_vocab) {
      throw usage_error("token id " + std::to_string(id) + " is outside the vocabulary (" + std::to_string(n_vocab) +
                        " tokens)");
    }
  }
}

// Decodes ids at positions [first, first + n) in one llama_decode call (one micro-batch); `rows`
// says which positions output logits.
void decode(llama_context* ctx, llama_batch& batch, const llama_token* ids, int n, int first,
            const std::vector<bool>& rows) {
  batch.n_tokens = n;
  for (int j = 0; j < n; ++j) {
    batch.token[j] = ids[j];
    batch.pos[j] = first + j;
    batch.n_seq_id[j] = 1;
    batch.seq_id[j][0] = 0;
    batch.logits[j] = rows[static_cast<std::size_t>(j)] ? 1 : 0;
  }
  if (const int rc = llama_decode(ctx, batch); rc != 0) {
    throw std::runtime_error("llama_decode failed (" + std::to_string(rc) + ") at position " + std::to_string(first));
  }
}

void print_row(const float* logits, int32_t n_vocab, std::string& out) {
  char number[32];
  for (int32_t v = 0; v < n_vocab; ++v) {
    const int n = std::snprintf(number, sizeof number, "%.9g", static_cast<double>(logits[v]));
    if (v > 0) {
      out.push_back(' ');
    }
    out.append(number, static_cast<std::size_t>(n));
  }
  out.push_back('\n');
}

// Greedy choice: the largest logit, the lowest id among equal ones.
llama_token argmax(const float* logits, int32_t n_vocab) {
  llama_token best = 0;
  for (int32_t v = 1; v < n_vocab; ++v) {
    if (logits[v] > logits[best]) {
      best = v;
    }
  }
  return best;
}

std::string json_string(std::string_view s) {
  std::string out = "\"";
  for (const char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

std::string json_number(double v) {
  if (!std::isfinite(v)) {
    return "null";
  }
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

std::string meta(const llama_model* model, const std::string& key) {
  char buf[512];
  const int n = llama_model_meta_val_str(model, key.c_str(), buf, sizeof buf);
  return n < 0 ? std::string() : std::string(buf);
}

// ---------------------------------------------------------------------------------------------
// Subcommands

int cmd_quantize(int argc, char** argv) {
  const arguments args = parse_arguments(argc, argv, 2, 3, {"--threads"}, {});
  static const std::map<std::string, llama_ftype> types = {
      {"f16", LLAMA_FTYPE_MOSTLY_F16},   {"bf16", LLAMA_FTYPE_MOSTLY_BF16},     {"q8_0", LLAMA_FTYPE_MOSTLY_Q8_0},
      {"q4_0", LLAMA_FTYPE_MOSTLY_Q4_0}, {"q4_k_m", LLAMA_FTYPE_MOSTLY_Q4_K_M},
      {"q5_k_m", LLAMA_FTYPE_MOSTLY_Q5_K_M}, {"q6_k", LLAMA_FTYPE_MOSTLY_Q6_K},
  };
  const auto type = types.find(args.positional[2]);
  if (type == types.end()) {
    throw usage_error("TYPE must be one of f16 bf16 q8_0 q4_0 q4_k_m q5_k_m q6_k, not '" + args.positional[2] + "'");
  }
  const int threads = threads_option(args);
  if (!std::filesystem::exists(args.positional[0])) {
    throw std::runtime_error(args.positional[0] + ": no such file");
  }
  start_llama(args.has("--verbose"));
  llama_model_quantize_params params = llama_model_quantize_default_params();
  params.nthread = threads;
  params.ftype = type->second;
  if (llama_model_quantize(args.positional[0].c_str(), args.positional[1].c_str(), &params) != 0) {
    throw std::runtime_error("llama_model_quantize failed (--verbose shows why)");
  }
  return 0;
}

// ggml's own quantizer (ggml_quantize_chunk, no importance matrix: what `quantize` uses) on raw f32
// rows, so that another implementation's bytes can be compared with it.
int cmd_quantize_rows(int argc, char** argv) {
  const arguments args = parse_arguments(argc, argv, 2, 4, {}, {});
  static const std::map<std::string, ggml_type> types = {
      {"q4_0", GGML_TYPE_Q4_0}, {"q5_0", GGML_TYPE_Q5_0}, {"q5_1", GGML_TYPE_Q5_1}, {"q8_0", GGML_TYPE_Q8_0},
      {"q4_k", GGML_TYPE_Q4_K}, {"q5_k", GGML_TYPE_Q5_K}, {"q6_k", GGML_TYPE_Q6_K},
  };
  const auto type = types.find(args.positional[0]);
  if (type == types.end()) {
    throw usage_error("TYPE must be one of q4_0 q5_0 q5_1 q8_0 q4_k q5_k q6_k, not '" + args.positional[0] + "'");
  }
  const long long n = std::atoll(args.positional[1].c_str());
  if (n <= 0 || n % ggml_blck_size(type->second) != 0) {
    throw usage_error("N must be a positive multiple of " + std::to_string(ggml_blck_size(type->second)));
  }
  std::ifstream in(args.positional[2], std::ios::binary);
  if (!in) {
    throw std::runtime_error(args.positional[2] + ": cannot read");
  }
  const std::string bytes(std::istreambuf_iterator<char>(in), {});
  if (bytes.size() % (sizeof(float) * static_cast<std::size_t>(n)) != 0) {
    throw std::runtime_error(args.positional[2] + ": not a whole number of f32 rows of " + args.positional[1]);
  }
  const std::int64_t rows = static_cast<std::int64_t>(bytes.size() / (sizeof(float) * static_cast<std::size_t>(n)));
  std::vector<float> src(static_cast<std::size_t>(rows * n));
  std::memcpy(src.data(), bytes.data(), bytes.size());
  std::vector<char> dst(static_cast<std::size_t>(rows) * ggml_row_size(type->second, n));
  const std::size_t written = ggml_quantize_chunk(type->second, src.data(), dst.data(), 0, rows, n, nullptr);
  std::ofstream out(args.positional[3], std::ios::binary);
  out.write(dst.data(), static_cast<std::streamsize>(written));
  if (!out) {
    throw std::runtime_error(args.positional[3] + ": cannot write");
  }
  return 0;
}

int cmd_logits(int argc, char** argv) {
  const arguments args = parse_arguments(argc, argv, 2, 1, {"--ids", "--threads", "--kv", "--batch"}, {"--all"});
  if (!args.value("--ids")) {
    throw usage_error("logits needs --ids");
  }
  const std::vector<llama_token> ids = parse_ids(*args.value("--ids"));
  const int n = static_cast<int>(ids.size());
  const int batch_size = static_cast<int>(integer_option(args, "--batch", n, 1, 1 << 20));
  const bool all = args.has("--all");
  const int threads = threads_option(args);
  const ggml_type kv = kv_type_option(args, "f32");

  start_llama(args.has("--verbose"));
  const model_ptr model = load_model(args.positional[0], false);
  const int32_t n_vocab = vocab_size(model.get());
  check_ids(ids, n_vocab);
  const int chunk = std::min(batch_size, n);
  const context_ptr ctx = make_context(model.get(), {.n_ctx = static_cast<uint32_t>(n),
                                                     .n_batch = static_cast<uint32_t>(chunk),
                                                     .n_ubatch = static_cast<uint32_t>(chunk),
                                                     .threads = threads,
                                                     .kv = kv});
  llama_batch batch = llama_batch_init(chunk, 0, 1);
  std::string out;
  for (int first = 0; first < n; first += chunk) {
    const int count = std::min(chunk, n - first);
    std::vector<bool> rows(static_cast<std::size_t>(count), all);
    if (first + count == n) {
      rows.back() = true;
    }
    decode(ctx.get(), batch, ids.data() + first, count, first, rows);
    for (int j = 0; j < count; ++j) {
      if (rows[static_cast<std::size_t>(j)]) {
        const float* logits = llama_get_logits_ith(ctx.get(), j);
        if (!logits) {
          throw std::runtime_error("llama.cpp returned no logits for position " + std::to_string(first + j));
        }
        print_row(logits, n_vocab, out);
      }
    }
    std::fwrite(out.data(), 1, out.size(), stdout);
    out.clear();
  }
  llama_batch_free(batch);
  return 0;
}

int cmd_generate(int argc, char** argv) {
  const arguments args = parse_arguments(argc, argv, 2, 1, {"--ids", "--n", "--threads", "--kv"}, {});
  if (!args.value("--ids") || !args.value("--n")) {
    throw usage_error("generate needs --ids and --n");
  }
  const std::vector<llama_token> prompt = parse_ids(*args.value("--ids"));
  const int n_new = static_cast<int>(parse_integer(*args.value("--n"), "--n", 0, 1 << 20));
  const int threads = threads_option(args);
  const ggml_type kv = kv_type_option(args, "f32");

  start_llama(args.has("--verbose"));
  const model_ptr model = load_model(args.positional[0], false);
  const int32_t n_vocab = vocab_size(model.get());
  check_ids(prompt, n_vocab);
  const int n_prompt = static_cast<int>(prompt.size());
  const context_ptr ctx = make_context(model.get(), {.n_ctx = static_cast<uint32_t>(n_prompt + n_new),
                                                     .n_batch = static_cast<uint32_t>(n_prompt),
                                                     .n_ubatch = static_cast<uint32_t>(n_prompt),
                                                     .threads = threads,
                                                     .kv = kv});
  llama_batch batch = llama_batch_init(n_prompt, 0, 1);
  std::vector<bool> rows(static_cast<std::size_t>(n_prompt), false);
  rows.back() = true;
  decode(ctx.get(), batch, prompt.data(), n_prompt, 0, rows);
  std::vector<llama_token> generated;
  for (int i = 0; i < n_new; ++i) {
    const llama_token next = argmax(llama_get_logits_ith(ctx.get(), -1), n_vocab);
    generated.push_back(next);
    if (i + 1 < n_new) {
      decode(ctx.get(), batch, &next, 1, n_prompt + i, {true});
    }
  }
  llama_batch_free(batch);
  std::string out;
  for (std::size_t i = 0; i < generated.size(); ++i) {
    if (i > 0) {
      out += ' ';
    }
    out += std::to_string(generated[i]);
  }
  std::printf("%s\n", out.c_str());
  return 0;
}

// Like llama-bench's pp and tg tests: a warm-up (one prompt batch, one generated token), then per
// repetition the prompt of random ids as one llama_decode from an empty cache, and the generation
// as tg single-token decodes from an empty cache. llama-bench's defaults otherwise: an f16 KV cache,
// flash attention "auto", micro-batches of 512, weight repacking on.
int cmd_bench(int argc, char** argv) {
  const arguments args =
      parse_arguments(argc, argv, 2, 1, {"--pp", "--tg", "--threads", "--reps", "--kv", "--fa", "--ubatch"}, {});
  const int pp = static_cast<int>(integer_option(args, "--pp", 512, 0, 1 << 20));
  const int tg = static_cast<int>(integer_option(args, "--tg", 128, 0, 1 << 20));
  const int reps = static_cast<int>(integer_option(args, "--reps", 3, 1, 1000));
  const int ubatch = static_cast<int>(integer_option(args, "--ubatch", 512, 1, 1 << 20));
  const int threads = threads_option(args);
  const ggml_type kv = kv_type_option(args, "f16");
  const std::string fa = args.value("--fa") ? *args.value("--fa") : "auto";
  static const std::map<std::string, llama_flash_attn_type> fa_types = {{"auto", LLAMA_FLASH_ATTN_TYPE_AUTO},
                                                                        {"on", LLAMA_FLASH_ATTN_TYPE_ENABLED},
                                                                        {"off", LLAMA_FLASH_ATTN_TYPE_DISABLED}};
  if (!fa_types.count(fa)) {
    throw usage_error("--fa must be auto, on or off, not '" + fa + "'");
  }
  if (pp == 0 && tg == 0) {
    throw usage_error("nothing to measure: --pp 0 and --tg 0");
  }

  start_llama(args.has("--verbose"));
  const model_ptr model = load_model(args.positional[0], true);
  const int32_t n_vocab = vocab_size(model.get());
  const context_ptr ctx =
      make_context(model.get(), {.n_ctx = static_cast<uint32_t>(std::max(pp, tg)),
                                 .n_batch = static_cast<uint32_t>(std::max(pp, 1)),
                                 .n_ubatch = static_cast<uint32_t>(std::min(std::max(pp, 1), ubatch)),
                                 .threads = threads,
                                 .kv = kv,
                                 .flash_attn = fa_types.at(fa)});
  std::mt19937 rng(1234);
  std::uniform_int_distribution<llama_token> pick(0, n_vocab - 1);
  std::vector<llama_token> tokens(static_cast<std::size_t>(std::max(pp, 1)));
  llama_memory_t memory = llama_get_memory(ctx.get());
  using clock = std::chrono::steady_clock;

  const auto run_prompt = [&] {
    std::generate(tokens.begin(), tokens.end(), [&] { return pick(rng); });
    if (llama_decode(ctx.get(), llama_batch_get_one(tokens.data(), pp)) != 0) {
      throw std::runtime_error("llama_decode failed on the prompt");
    }
    llama_synchronize(ctx.get());
  };
  const auto run_generation = [&](int n) {
    llama_token token = pick(rng);
    for (int i = 0; i < n; ++i) {
      if (llama_decode(ctx.get(), llama_batch_get_one(&token, 1)) != 0) {
        throw std::runtime_error("llama_decode failed on a generated token");
      }
      llama_synchronize(ctx.get());
      token = pick(rng);
    }
  };
  if (pp > 0) {
    llama_memory_clear(memory, true);
    run_prompt();
  }
  if (tg > 0) {
    llama_memory_clear(memory, true);
    run_generation(1);
  }
  std::vector<double> pp_rates;
  std::vector<double> tg_rates;
  for (int r = 0; r < reps; ++r) {
    if (pp > 0) {
      llama_memory_clear(memory, true);
      const auto t0 = clock::now();
      run_prompt();
      pp_rates.push_back(pp / std::chrono::duration<double>(clock::now() - t0).count());
    }
    if (tg > 0) {
      llama_memory_clear(memory, true);
      const auto t0 = clock::now();
      run_generation(tg);
      tg_rates.push_back(tg / std::chrono::duration<double>(clock::now() - t0).count());
    }
  }
  const auto median = [](std::vector<double> v) {
    if (v.empty()) {
      return std::nan("");
    }
    std::sort(v.begin(), v.end());
    const std::size_t m = v.size() / 2;
    return v.size() % 2 ? v[m] : (v[m - 1] + v[m]) / 2;
  };
  const auto best = [](const std::vector<double>& v) {
    return v.empty() ? std::nan("") : *std::max_element(v.begin(), v.end());
  };
  char desc[256];
  llama_model_desc(model.get(), desc, sizeof desc);
  std::printf(
      "{\"pp_tokens_per_s\":%s,\"tg_tokens_per_s\":%s,\"statistic\":\"median\",\"pp_best\":%s,\"tg_best\":%s,"
      "\"pp\":%d,\"tg\":%d,\"threads\":%d,\"reps\":%d,\"kv\":\"%s\",\"flash_attn\":\"%s\",\"ubatch\":%d,"
      "\"model\":%s,\"llama_cpp\":%s}\n",
      json_number(median(pp_rates)).c_str(), json_number(median(tg_rates)).c_str(), json_number(best(pp_rates)).c_str(),
      json_number(best(tg_rates)).c_str(), pp, tg, threads, reps, kv == GGML_TYPE_F16 ? "f16" : "f32", fa.c_str(),
      std::min(std::max(pp, 1), ubatch), json_string(desc).c_str(), json_string(llama_version()).c_str());
  return 0;
}

// llama.cpp's tokenizer on the text of a file: llama_tokenize with nothing added (no BOS) and
// special-token text left as text (parse_special off: llama.cpp still finds its user-defined tokens),
// the ids on one line. VOCAB may be a vocabulary-only GGUF file.
int cmd_tokenize(int argc, char** argv) {
  const arguments args = parse_arguments(argc, argv, 2, 2, {}, {});
  start_llama(args.has("--verbose"));
  llama_model_params params = llama_model_default_params();
  params.vocab_only = true;
  const model_ptr model(llama_model_load_from_file(args.positional[0].c_str(), params));
  if (!model) {
    throw std::runtime_error(args.positional[0] + ": llama.cpp could not load the vocabulary");
  }
  std::ifstream in(args.positional[1], std::ios::binary);
  if (!in) {
    throw std::runtime_error(args.positional[1] + ": cannot read");
  }
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (text.size() > (1u << 30)) {
    throw std::runtime_error(args.positional[1] + ": larger than 1 GiB");
  }
  const llama_vocab* vocab = llama_model_get_vocab(model.get());
  std::vector<llama_token> ids(text.size() + 16);
  const auto tokenize = [&] {
    return llama_tokenize(vocab, text.data(), static_cast<int32_t>(text.size()), ids.data(),
                          static_cast<int32_t>(ids.size()), false, false);
  };
  int32_t n = tokenize();
  if (n < 0) {
    ids.resize(static_cast<std::size_t>(-n));
    n = tokenize();
  }
  if (n < 0) {
    throw std::runtime_error("llama_tokenize failed");
  }
  for (int32_t i = 0; i < n; ++i) {
    std::printf(i == 0 ? "%d" : " %d", ids[static_cast<std::size_t>(i)]);
  }
  std::printf("\n");
  return 0;
}

// llama.cpp's tokenizer timed on every .txt file of a directory (in name order), as efim's
// tokenizer benchmark times efim's: the best of --repeat passes over all files, one thread, and the
// vocabulary's load time. --ids writes each file's ids, one line per file, for the caller to check.
int cmd_tokenize_bench(int argc, char** argv) {
  const arguments args = parse_arguments(argc, argv, 2, 2, {"--repeat", "--ids"}, {});
  start_llama(args.has("--verbose"));
  const int repeat = static_cast<int>(integer_option(args, "--repeat", 3, 1, 1000));
  std::vector<std::filesystem::path> files;
  for (const auto& e : std::filesystem::directory_iterator(args.positional[1])) {
    if (e.path().extension() == ".txt") {
      files.push_back(e.path());
    }
  }
  std::sort(files.begin(), files.end());
  std::vector<std::string> texts;
  std::size_t bytes = 0;
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    texts.emplace_back((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (texts.back().size() > (1u << 30)) {
      throw std::runtime_error(f.string() + ": larger than 1 GiB");
    }
    bytes += texts.back().size();
  }
  if (texts.empty()) {
    throw std::runtime_error(args.positional[1] + ": no .txt files");
  }
  llama_model_params params = llama_model_default_params();
  params.vocab_only = true;
  const auto load_start = std::chrono::steady_clock::now();
  const model_ptr model(llama_model_load_from_file(args.positional[0].c_str(), params));
  const double load_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count();
  if (!model) {
    throw std::runtime_error(args.positional[0] + ": llama.cpp could not load the vocabulary");
  }
  const llama_vocab* vocab = llama_model_get_vocab(model.get());
  std::vector<llama_token> ids;
  const auto tokenize = [&](const std::string& text) {
    ids.resize(text.size() + 16);
    const int32_t n = llama_tokenize(vocab, text.data(), static_cast<int32_t>(text.size()), ids.data(),
                                     static_cast<int32_t>(ids.size()), false, false);
    if (n < 0) {
      throw std::runtime_error("llama_tokenize failed");
    }
    ids.resize(static_cast<std::size_t>(n));
  };
  std::size_t tokens = 0;
  std::FILE* out = nullptr;
  if (const std::string* path = args.value("--ids")) {
    out = std::fopen(path->c_str(), "w");
    if (out == nullptr) {
      throw std::runtime_error(*path + ": cannot write");
    }
  }
  for (const auto& t : texts) {
    tokenize(t);
    tokens += ids.size();
    if (out != nullptr) {
      for (std::size_t i = 0; i < ids.size(); ++i) {
        std::fprintf(out, i == 0 ? "%d" : " %d", ids[i]);
      }
      std::fprintf(out, "\n");
    }
  }
  if (out != nullptr) {
    std::fclose(out);
  }
  double best_seconds = 1e30;
  for (int r = 0; r < repeat; ++r) {
    const auto start = std::chrono::steady_clock::now();
    for (const auto& t : texts) {
      tokenize(t);
    }
    best_seconds = std::min(best_seconds, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::printf("{\"files\":%zu,\"bytes\":%zu,\"tokens\":%zu,\"seconds\":%s,\"load_seconds\":%s,\"llama_cpp\":%s}\n",
              texts.size(), bytes, tokens, json_number(best_seconds).c_str(), json_number(load_seconds).c_str(),
              json_string(llama_version()).c_str());
  return 0;
}

// The model as llama.cpp loaded it, plus the file's float metadata read exactly (llama.cpp's
// metadata strings print floats with %f) and the tensor types (what llama_model_quantize chose).
int cmd_info(int argc, char** argv) {
  const arguments args = parse_arguments(argc, argv, 2, 1, {}, {});
  start_llama(args.has("--verbose"));
  const std::string& path = args.positional[0];
  const model_ptr model = load_model(path, false);
  const llama_model* m = model.get();
  const std::string arch = meta(m, "general.architecture");
  const char* rope = "unknown";
  switch (llama_model_rope_type(m)) {
    case LLAMA_ROPE_TYPE_NONE:
      rope = "none";
      break;
    case LLAMA_ROPE_TYPE_NORM:
      rope = "norm";
      break;
    case LLAMA_ROPE_TYPE_NEOX:
      rope = "neox";
      break;
    case LLAMA_ROPE_TYPE_MROPE:
      rope = "mrope";
      break;
    case LLAMA_ROPE_TYPE_IMROPE:
      rope = "imrope";
      break;
    case LLAMA_ROPE_TYPE_VISION:
      rope = "vision";
      break;
  }

  gguf_init_params params{};
  params.no_alloc = true;
  params.ctx = nullptr;
  const std::unique_ptr<gguf_context, decltype(&gguf_free)> file(gguf_init_from_file(path.c_str(), params), gguf_free);
  if (!file) {
    throw std::runtime_error(path + ": gguf could not read the file");
  }
  const auto value = [&](const std::string& key) -> std::string {
    const int64_t id = gguf_find_key(file.get(), key.c_str());
    if (id < 0) {
      return "null";
    }
    switch (gguf_get_kv_type(file.get(), id)) {
      case GGUF_TYPE_FLOAT32:
        return json_number(gguf_get_val_f32(file.get(), id));
      case GGUF_TYPE_UINT32:
        return std::to_string(gguf_get_val_u32(file.get(), id));
      case GGUF_TYPE_STRING:
        return json_string(gguf_get_val_str(file.get(), id));
      default:
        return json_string(meta(m, key));
    }
  };
  std::map<std::string, int> type_counts;
  for (int64_t t = 0; t < gguf_get_n_tensors(file.get()); ++t) {
    ++type_counts[ggml_type_name(gguf_get_tensor_type(file.get(), t))];
  }
  std::string types = "{";
  for (const auto& [name, count] : type_counts) {
    if (types.size() > 1) {
      types += ',';
    }
    types += json_string(name) + ":" + std::to_string(count);
  }
  types += "}";
  const auto tensor_type = [&](const char* name) {
    const int64_t id = gguf_find_tensor(file.get(), name);
    return id < 0 ? std::string("null") : json_string(ggml_type_name(gguf_get_tensor_type(file.get(), id)));
  };

  char desc[256];
  llama_model_desc(m, desc, sizeof desc);
  std::printf(
      "{\"architecture\":%s,\"n_vocab\":%d,\"n_embd\":%d,\"n_layer\":%d,\"n_head\":%d,\"n_head_kv\":%d,"
      "\"n_ctx_train\":%d,\"rope_type\":\"%s\",\"rope_freq_base\":%s,\"rope_scaling_type\":%s,"
      "\"rope_scaling_factor\":%s,\"rope_freq_scale_train\":%s,\"rms_norm_eps\":%s,\"norm_eps\":%s,"
      "\"tokenizer\":%s,\"tokenizer_pre\":%s,\"file_type\":%s,\"tied_output\":%s,\"token_embd_type\":%s,"
      "\"output_type\":%s,\"tensor_types\":%s,\"n_params\":%llu,\"size_bytes\":%llu,\"desc\":%s,\"llama_cpp\":%s}\n",
      json_string(arch).c_str(), vocab_size(m), llama_model_n_embd(m), llama_model_n_layer(m), llama_model_n_head(m),
      llama_model_n_head_kv(m), llama_model_n_ctx_train(m), rope, value(arch + ".rope.freq_base").c_str(),
      value(arch + ".rope.scaling.type").c_str(), value(arch + ".rope.scaling.factor").c_str(),
      json_number(llama_model_rope_freq_scale_train(m)).c_str(),
      value(arch + ".attention.layer_norm_rms_epsilon").c_str(), value(arch + ".attention.layer_norm_epsilon").c_str(),
      value("tokenizer.ggml.model").c_str(), value("tokenizer.ggml.pre").c_str(), value("general.file_type").c_str(),
      gguf_find_tensor(file.get(), "output.weight") < 0 ? "true" : "false", tensor_type("token_embd.weight").c_str(),
      tensor_type("output.weight").c_str(), types.c_str(), static_cast<unsigned long long>(llama_model_n_params(m)),
      static_cast<unsigned long long>(llama_model_size(m)), json_string(desc).c_str(),
      json_string(llama_version()).c_str());
  return 0;
}

// ---------------------------------------------------------------------------------------------
// smoke: ctest's llama_reference_smoke. For each architecture: a small random model made by
// make_model.py, loaded by llama.cpp, its logits deterministic, finite and neither flat nor
// one-hot, generation reproducible and consistent with the logits, q8_0 and q4_0 quantizations
// loadable, and batched evaluation equal to one batch within 1e-4 of the largest logit.

struct process_result {
  int status = -1;
  std::string out;
};

process_result run_process(const std::vector<std::string>& command, bool quiet_stderr = false) {
  int pipe_fds[2];
  if (pipe(pipe_fds) != 0) {
    throw std::runtime_error("pipe failed");
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, pipe_fds[1], 1);
  posix_spawn_file_actions_addclose(&actions, pipe_fds[0]);
  posix_spawn_file_actions_addclose(&actions, pipe_fds[1]);
  if (quiet_stderr) {
    posix_spawn_file_actions_addopen(&actions, 2, "/dev/null", O_WRONLY, 0);
  }
  std::vector<char*> argv;
  for (const std::string& arg : command) {
    argv.push_back(const_cast<char*>(arg.c_str()));
  }
  argv.push_back(nullptr);
  pid_t pid = 0;
  const int rc = posix_spawnp(&pid, argv[0], &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  close(pipe_fds[1]);
  process_result result;
  if (rc != 0) {
    close(pipe_fds[0]);
    return result;
  }
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = read(pipe_fds[0], buf, sizeof buf);
    if (n < 0 && errno == EINTR) {
      continue;
    }
    if (n <= 0) {
      break;
    }
    result.out.append(buf, static_cast<std::size_t>(n));
  }
  close(pipe_fds[0]);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  result.status = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return result;
}

std::string quoted(const std::vector<std::string>& command) {
  std::string s;
  for (const std::string& arg : command) {
    if (!s.empty()) {
      s += ' ';
    }
    s += arg.find(' ') == std::string::npos ? arg : "'" + arg + "'";
  }
  return s;
}

struct smoke_failure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

std::string must_run(const std::vector<std::string>& command) {
  process_result r = run_process(command);
  if (r.status != 0) {
    throw smoke_failure("`" + quoted(command) + "` failed (exit " + std::to_string(r.status) + ")");
  }
  return r.out;
}

std::vector<std::vector<double>> parse_rows(const std::string& text) {
  std::vector<std::vector<double>> rows;
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    std::vector<double> row;
    const char* p = line.c_str();
    char* end = nullptr;
    for (;;) {
      const double v = std::strtod(p, &end);
      if (end == p) {
        break;
      }
      row.push_back(v);
      p = end;
    }
    rows.push_back(std::move(row));
  }
  return rows;
}

std::vector<long> parse_longs(const std::string& text) {
  std::vector<long> v;
  std::istringstream in(text);
  long x = 0;
  while (in >> x) {
    v.push_back(x);
  }
  return v;
}

// max |a - b| / max |a|
double relative_difference(const std::vector<double>& a, const std::vector<double>& b) {
  double diff = 0;
  double scale = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::abs(a[i] - b[i]));
    scale = std::max(scale, std::abs(a[i]));
  }
  return scale > 0 ? diff / scale : diff;
}

struct row_stats {
  bool finite = true;
  double top_probability = 0;
  std::size_t top = 0;
};

row_stats stats(const std::vector<double>& row) {
  row_stats s;
  double top = -INFINITY;
  for (std::size_t i = 0; i < row.size(); ++i) {
    if (!std::isfinite(row[i])) {
      s.finite = false;
      return s;
    }
    if (row[i] > top) {
      top = row[i];
      s.top = i;
    }
  }
  double sum = 0;
  for (const double v : row) {
    sum += std::exp(v - top);
  }
  s.top_probability = 1 / sum;
  return s;
}

std::string extract_json_field(const std::string& json, const std::string& key) {
  const std::string marker = "\"" + key + "\":";
  const auto at = json.find(marker);
  if (at == std::string::npos) {
    return {};
  }
  auto begin = at + marker.size();
  auto end = begin;
  if (json[begin] == '"') {
    end = json.find('"', begin + 1) + 1;
  } else {
    end = json.find_first_of(",}", begin);
  }
  return json.substr(begin, end - begin);
}

struct smoke_case {
  std::string arch;
  std::vector<std::string> make_args;
  std::string ids;
  long n_vocab;
};

void smoke_one(const smoke_case& c, const std::string& self, const std::vector<std::string>& python_make,
               const std::string& work, const std::string& threads) {
  const auto fail = [&](const std::string& what) { throw smoke_failure(c.arch + ": " + what); };
  const auto t0 = std::chrono::steady_clock::now();
  const std::string model = work + "/" + c.arch + "-f32.gguf";
  std::vector<std::string> make = python_make;
  make.insert(make.end(), c.make_args.begin(), c.make_args.end());
  make.push_back(model);
  std::string summary = must_run(make);

  // llama.cpp loads it, with the shape it was given.
  const std::string info = must_run({self, "info", model});
  const std::string expected_arch = "\"" + c.arch + "\"";
  if (extract_json_field(info, "architecture") != expected_arch || extract_json_field(info, "n_embd") != "64" ||
      extract_json_field(info, "n_layer") != "2" || extract_json_field(info, "n_head") != "4" ||
      extract_json_field(info, "n_head_kv") != "2" ||
      extract_json_field(info, "n_vocab") != std::to_string(c.n_vocab)) {
    fail("info disagrees with the model: " + info);
  }
  const std::string rope = extract_json_field(info, "rope_type");
  if (rope != (c.arch == "llama" ? "\"norm\"" : "\"neox\"")) {
    fail("unexpected rope type " + rope);
  }

  // logits: deterministic, finite, not degenerate.
  const std::vector<std::string> logits = {self, "logits", model, "--ids", c.ids, "--threads", threads};
  const std::string first = must_run(logits);
  if (must_run(logits) != first) {
    fail("two runs of logits differ");
  }
  const auto rows = parse_rows(first);
  if (rows.size() != 1 || static_cast<long>(rows[0].size()) != c.n_vocab) {
    fail("logits printed " + std::to_string(rows.size()) + " rows of " +
         std::to_string(rows.empty() ? 0 : rows[0].size()) + " numbers, not 1 of " + std::to_string(c.n_vocab));
  }
  const row_stats s = stats(rows[0]);
  if (!s.finite) {
    fail("logits are not finite");
  }
  if (!(s.top_probability >= 1e-4 && s.top_probability <= 0.99)) {
    fail("the top token's probability is " + std::to_string(s.top_probability) + ", outside [1e-4, 0.99]");
  }

  // Every position's logits, evaluated 3 tokens a batch: finite, and the last row equal to the
  // single batch's within 1e-4 of the largest logit.
  std::vector<std::string> batched = logits;
  batched.insert(batched.end(), {"--all", "--batch", "3"});
  const auto rows3 = parse_rows(must_run(batched));
  const std::size_t n_ids = parse_longs(c.ids).size();
  if (rows3.size() != n_ids || std::any_of(rows3.begin(), rows3.end(), [&](const std::vector<double>& row) {
        return row.size() != rows[0].size() || !stats(row).finite;
      })) {
    fail("--all --batch 3 did not print " + std::to_string(n_ids) + " rows of finite logits");
  }
  const double d3 = relative_difference(rows[0], rows3.back());
  if (!(d3 <= 1e-4)) {
    fail("--all --batch 3 differs from one batch by " + std::to_string(d3) + " of the largest logit");
  }

  // An f16 KV cache: close, not equal.
  std::vector<std::string> f16_kv = logits;
  f16_kv.insert(f16_kv.end(), {"--kv", "f16"});
  const auto rows_f16 = parse_rows(must_run(f16_kv));
  const double d_f16 = rows_f16.size() == 1 && rows_f16[0].size() == rows[0].size()
                           ? relative_difference(rows[0], rows_f16[0])
                           : INFINITY;
  if (!(d_f16 <= 1e-2)) {
    fail("--kv f16 differs from f32 by " + std::to_string(d_f16) + " of the largest logit");
  }

  // Greedy generation: reproducible, and its first token is the logits' argmax.
  const std::vector<std::string> generate = {self, "generate", model, "--ids", c.ids, "--n", "8", "--threads", threads};
  const std::string generated = must_run(generate);
  if (must_run(generate) != generated) {
    fail("two runs of generate differ");
  }
  const std::vector<long> gen_ids = parse_longs(generated);
  if (gen_ids.size() != 8 ||
      std::any_of(gen_ids.begin(), gen_ids.end(), [&](long id) { return id < 0 || id >= c.n_vocab; })) {
    fail("generate printed '" + generated + "', not 8 ids in the vocabulary");
  }
  if (static_cast<std::size_t>(gen_ids[0]) != s.top) {
    fail("generate's first token " + std::to_string(gen_ids[0]) + " is not the logits' argmax " +
         std::to_string(s.top));
  }

  // llama.cpp's own quantizations load and give finite logits.
  std::string quantized;
  for (const char* type : {"q8_0", "q4_0"}) {
    const std::string out = work + "/" + c.arch + "-" + type + ".gguf";
    must_run({self, "quantize", model, out, type, "--threads", threads});
    const auto q = parse_rows(must_run({self, "logits", out, "--ids", c.ids, "--threads", threads}));
    if (q.size() != 1 || q[0].size() != rows[0].size() || !stats(q[0]).finite) {
      fail(std::string("the ") + type + " model does not give finite logits");
    }
    quantized +=
        std::string(quantized.empty() ? "" : ", ") + type + " " + json_number(relative_difference(rows[0], q[0]));
    std::filesystem::remove(out);
  }
  std::filesystem::remove(model);
  while (!summary.empty() && summary.back() == '\n') {
    summary.pop_back();
  }
  std::printf(
      "llama_reference_smoke: %s ok (%.1f s): top p %.3g; differences from the f32 logits, of the largest logit: "
      "--batch 3 %.2g, --kv f16 %.2g, %s\n"
      "  %s\n",
      c.arch.c_str(), std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), s.top_probability,
      d3, d_f16, quantized.c_str(), summary.c_str());
  std::fflush(stdout);
}

int cmd_smoke(int argc, char** argv) {
  const arguments args =
      parse_arguments(argc, argv, 2, 0, {"--python", "--make-model", "--vocab-dir", "--work", "--threads"}, {});
  if (!args.value("--make-model") || !args.value("--vocab-dir") || !args.value("--work")) {
    throw usage_error("smoke needs --make-model, --vocab-dir and --work");
  }
  const std::string script = *args.value("--make-model");
  const std::string vocab_dir = *args.value("--vocab-dir");
  const std::string work = *args.value("--work");
  // One thread unless told otherwise: on a loaded machine ggml's spinning thread barriers make
  // these tiny graphs slower with more threads than with one.
  const std::string threads = std::to_string(integer_option(args, "--threads", 1, 1, 1024));
  std::vector<std::string> pythons =
      args.values.count("--python") ? args.values.at("--python") : std::vector<std::string>{};
  if (pythons.empty()) {
    pythons = {"python3", "/usr/bin/python3"};
  }

  // The first python that runs make_model.py (numpy, yaml and gguf-py importable).
  std::string python;
  for (const std::string& candidate : pythons) {
    if (run_process({candidate, script, "--help"}, true).status == 0) {
      python = candidate;
      break;
    }
  }
  if (python.empty()) {
    std::printf(
        "llama_reference_smoke: skipped: no python3 (tried %s) imports numpy, yaml and gguf-py for %s; "
        "install python3-numpy and python3-yaml, and run .ci/setup\n",
        quoted(pythons).c_str(), script.c_str());
    return 0;
  }
  const std::string qwen_vocab = vocab_dir + "/ggml-vocab-qwen2.5-coder.gguf";
  const std::string starcoder_vocab = vocab_dir + "/ggml-vocab-starcoder.gguf";
  for (const std::string& v : {qwen_vocab, starcoder_vocab}) {
    if (!std::filesystem::exists(v)) {
      std::printf("llama_reference_smoke: skipped: no %s (the shared vocabularies)\n", v.c_str());
      return 0;
    }
  }
  std::filesystem::create_directories(work);
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  const std::vector<std::string> shape = {"--type", "f32",        "--hidden", "64",    "--layers", "2",      "--heads",
                                          "4",      "--kv-heads", "2",        "--ffn", "128",      "--seed", "7"};
  const auto with = [&](std::initializer_list<std::string> extra) {
    std::vector<std::string> v = shape;
    v.insert(v.end(), extra);
    return v;
  };
  // llama untied, qwen2 tied (as Qwen2.5-Coder 0.5B and 1.5B are), starcoder2 tied with a padded
  // token list; a llama without a tokenizer checks that linear rope scaling changes the logits.
  const std::vector<smoke_case> cases = {
      {"llama", with({"--arch", "llama", "--vocab", qwen_vocab}), "9707 11 1879 0 220 16 17 18 100 3000", 151936},
      {"qwen2", with({"--arch", "qwen2", "--tied", "--vocab", qwen_vocab}), "9707 11 1879 0 220 16 17 18 100 3000",
       151936},
      {"starcoder2", with({"--arch", "starcoder2", "--tied", "--vocab", starcoder_vocab, "--pad-vocab", "49216"}),
       "7 8 9 100 2000 30000 49151 1 2 3", 49216},
  };
  try {
    for (const smoke_case& c : cases) {
      smoke_one(c, self, {python, script}, work, threads);
    }
    // Linear rope scaling: the same weights with and without it give different logits, and
    // llama.cpp reads the factor.
    const std::vector<std::string> make = {python, script, "--arch", "llama", "--vocab-size", "300", "--seed", "3"};
    const std::string plain = work + "/llama-rope.gguf";
    const std::string scaled = work + "/llama-rope-linear4.gguf";
    std::vector<std::string> m1 = make, m2 = make;
    m1.push_back(plain);
    m2.insert(m2.end(), {"--rope-scaling", "linear", "--rope-scaling-factor", "4", scaled});
    must_run(m1);
    must_run(m2);
    const std::string info = must_run({self, "info", scaled});
    if (extract_json_field(info, "rope_freq_scale_train") != "0.25" || extract_json_field(info, "n_vocab") != "300") {
      throw smoke_failure("llama with linear rope scaling 4: info says " + info);
    }
    const std::string ids = "1 2 3 4 5 6 7 8 9 10 11 12";
    const auto a = parse_rows(must_run({self, "logits", plain, "--ids", ids, "--threads", threads}));
    const auto b = parse_rows(must_run({self, "logits", scaled, "--ids", ids, "--threads", threads}));
    const double d = a.size() == 1 && b.size() == 1 && a[0].size() == b[0].size() ? relative_difference(a[0], b[0]) : 0;
    if (!(d > 1e-4)) {
      throw smoke_failure("linear rope scaling does not change the logits");
    }
    std::filesystem::remove(plain);
    std::filesystem::remove(scaled);
    std::printf(
        "llama_reference_smoke: linear rope scaling ok (no tokenizer, 300 dummy tokens; logits move by %.2g)\n"
        "llama_reference_smoke: passed with %s\n",
        d, extract_json_field(info, "llama_cpp").c_str());
  } catch (const smoke_failure& e) {
    std::printf("llama_reference_smoke: FAILED: %s (files in %s)\n", e.what(), work.c_str());
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fputs(usage_text, stderr);
    return 2;
  }
  const std::string command = argv[1];
  static const std::pair<std::string_view, int (*)(int, char**)> commands[] = {
      {"quantize", cmd_quantize}, {"quantize-rows", cmd_quantize_rows}, {"logits", cmd_logits}, {"generate", cmd_generate}, {"bench", cmd_bench},
      {"info", cmd_info},         {"smoke", cmd_smoke},   {"tokenize", cmd_tokenize},
      {"tokenize-bench", cmd_tokenize_bench}};
  try {
    for (const auto& [name, run] : commands) {
      if (command == name) {
        return run(argc, argv);
      }
    }
    if (command == "--help" || command == "-h" || command == "help") {
      std::fputs(usage_text, stdout);
      return 0;
    }
    throw usage_error("unknown command '" + command + "'");
  } catch (const usage_error& e) {
    std::fprintf(stderr, "efim-llama-reference: %s\n%s", e.what(), usage_text);
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "efim-llama-reference %s: %s\n", command.c_str(), e.what());
    return 1;
  }
}
