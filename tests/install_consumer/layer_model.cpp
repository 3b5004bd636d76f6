// efim::model alone: a random-weight model written as GGUF, read back, and run for one token.
#include <cstdio>
#include <efim/core/thread_pool.hpp>
#include <efim/kernels/host.hpp>
#include <efim/model/gguf_model.hpp>
#include <efim/model/transformer.hpp>
#include <vector>

int main() {
  efim::model::config c;
  c.vocab = 300;
  c.hidden = 64;
  c.layers = 2;
  c.heads = 4;
  c.kv_heads = 2;
  c.ffn = 128;
  c.max_context = 64;
  const auto file = efim::model::open_model(efim::model::random_model(c, 3));
  const auto w = file.bind(c);
  efim::model::transformer<efim::kernels::host> m(w);
  efim::thread_pool pool(1);
  efim::kernels::host::context ctx{pool};
  efim::kernels::host::storage kv(c.layers, m.kv_layout(4, 16));
  const std::vector<efim::token_id> tokens{1, 2, 3};
  const std::vector<efim::block_id> table{0};
  std::vector<efim::model::batch_item> items{{tokens, 0, table, true}};
  std::vector<float> logits;
  m.forward(ctx, kv, items, logits);
  std::printf("model: %zu logits\n", logits.size());
  return logits.size() == c.vocab ? 0 : 1;
}
