// efim-model: makes random-weight GGUF models and describes GGUF model files.
//
//   efim-model make [options] OUT.gguf
//   efim-model info [--json] FILE.gguf
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "arguments.hpp"
#include "efim/efim.hpp"
#include "efim/model/vocabulary.hpp"

namespace {
const char* const usage = R"(usage: efim-model make [options] OUT.gguf
       efim-model info [--json] FILE.gguf

make: writes a model with random weights (deterministic for a seed) that llama.cpp and efim load.
  --arch NAME         llama, qwen2 or starcoder2 (qwen2)
  --hidden N          embedding width (768)
  --layers N          decoder blocks (12)
  --heads N           query heads (12)
  --kv-heads N        key/value heads (2)
  --ffn N             feed-forward width (2048)
  --head-dim N        head size, when it is not hidden / heads (llama only: llama.cpp's qwen2 and
                      starcoder2 need heads x head size = hidden)
  --context N         training context length (32768)
  --rope-base F       RoPE base (1e6 for qwen2, 1e5 for starcoder2, 1e4 for llama)
  --rope-scale F      linear RoPE scaling factor (1)
  --norm-eps F        norm epsilon (1e-6 for qwen2, 1e-5 otherwise)
  --type T            f32, f16, bf16, q8_0, q4_0, q5_0, q5_1, q4_k, q5_k or q6_k for every matrix;
                      or llama.cpp's mixes q4_k_m, q5_k_m, q6_k (llama.cpp's quantizer's tensor types
                      and bytes for these weights) (f16)
  --tied              no output matrix: the token embeddings give the logits
  --tokenizer PATH    tokenizer.json, or a .gguf file to take the tokenizer from (default: the
                      Qwen2.5-Coder tokenizer.json that .ci/setup fetches); "none" for no tokenizer
  --vocab N           vocabulary rows; the tokenizer is padded to N (default: the tokenizer's size; for
                      the Qwen2.5-Coder vocabulary 151936, as its models have)
  --seed S            (1)
  --threads N         threads drawing the weights (0: all cores)
info: the metadata, the decoder config, a summary of the tensors by type and each tensor's type and
  shape.
)";

[[noreturn]] void fail(const std::string& message, int code = 2) { efim_examples::fail("efim-model", message, code); }
double number(std::string_view flag, const std::string& text) {
  return efim_examples::number("efim-model", flag, text);
}
std::size_t count(std::string_view flag, const std::string& text) {
  return efim_examples::count("efim-model", flag, text);
}

