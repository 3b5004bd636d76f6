#pragma once
// Vocabulary types shared by every layer.
#include <cstddef>
#include <cstdint>
#include <limits>

namespace efim {

using token_id = std::int32_t;   // index into a tokenizer's vocabulary
using block_id = std::uint32_t;  // index of a KV block in a pool
using position = std::int32_t;   // absolute token position inside a sequence

inline constexpr block_id no_block = std::numeric_limits<block_id>::max();

}  // namespace efim
