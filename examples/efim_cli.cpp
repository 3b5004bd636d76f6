// efim-cli: one completion of a prompt with a GGUF model.
//
//   efim-cli complete --model FILE (--prompt TEXT | --prompt-file FILE) --n-predict N [--temperature T] [--ids]
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "arguments.hpp"
#include "efim/efim.hpp"

namespace {
const char* const usage = R"(usage: efim-cli complete --model FILE (--prompt TEXT | --prompt-file FILE) [options]

Runs one completion with the model and tokenizer of a GGUF file and prints the generated text (or ids).
Special-token text in the prompt (such as <|fim_prefix|>) stands for those tokens.
  --n-predict N      tokens to generate at most (16)
  --temperature T    0 picks the most likely token (0)
  --top-k K          sample from the K most likely tokens (0: all)
  --top-p P          sample from the most likely tokens whose probability reaches P (1)
  --seed S           for sampling (0)
  --ignore-eos       go on past the end-of-text token
  --ids              print the generated token ids, separated by spaces, instead of text
  --threads N        compute threads (0: all cores)
  --kv TYPE          KV cache in f32 or f16 (f32)
  --products P       int8 (quantized weights times activations rounded to 8 bits, as llama.cpp
                     does) or exact (f32 activations; f32, f16 and bf16 weights are exact either
                     way) (int8)
  --no-mmap          read the model file into memory instead of mapping it
)";

[[noreturn]] void fail(const std::string& message, int code = 2) { efim_examples::fail("efim-cli", message, code); }
double number(std::string_view flag, const std::string& text) { return efim_examples::number("efim-cli", flag, text); }
std::size_t count(std::string_view flag, const std::string& text) {
  return efim_examples::count("efim-cli", flag, text);
}

// The special token a GGUF file names under `key`, if it does.
std::optional<efim::token_id> special(const efim::gguf::file& f, std::string_view key) {
  const auto* v = f.find(key);
  if (!v) return std::nullopt;
  if (const auto* u = std::get_if<std::uint64_t>(&v->v)) return static_cast<efim::token_id>(*u);
  if (const auto* i = std::get_if<std::int64_t>(&v->v)) return static_cast<efim::token_id>(*i);
  return std::nullopt;
}

