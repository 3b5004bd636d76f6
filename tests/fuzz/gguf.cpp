// libFuzzer target: the GGUF container. Any bytes give efim::error or a file whose tensors lie inside
// the bytes and which the writer writes back to a file that reads the same (written again: the same
// bytes).
#include <cstdint>
#include <vector>

#include "common.hpp"
#include "efim/core/error.hpp"
#include "efim/core/gguf.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace efim;
  gguf::file f;
  try {
    f = gguf::parse(efim_fuzz::bytes(data, size));
  } catch (const efim::error&) {
    return 0;
  }
  // (A file without tensors may end before its aligned data section would begin.)
  efim_fuzz::check(f.tensors.empty() || f.data_offset <= size, "the data section starts past the end");
  std::vector<gguf::tensor_data> tensors;
  for (const auto& t : f.tensors) {
    efim_fuzz::check(t.offset <= size - f.data_offset && t.bytes <= size - f.data_offset - t.offset,
                     "a tensor lies outside the file");
    if (t.bytes == 0) return 0;  // a type whose size is not known here: nothing to write back
    tensors.push_back(
        {t.name, t.shape, t.type, efim_fuzz::bytes(data, size).subspan(f.data_offset + t.offset, t.bytes)});
  }
  std::vector<std::byte> again;
  try {
    again = gguf::serialize(f.metadata, tensors, f.alignment);
  } catch (const efim::error&) {
    return 0;  // what the writer refuses (an alignment it does not write, say)
  }
  const auto g = gguf::parse(again);  // what efim writes, efim reads
  efim_fuzz::check(g.tensors.size() == f.tensors.size() && g.metadata.size() == f.metadata.size(),
                   "written back, the file has other tensors or keys");
  efim_fuzz::check(gguf::serialize(g.metadata, tensors, g.alignment) == again, "written twice, the bytes differ");
  return 0;
}