int make(int argc, char** argv) {
  std::map<std::string, std::string> opt;
  std::string out;
  bool tied = false;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--tied") {
      tied = true;
    } else if (a.starts_with("--")) {
      if (i + 1 >= argc) fail(a + " needs a value");
      opt[a] = argv[++i];
    } else if (out.empty()) {
      out = a;
    } else {
      fail("one output file, please (see --help)");
    }
  }
  if (out.empty()) fail("make needs an output file (see --help)");
  static const std::vector<std::string> known{
      "--arch",      "--hidden",     "--layers",   "--heads", "--kv-heads",  "--ffn",   "--head-dim", "--context",
      "--rope-base", "--rope-scale", "--norm-eps", "--type",  "--tokenizer", "--vocab", "--seed",     "--threads"};
  for (const auto& [k, v] : opt)
    if (std::find(known.begin(), known.end(), k) == known.end()) fail("unknown option " + k + " (see --help)");
  const auto get = [&](const std::string& k, const char* fallback) {
    const auto it = opt.find(k);
    return it == opt.end() ? std::string(fallback) : it->second;
  };

  auto c = efim::model::for_architecture(efim::model::parse_architecture(get("--arch", "qwen2")));
  const bool qwen = c.arch == efim::model::architecture::qwen2;
  c.hidden = count("--hidden", get("--hidden", "768"));
  c.layers = count("--layers", get("--layers", "12"));
  c.heads = count("--heads", get("--heads", "12"));
  c.kv_heads = count("--kv-heads", get("--kv-heads", "2"));
  c.ffn = count("--ffn", get("--ffn", "2048"));
  c.head_size = count("--head-dim", get("--head-dim", "0"));
  c.max_context = count("--context", get("--context", "32768"));
  const char* base = qwen ? "1e6" : c.arch == efim::model::architecture::starcoder2 ? "1e5" : "1e4";
  c.rope_theta = number("--rope-base", get("--rope-base", base));
  c.rope_scale = number("--rope-scale", get("--rope-scale", "1"));
  const double eps = number("--norm-eps", get("--norm-eps", qwen ? "1e-6" : "1e-5"));
  if (!(eps > 0 && eps < 1)) fail("--norm-eps must be in (0, 1)");
  c.norm_eps = static_cast<float>(eps);
  const std::string type = get("--type", "f16");
  const auto mix = efim::model::parse_quant_mix(type);
  const efim::model::random_spec spec{mix ? efim::model::base_type(*mix) : efim::parse_dtype(type), tied, mix};
  const std::uint64_t seed = count("--seed", get("--seed", "1"));
  if (c.head_size != 0 && c.head_size * c.heads != c.hidden && c.arch != efim::model::architecture::llama)
    fail("--head-dim: llama.cpp's " + std::string(efim::model::to_string(c.arch)) +
         " needs heads x head size = hidden; only llama models may differ");
  const std::size_t threads = count("--threads", get("--threads", "0"));

  std::string tokenizer = get("--tokenizer", "");
  if (tokenizer.empty()) {
    tokenizer = EFIM_DEFAULT_TOKENIZER;
    if (!std::filesystem::exists(tokenizer))
      fail("no " + tokenizer + " (run .ci/setup to fetch it), or name one with --tokenizer (or --tokenizer none)");
  }
  efim::model::metadata vocab_meta;
  std::size_t vocab = count("--vocab", get("--vocab", "0"));
  if (tokenizer != "none") {
    vocab_meta = efim::model::vocabulary_metadata(tokenizer, vocab);
    const std::size_t n = efim::model::vocabulary_size(vocab_meta);
    if (vocab != 0 && n > vocab)
      fail("--vocab " + std::to_string(vocab) + " is smaller than the tokenizer's " + std::to_string(n) + " tokens");
    vocab = n;
  }
  if (vocab == 0) fail("--vocab N is needed without a tokenizer");
  c.vocab = vocab;

  const auto bytes = efim::model::random_model(c, seed, spec, vocab_meta, threads);
  efim::model::write_file(out, bytes);
  std::cerr << "efim-model: wrote " << out << " (" << efim::model::to_string(c.arch) << ", hidden " << c.hidden << ", "
            << c.layers << " layers, " << c.heads << "/" << c.kv_heads << " heads, ffn " << c.ffn << ", vocab "
            << c.vocab << ", " << type << (tied ? ", tied" : "") << ", " << bytes.size() / 1e6
            << " MB)\n";
  return 0;
}

std::string text_of(const efim::gguf::value& v) {
  return std::visit(
      [](const auto& x) -> std::string {
        using X = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<X, std::string>)
          return x;
        else if constexpr (std::is_same_v<X, bool>)
          return x ? "true" : "false";
        else if constexpr (std::is_same_v<X, efim::gguf::array_value>)
          return "[array]";
        else {
          std::ostringstream s;
          s << x;
          return s.str();
        }
      },
      v.v);
}