int complete(int argc, char** argv) {
  std::string model_path, prompt;
  bool have_prompt = false, ids = false, ignore_eos = false;
  std::size_t n_predict = 16, top_k = 0, threads = 0;
  double temperature = 0, top_p = 1;
  std::uint64_t seed = 0;
  efim::dtype kv_type = efim::dtype::f32;
  efim::kernels::products products = efim::kernels::products::int8;
  efim::gguf::residency residency = efim::gguf::residency::map;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    const auto value = [&]() -> std::string {
      if (i + 1 >= argc) fail(a + " needs a value");
      return argv[++i];
    };
    if (a == "--model") {
      model_path = value();
    } else if (a == "--no-mmap") {
      residency = efim::gguf::residency::read;
    } else if (a == "--prompt") {
      if (have_prompt) fail("one of --prompt and --prompt-file, once");
      prompt = value();
      have_prompt = true;
    } else if (a == "--prompt-file") {
      if (have_prompt) fail("one of --prompt and --prompt-file, once");
      const std::string path = value();
      std::ifstream in(path, std::ios::binary);
      if (!in) fail("cannot open " + path, 1);
      std::stringstream s;
      s << in.rdbuf();
      prompt = s.str();
      have_prompt = true;
    } else if (a == "--n-predict") {
      n_predict = count(a, value());
    } else if (a == "--temperature") {
      temperature = number(a, value());
    } else if (a == "--top-k") {
      top_k = count(a, value());
    } else if (a == "--top-p") {
      top_p = number(a, value());
    } else if (a == "--seed") {
      seed = count(a, value());
    } else if (a == "--threads") {
      threads = count(a, value());
    } else if (a == "--kv") {
      kv_type = efim::parse_dtype(value());
    } else if (a == "--products") {
      products = efim::kernels::parse_products(value());
    } else if (a == "--ids") {
      ids = true;
    } else if (a == "--ignore-eos") {
      ignore_eos = true;
    } else {
      fail("unknown option " + a + " (see --help)");
    }
  }
  if (model_path.empty()) fail("--model FILE is required (see --help)");
  if (!have_prompt) fail("--prompt TEXT or --prompt-file FILE is required (see --help)");
  if (!(temperature >= 0 && top_p > 0 && top_p <= 1)) fail("--temperature must be >= 0 and --top-p in (0, 1]");

  const auto file = efim::model::open_model(model_path, residency);
  const auto weights = file.bind();
  const auto tok = efim::text::load_bpe_gguf(file.meta);
  efim::require(tok.vocab_size() <= weights.cfg.vocab, efim::errc::invalid_argument,
                "the tokenizer has more tokens than the model has rows");
  std::vector<efim::token_id> tokens;
  if (const auto* add_bos = file.meta.find("tokenizer.ggml.add_bos_token");
      add_bos && std::get_if<bool>(&add_bos->v) && std::get<bool>(add_bos->v))
    if (const auto bos = special(file.meta, "tokenizer.ggml.bos_token_id")) tokens.push_back(*bos);
  tok.encode_special(prompt, tokens);
  efim::require(!tokens.empty(), efim::errc::invalid_argument, "the prompt is empty");
  const auto& c = weights.cfg;
  efim::require(tokens.size() + n_predict <= c.max_context, efim::errc::too_long,
                std::to_string(tokens.size()) + " prompt tokens + " + std::to_string(n_predict) +
                    " new tokens exceed the model context of " + std::to_string(c.max_context));
  const auto eos = special(file.meta, "tokenizer.ggml.eos_token_id");

  efim::thread_pool pool(threads);
  efim::kernels::host::context ctx{pool};
  (void)efim::model::tune_decode_tiles(pool, weights, products);  // one-row decode tiles chosen by timing them
  efim::model::transformer<efim::kernels::host> model(weights, products);
  constexpr std::size_t block = 16;
  const std::size_t blocks = (tokens.size() + n_predict + block) / block;
  efim::kv::host_storage kv(c.layers, model.kv_layout(blocks, block), kv_type);
  std::vector<efim::block_id> table(blocks);
  for (std::size_t b = 0; b < blocks; ++b) table[b] = static_cast<efim::block_id>(b);

  efim::rng random(seed);
  efim::text::detokenizer<efim::text::bpe_tokenizer> detok(tok);
  std::vector<std::pair<float, efim::token_id>> scratch;
  std::vector<float> logits;
  std::string piece, line;
  std::size_t done = 0;
  efim::model::batch_item item{tokens, 0, table, true};
  for (std::size_t i = 0; i < n_predict; ++i) {
    model.forward(ctx, kv, std::span(&item, 1), logits);
    const std::span<const float> row = std::span(logits).first(tok.vocab_size());
    const efim::token_id next = temperature <= 0
                                    ? efim::kernels::argmax(row)
                                    : efim::kernels::sample(row, static_cast<float>(temperature), top_k,
                                                            static_cast<float>(top_p), random.uniform(), scratch);
    if (eos && next == *eos && !ignore_eos) break;
    done = tokens.size();
    tokens.push_back(next);
    item = {std::span(tokens).subspan(done), static_cast<efim::position>(done), table, true};
    if (ids) {
      if (!line.empty()) line += ' ';
      line += std::to_string(next);
    } else {
      piece.clear();
      detok.push(next, piece);
      std::fwrite(piece.data(), 1, piece.size(), stdout);
      std::fflush(stdout);
    }
  }
  if (ids) {
    line += '\n';
    std::fwrite(line.data(), 1, line.size(), stdout);
  } else {
    piece.clear();
    detok.flush(piece);
    std::fwrite(piece.data(), 1, piece.size(), stdout);
  }
  return 0;
}
}  // namespace

int main(int argc, char** argv) {
  return efim_examples::run_command(argc, argv, "efim-cli", usage, [&](std::string_view command) {
    if (command == "complete") return complete(argc, argv);
    fail("unknown command '" + std::string(command) + "' (complete)");
  });
}
