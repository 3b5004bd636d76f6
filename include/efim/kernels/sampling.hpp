#pragma once
// Picking the next token from logits: greedy, or temperature with top-k and top-p (nucleus).
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "efim/core/types.hpp"

namespace efim::kernels {

// One row's sampling parameters, as a device backend takes them per row (the arguments of `sample`).
struct sample_params {
  float temperature = 0.0f;  // <= 0: greedy
  std::uint32_t top_k = 0;   // 0: all
  float top_p = 1.0f;
  double u = 0.0;  // uniform in [0, 1)
};

// The most likely token; the lowest id among equal logits.
inline token_id argmax(std::span<const float> logits) noexcept {
  std::size_t best = 0;
  for (std::size_t i = 1; i < logits.size(); ++i)
    if (logits[i] > logits[best]) best = i;
  return static_cast<token_id>(best);
}

// Draws from softmax(logits / temperature) restricted to the top_k most likely tokens (0: all),
// then to the fewest most likely tokens whose probability reaches top_p; `u` is uniform in [0, 1).
// Ties are ordered by id, so the same u always gives the same token.
inline token_id sample(std::span<const float> logits, float temperature, std::size_t top_k, float top_p, double u,
                       std::vector<std::pair<float, token_id>>& scratch) {
  if (temperature <= 0.0f || logits.size() == 1) return argmax(logits);
  scratch.clear();
  for (std::size_t i = 0; i < logits.size(); ++i) scratch.emplace_back(logits[i], static_cast<token_id>(i));
  const auto more_likely = [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  std::size_t keep = scratch.size();
  if (top_k > 0 && top_k < keep) {
    keep = top_k;
    std::nth_element(scratch.begin(), scratch.begin() + static_cast<std::ptrdiff_t>(keep - 1), scratch.end(),
                     more_likely);
  }
  std::sort(scratch.begin(), scratch.begin() + static_cast<std::ptrdiff_t>(keep), more_likely);

  const double top = scratch.front().first;
  std::vector<double> weights(keep);
  double total = 0.0;
  for (std::size_t i = 0; i < keep; ++i) total += weights[i] = std::exp((scratch[i].first - top) / temperature);
  if (top_p < 1.0f) {
    double mass = 0.0;
    std::size_t n = 0;
    while (n < keep && mass < top_p * total) mass += weights[n++];
    keep = std::max<std::size_t>(n, 1);
    total = mass > 0.0 ? mass : weights[0];
  }
  double target = u * total;
  for (std::size_t i = 0; i < keep; ++i) {
    if (target < weights[i]) return scratch[i].second;
    target -= weights[i];
  }
  return scratch[keep - 1].second;
}

// `sample` (or the argmax, at temperature 0) over the `allowed` ids only (in id order, not empty): the
// distribution renormalised over them, ties ordered by id as everywhere.
inline token_id sample_among(std::span<const float> logits, std::span<const token_id> allowed, float temperature,
                             std::size_t top_k, float top_p, double u, std::vector<float>& gathered,
                             std::vector<std::pair<float, token_id>>& scratch) {
  gathered.clear();
  for (const token_id t : allowed) gathered.push_back(logits[static_cast<std::size_t>(t)]);
  const token_id i =
      temperature <= 0.0f ? argmax(gathered) : sample(gathered, temperature, top_k, top_p, u, scratch);
  return allowed[static_cast<std::size_t>(i)];
}

}  // namespace efim::kernels