int info(int argc, char** argv) {
  bool json = false;
  std::string path;
  for (int i = 2; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (a == "--json")
      json = true;
    else if (path.empty() && !a.starts_with("--"))
      path = a;
    else
      fail("info takes [--json] FILE (see --help)");
  }
  if (path.empty()) fail("info needs a file (see --help)");
  const auto file = efim::model::open_model(path);
  const auto c = file.cfg();
  (void)file.bind(c);  // every tensor checked

  nlohmann::json j;
  j["file"] = path;
  j["bytes"] = file.bytes.size();
  j["fingerprint"] = file.fingerprint;
  j["gguf_version"] = file.meta.version;
  nlohmann::json meta = nlohmann::json::object();
  std::size_t tokens = 0;
  for (const auto& entry : file.meta.metadata) {
    const std::string& key = entry.first;  // a name, not a structured binding: Clang before 16 captures none
    const auto& v = entry.second;
    if (const auto* a = std::get_if<efim::gguf::array_value>(&v.v)) {
      std::visit(
          [&](const auto& items) {
            if constexpr (!std::is_same_v<std::decay_t<decltype(items)>, std::monostate>) {
              meta[key] = "[" + std::to_string(items.size()) + " items]";
              if (key == "tokenizer.ggml.tokens") tokens = items.size();
            }
          },
          a->items);
    } else {
      meta[key] = text_of(v);
    }
  }
  j["metadata"] = meta;
  j["config"] = {{"architecture", efim::model::to_string(c.arch)},
                 {"vocab", c.vocab},
                 {"hidden", c.hidden},
                 {"layers", c.layers},
                 {"heads", c.heads},
                 {"kv_heads", c.kv_heads},
                 {"head_dim", c.head_dim()},
                 {"ffn", c.ffn},
                 {"context", c.max_context},
                 {"rope_base", c.rope_theta},
                 {"rope_scale", c.rope_scale},
                 {"norm_eps", c.norm_eps},
                 {"tokenizer_tokens", tokens}};
  struct totals {
    std::size_t tensors = 0, elements = 0, bytes = 0;
  };
  std::map<std::string, totals> by_type;
  nlohmann::json list = nlohmann::json::array();
  for (const auto& t : file.meta.tensors) {
    const auto type = efim::dtype_of_ggml(t.type);
    const std::string name = type ? std::string(efim::to_string(*type)) : "ggml type " + std::to_string(t.type);
    auto& s = by_type[name];
    std::size_t n = 1;
    for (const auto d : t.shape) n *= d;
    ++s.tensors;
    s.elements += n;
    s.bytes += t.bytes;
    list.push_back({{"name", t.name}, {"type", name}, {"shape", t.shape}, {"bytes", t.bytes}});
  }
  for (const auto& [type, s] : by_type)
    j["tensors"][type] = {{"tensors", s.tensors}, {"parameters", s.elements}, {"bytes", s.bytes}};
  j["tensor_list"] = list;

  if (json) {
    std::cout << j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
    return 0;
  }
  std::cout << path << ": GGUF v" << file.meta.version << ", " << file.bytes.size() << " bytes, fingerprint "
            << std::hex << file.fingerprint << std::dec << "\n";
  std::cout << "model: " << efim::model::to_string(c.arch) << ", vocab " << c.vocab << ", hidden " << c.hidden << ", "
            << c.layers << " layers, " << c.heads << " heads / " << c.kv_heads << " KV heads of " << c.head_dim()
            << ", ffn " << c.ffn << ", context " << c.max_context << ", RoPE base " << c.rope_theta << " scale "
            << c.rope_scale << ", norm eps " << c.norm_eps << "\n";
  std::cout << "tensors:\n";
  for (const auto& [type, s] : by_type)
    std::cout << "  " << type << ": " << s.tensors << " tensors, " << s.elements << " parameters, " << s.bytes
              << " bytes\n";
  std::cout << "each tensor (type, shape as ne0 x ne1, bytes):\n";
  for (const auto& t : list) {
    std::string shape;
    for (const auto& d : t["shape"]) shape += (shape.empty() ? "" : " x ") + std::to_string(d.get<std::uint64_t>());
    std::cout << "  " << t["name"].get<std::string>() << ": " << t["type"].get<std::string>() << ", " << shape << ", "
              << t["bytes"].get<std::uint64_t>() << " bytes\n";
  }
  std::cout << "metadata:\n";
  for (const auto& [key, v] : meta.items()) std::cout << "  " << key << " = " << v.get<std::string>() << "\n";
  return 0;
}
}  // namespace

int main(int argc, char** argv) {
  return efim_examples::run_command(argc, argv, "efim-model", usage, [&](std::string_view command) {
    if (command == "make") return make(argc, argv);
    if (command == "info") return info(argc, argv);
    fail("unknown command '" + std::string(command) + "' (make, info)");
  });
}
