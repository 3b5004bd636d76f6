#pragma once
// GGUF container files (version 2 and 3): the metadata key/values and the tensor directory, read
// from a byte span with every length, count and offset checked (a truncated or hostile file gives
// an efim::error, never a read out of bounds or a huge allocation), and written back.
//
// This is the container only; what the tensors mean is model/'s business. It sits in core/ because
// text/ reads tokenizer vocabularies from the same files.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "efim/core/error.hpp"

namespace efim::gguf {

static_assert(std::endian::native == std::endian::little, "GGUF files are little-endian");

inline constexpr std::uint32_t magic = 0x46554747;  // "GGUF"
inline constexpr std::uint64_t default_alignment = 32;

enum class value_type : std::uint32_t {
  u8 = 0,
  i8 = 1,
  u16 = 2,
  i16 = 3,
  u32 = 4,
  i32 = 5,
  f32 = 6,
  boolean = 7,
  string = 8,
  array = 9,
  u64 = 10,
  i64 = 11,
  f64 = 12,
};

// An array's elements, by kind (the file's exact element type is kept beside them).
using array_items = std::variant<std::vector<std::uint64_t>, std::vector<std::int64_t>, std::vector<double>,
                                 std::vector<bool>, std::vector<std::string>, std::monostate /* nested arrays */>;

struct array_value {
  value_type type = value_type::u8;
  array_items items;
};

struct value {
  value_type type = value_type::u8;
  std::variant<std::uint64_t, std::int64_t, double, bool, std::string, array_value> v;
};

struct tensor_info {
  std::string name;
  std::vector<std::uint64_t> shape;  // ne[0] (fastest varying) first
  std::uint32_t type = 0;            // ggml type id
  std::uint64_t offset = 0;          // from the start of the data section
  std::uint64_t bytes = 0;           // 0 where the type's size is not known here
};

// Bytes per block and elements per block of the ggml tensor types whose layout is fixed here.
struct type_traits {
  std::uint32_t block = 0, bytes = 0;
};
inline type_traits traits_of(std::uint32_t type) noexcept {
  switch (type) {
    case 0:
      return {1, 4};  // F32
    case 1:
      return {1, 2};  // F16
    case 2:
      return {32, 18};  // Q4_0
    case 3:
      return {32, 20};  // Q4_1
    case 6:
      return {32, 22};  // Q5_0
    case 7:
      return {32, 24};  // Q5_1
    case 8:
      return {32, 34};  // Q8_0
    case 9:
      return {32, 36};  // Q8_1
    case 10:
      return {256, 84};  // Q2_K
    case 11:
      return {256, 110};  // Q3_K
    case 12:
      return {256, 144};  // Q4_K
    case 13:
      return {256, 176};  // Q5_K
    case 14:
      return {256, 210};  // Q6_K
    case 15:
      return {256, 292};  // Q8_K
    case 24:
      return {1, 1};  // I8
    case 25:
      return {1, 2};  // I16
    case 26:
      return {1, 4};  // I32
    case 27:
      return {1, 8};  // I64
    case 28:
      return {1, 8};  // F64
    case 30:
      return {1, 2};  // BF16
    default:
      return {};
  }
}

struct file {
  std::uint32_t version = 3;
  std::map<std::string, value, std::less<>> metadata;
  std::vector<tensor_info> tensors;
  std::uint64_t alignment = default_alignment;
  std::uint64_t data_offset = 0;  // where the data section starts in the file

  [[nodiscard]] const value* find(std::string_view key) const {
    const auto it = metadata.find(key);
    return it == metadata.end() ? nullptr : &it->second;
  }
  [[nodiscard]] const value& at(std::string_view key) const {
    const value* v = find(key);
    require(v != nullptr, errc::invalid_argument, "gguf: no metadata key '" + std::string(key) + "'");
    return *v;
  }
  [[nodiscard]] std::string_view string(std::string_view key) const {
    const auto* s = std::get_if<std::string>(&at(key).v);
    require(s != nullptr, errc::invalid_argument, "gguf: metadata '" + std::string(key) + "' is not a string");
    return *s;
  }
  template <class T>
  [[nodiscard]] const std::vector<T>& array(std::string_view key) const {
    const auto* a = std::get_if<array_value>(&at(key).v);
    const auto* items = a ? std::get_if<std::vector<T>>(&a->items) : nullptr;
    require(items != nullptr, errc::invalid_argument,
            "gguf: metadata '" + std::string(key) + "' is not an array of the expected type");
    return *items;
  }
};

namespace detail {

class reader {
 public:
  explicit reader(std::span<const std::byte> bytes) : bytes_(bytes) {}

  [[nodiscard]] std::size_t offset() const noexcept { return pos_; }
  [[nodiscard]] std::size_t left() const noexcept { return bytes_.size() - pos_; }

  template <class T>
  T scalar(const char* what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, bytes_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }

  std::string string(const char* what) {
    const auto n = scalar<std::uint64_t>(what);
    need(n, what);
    std::string s(reinterpret_cast<const char*>(bytes_.data() + pos_), static_cast<std::size_t>(n));
    pos_ += static_cast<std::size_t>(n);
    return s;
  }

  // A count of items of at least `min_bytes` each must fit in what is left.
  std::uint64_t count(std::uint64_t min_bytes, const char* what) {
    const auto n = scalar<std::uint64_t>(what);
    if (min_bytes != 0 && n > left() / min_bytes)  // (the message only when it fails: this runs per item)
      throw error(errc::invalid_argument,
                  std::string("gguf: ") + what + " count " + std::to_string(n) + " does not fit in the file");
    return n;
  }

  void need(std::uint64_t n, const char* what) const {
    if (n > left())
      throw error(errc::invalid_argument,
                  std::string("gguf: file ends inside ") + what + " (at byte " + std::to_string(pos_) + ")");
  }

 private:
  std::span<const std::byte> bytes_;
  std::size_t pos_ = 0;
};

inline std::uint64_t min_size(value_type t) {
  switch (t) {
    case value_type::u8:
    case value_type::i8:
    case value_type::boolean:
      return 1;
    case value_type::u16:
    case value_type::i16:
      return 2;
    case value_type::u32:
    case value_type::i32:
    case value_type::f32:
      return 4;
    case value_type::u64:
    case value_type::i64:
    case value_type::f64:
    case value_type::string:
      return 8;
    case value_type::array:
      return 12;
  }
  throw error(errc::invalid_argument, "gguf: unknown value type " + std::to_string(static_cast<std::uint32_t>(t)));
}

inline value_type read_type(reader& r) {
  const auto t = r.scalar<std::uint32_t>("a value type");
  if (t > 12) throw error(errc::invalid_argument, "gguf: unknown value type " + std::to_string(t));
  return static_cast<value_type>(t);
}

template <class Out>
Out read_number(reader& r, value_type t) {
  switch (t) {
    case value_type::u8:
      return static_cast<Out>(r.scalar<std::uint8_t>("a value"));
    case value_type::i8:
      return static_cast<Out>(r.scalar<std::int8_t>("a value"));
    case value_type::u16:
      return static_cast<Out>(r.scalar<std::uint16_t>("a value"));
    case value_type::i16:
      return static_cast<Out>(r.scalar<std::int16_t>("a value"));
    case value_type::u32:
      return static_cast<Out>(r.scalar<std::uint32_t>("a value"));
    case value_type::i32:
      return static_cast<Out>(r.scalar<std::int32_t>("a value"));
    case value_type::u64:
      return static_cast<Out>(r.scalar<std::uint64_t>("a value"));
    case value_type::i64:
      return static_cast<Out>(r.scalar<std::int64_t>("a value"));
    case value_type::f32:
      return static_cast<Out>(r.scalar<float>("a value"));
    case value_type::f64:
      return static_cast<Out>(r.scalar<double>("a value"));
    default:
      break;
  }
  throw error(errc::invalid_argument, "gguf: not a number type");
}

inline bool is_unsigned(value_type t) {
  return t == value_type::u8 || t == value_type::u16 || t == value_type::u32 || t == value_type::u64;
}
inline bool is_float(value_type t) { return t == value_type::f32 || t == value_type::f64; }

inline array_value read_array(reader& r, int depth) {
  require(depth < 8, errc::invalid_argument, "gguf: arrays nested too deep");
  array_value a;
  a.type = read_type(r);
  const std::uint64_t n = r.count(min_size(a.type), "array");
  const auto fill = [&]<class T>(std::vector<T>& out, auto read_one) {
    out.reserve(static_cast<std::size_t>(n));
    for (std::uint64_t i = 0; i < n; ++i) out.push_back(read_one());
  };
  if (a.type == value_type::string) {
    std::vector<std::string> v;
    fill(v, [&] { return r.string("an array string"); });
    a.items = std::move(v);
  } else if (a.type == value_type::boolean) {
    std::vector<bool> v;
    fill(v, [&] { return r.scalar<std::uint8_t>("an array bool") != 0; });
    a.items = std::move(v);
  } else if (a.type == value_type::array) {
    for (std::uint64_t i = 0; i < n; ++i) (void)read_array(r, depth + 1);
    a.items = std::monostate{};
  } else if (is_float(a.type)) {
    std::vector<double> v;
    fill(v, [&] { return read_number<double>(r, a.type); });
    a.items = std::move(v);
  } else if (is_unsigned(a.type)) {
    std::vector<std::uint64_t> v;
    fill(v, [&] { return read_number<std::uint64_t>(r, a.type); });
    a.items = std::move(v);
  } else {
    std::vector<std::int64_t> v;
    fill(v, [&] { return read_number<std::int64_t>(r, a.type); });
    a.items = std::move(v);
  }
  return a;
}

inline value read_value(reader& r, value_type t) {
  value out;
  out.type = t;
  if (t == value_type::string)
    out.v = r.string("a string value");
  else if (t == value_type::boolean)
    out.v = r.scalar<std::uint8_t>("a bool value") != 0;
  else if (t == value_type::array)
    out.v = read_array(r, 0);
  else if (is_float(t))
    out.v = read_number<double>(r, t);
  else if (is_unsigned(t))
    out.v = read_number<std::uint64_t>(r, t);
  else
    out.v = read_number<std::int64_t>(r, t);
  return out;
}

}  // namespace detail

// Parses a whole GGUF file held in memory. Tensor data stays where it is: each tensor_info's
// offset (from data_offset) and size are checked against the file.
inline file parse(std::span<const std::byte> bytes) {
  detail::reader r(bytes);
  require(r.scalar<std::uint32_t>("the magic") == magic, errc::invalid_argument, "gguf: not a GGUF file (bad magic)");
  file f;
  f.version = r.scalar<std::uint32_t>("the version");
  require(f.version == 2 || f.version == 3, errc::invalid_argument,
          "gguf: version " + std::to_string(f.version) + " is not supported (2 and 3 are)");
  const std::uint64_t n_tensors = r.count(8 + 4 + 4 + 8, "tensor");
  const std::uint64_t n_kv = r.count(8 + 4 + 1, "metadata");
  for (std::uint64_t i = 0; i < n_kv; ++i) {
    std::string key = r.string("a metadata key");
    const auto t = detail::read_type(r);
    value v = detail::read_value(r, t);
    require(!f.metadata.contains(key), errc::invalid_argument, "gguf: metadata key '" + key + "' appears twice");
    f.metadata.emplace(std::move(key), std::move(v));
  }
  if (const value* a = f.find("general.alignment")) {
    const auto* n = std::get_if<std::uint64_t>(&a->v);
    require(n && *n > 0 && *n <= (1u << 20) && std::has_single_bit(*n), errc::invalid_argument,
            "gguf: general.alignment must be a power of two up to 1 MiB");
    f.alignment = *n;
  }
  f.tensors.reserve(static_cast<std::size_t>(n_tensors));
  std::set<std::string, std::less<>> names;
  for (std::uint64_t i = 0; i < n_tensors; ++i) {
    tensor_info t;
    t.name = r.string("a tensor name");
    require(names.insert(t.name).second, errc::invalid_argument, "gguf: tensor '" + t.name + "' appears twice");
    const auto dims = r.scalar<std::uint32_t>("a tensor's dimension count");
    require(dims >= 1 && dims <= 4, errc::invalid_argument,
            "gguf: tensor '" + t.name + "' has " + std::to_string(dims) + " dimensions (1 to 4 allowed)");
    std::uint64_t elements = 1;
    for (std::uint32_t d = 0; d < dims; ++d) {
      const auto n = r.scalar<std::uint64_t>("a tensor's shape");
      require(n > 0 && elements <= std::numeric_limits<std::uint64_t>::max() / n, errc::invalid_argument,
              "gguf: tensor '" + t.name + "' has a zero or overflowing shape");
      elements *= n;
      t.shape.push_back(n);
    }
    t.type = r.scalar<std::uint32_t>("a tensor's type");
    t.offset = r.scalar<std::uint64_t>("a tensor's offset");
    if (const auto tr = traits_of(t.type); tr.block != 0) {
      require(t.shape[0] % tr.block == 0, errc::invalid_argument,
              "gguf: tensor '" + t.name + "' has a row of " + std::to_string(t.shape[0]) +
                  " elements, not a whole number of blocks of " + std::to_string(tr.block));
      const std::uint64_t blocks = elements / tr.block;
      require(blocks <= std::numeric_limits<std::uint64_t>::max() / tr.bytes, errc::invalid_argument,
              "gguf: tensor '" + t.name + "' is too large");
      t.bytes = blocks * tr.bytes;
    }
    f.tensors.push_back(std::move(t));
  }
  const std::uint64_t end_of_header = r.offset();
  f.data_offset = (end_of_header + f.alignment - 1) / f.alignment * f.alignment;
  const std::uint64_t size = bytes.size();
  for (const auto& t : f.tensors) {
    require(t.offset % f.alignment == 0, errc::invalid_argument,
            "gguf: tensor '" + t.name + "' is not aligned to " + std::to_string(f.alignment) + " bytes");
    require(f.data_offset <= size && t.offset <= size - f.data_offset && t.bytes <= size - f.data_offset - t.offset,
            errc::invalid_argument, "gguf: tensor '" + t.name + "' lies past the end of the file");
  }
  return f;
}

// How a file's bytes are held in memory.
enum class residency {
  // Mapped from the page cache: nothing copied, pages shared between processes, read on first use.
  map,
  // Read into this process's own (anonymous) memory, huge pages advised, then made read-only: costs
  // the file's size in memory and a read at start, and the weights no longer depend on the state of
  // the page cache (on a virtual machine, a file's pages cached long before were measured to stream
  // at half the speed of fresh memory when mapped: decode, which reads every weight per token, 1.7x
  // slower, until the cache was dropped).
  read,
};

// A whole file's bytes, read-only, held as `how` says.
class file_bytes {
 public:
  explicit file_bytes(const std::string& path, residency how = residency::map) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    require(fd >= 0, errc::invalid_argument, "cannot open '" + path + "': " + std::strerror(errno));
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      throw error(errc::invalid_argument, "'" + path + "' is not a regular file");
    }
    size_ = static_cast<std::size_t>(st.st_size);
    if (size_ == 0) {
      ::close(fd);
      return;
    }
    if (how == residency::map) {
      void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
      ::close(fd);
      require(p != MAP_FAILED, errc::invalid_argument, "cannot map '" + path + "': " + std::strerror(errno));
      data_ = static_cast<const std::byte*>(p);
      return;
    }
    void* p = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      const int e = errno;
      ::close(fd);
      throw error(errc::invalid_argument, "cannot allocate " + std::to_string(size_) + " bytes for '" + path +
                                              "': " + std::strerror(e));
    }
    data_ = static_cast<const std::byte*>(p);
#ifdef MADV_HUGEPAGE
    (void)::madvise(p, size_, MADV_HUGEPAGE);  // advice only: without it the bytes are the same
#endif
    std::size_t done = 0;
    while (done < size_) {
      const std::size_t chunk = std::min<std::size_t>(size_ - done, std::size_t{1} << 30);
      const ::ssize_t got = ::pread(fd, static_cast<char*>(p) + done, chunk, static_cast<::off_t>(done));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) {
        const std::string why = got < 0 ? std::strerror(errno) : "the file became shorter while it was read";
        ::close(fd);
        ::munmap(p, size_);  // the destructor does not run for an object whose constructor threw
        throw error(errc::invalid_argument, "cannot read '" + path + "': " + why);
      }
      done += static_cast<std::size_t>(got);
    }
    ::close(fd);
    (void)::mprotect(p, size_, PROT_READ);  // read-only, as a mapping is: a stray write faults
  }
  file_bytes(const file_bytes&) = delete;
  file_bytes& operator=(const file_bytes&) = delete;
  ~file_bytes() {
    if (data_) ::munmap(const_cast<std::byte*>(data_), size_);
  }
  [[nodiscard]] std::span<const std::byte> bytes() const noexcept { return {data_, size_}; }

 private:
  const std::byte* data_ = nullptr;
  std::size_t size_ = 0;
};

// Reads the metadata and tensor directory of a GGUF file.
inline file read(const std::string& path) {
  const file_bytes m(path);
  try {
    return parse(m.bytes());
  } catch (const error& e) {
    throw error(e.code(), std::string(e.what()) + " ('" + path + "')");
  }
}

// Writes a GGUF v3 file: metadata, then tensors (name, shape, ggml type, bytes) aligned to
// `alignment`. The tensor offsets are computed here.
struct tensor_data {
  std::string name;
  std::vector<std::uint64_t> shape;
  std::uint32_t type = 0;
  std::span<const std::byte> data;
};

namespace detail {
class writer {
 public:
  template <class T>
  void scalar(T v) {
    const auto* p = reinterpret_cast<const std::byte*>(&v);
    out.insert(out.end(), p, p + sizeof(T));
  }
  void string(std::string_view s) {
    scalar<std::uint64_t>(s.size());
    const auto* p = reinterpret_cast<const std::byte*>(s.data());
    out.insert(out.end(), p, p + s.size());
  }
  // A number as the type the value names: floats from a double, integers from an integer (a cast
  // from another kind could be undefined, a NaN into an integer say).
  template <class X>
  void number(value_type t, X x) {
    if constexpr (std::is_floating_point_v<X>) {
      require(t == value_type::f32 || t == value_type::f64, errc::invalid_argument,
              "gguf: a floating-point value of an integer type");
      if (t == value_type::f32)
        scalar(static_cast<float>(x));
      else
        scalar(static_cast<double>(x));
    } else {
      switch (t) {
        case value_type::u8:
          return scalar(static_cast<std::uint8_t>(x));
        case value_type::i8:
          return scalar(static_cast<std::int8_t>(x));
        case value_type::u16:
          return scalar(static_cast<std::uint16_t>(x));
        case value_type::i16:
          return scalar(static_cast<std::int16_t>(x));
        case value_type::u32:
          return scalar(static_cast<std::uint32_t>(x));
        case value_type::i32:
          return scalar(static_cast<std::int32_t>(x));
        case value_type::u64:
          return scalar(static_cast<std::uint64_t>(x));
        case value_type::i64:
          return scalar(static_cast<std::int64_t>(x));
        default:
          throw error(errc::invalid_argument, "gguf: an integer value of a floating-point or non-number type");
      }
    }
  }
  void value(const gguf::value& v) {
    scalar(static_cast<std::uint32_t>(v.type));
    std::visit(
        [&](const auto& x) {
          using X = std::decay_t<decltype(x)>;
          if constexpr (std::is_same_v<X, std::string>)
            string(x);
          else if constexpr (std::is_same_v<X, bool>)
            scalar<std::uint8_t>(x ? 1 : 0);
          else if constexpr (std::is_same_v<X, array_value>)
            array(x);
          else
            number(v.type, x);
        },
        v.v);
  }
  void array(const array_value& a) {
    scalar(static_cast<std::uint32_t>(a.type));
    std::visit(
        [&](const auto& items) {
          using I = std::decay_t<decltype(items)>;
          if constexpr (std::is_same_v<I, std::monostate>) {
            throw error(errc::invalid_argument, "gguf: nested arrays cannot be written");
          } else {
            scalar<std::uint64_t>(items.size());
            for (const auto& x : items) {
              using X = std::decay_t<decltype(x)>;
              if constexpr (std::is_same_v<X, std::string>)
                string(x);
              else if constexpr (std::is_same_v<I, std::vector<bool>>)
                scalar<std::uint8_t>(x ? 1 : 0);
              else
                number(a.type, x);
            }
          }
        },
        a.items);
  }
  void pad(std::uint64_t alignment) {
    while (out.size() % alignment != 0) out.push_back(std::byte{0});
  }
  std::vector<std::byte> out;
};
}  // namespace detail

inline std::vector<std::byte> serialize(const std::map<std::string, value, std::less<>>& metadata,
                                        std::span<const tensor_data> tensors,
                                        std::uint64_t alignment = default_alignment) {
  detail::writer w;
  w.scalar(magic);
  w.scalar<std::uint32_t>(3);
  w.scalar<std::uint64_t>(tensors.size());
  w.scalar<std::uint64_t>(metadata.size());
  for (const auto& [key, v] : metadata) {
    w.string(key);
    w.value(v);
  }
  std::uint64_t offset = 0;
  for (const auto& t : tensors) {
    w.string(t.name);
    w.scalar<std::uint32_t>(static_cast<std::uint32_t>(t.shape.size()));
    for (const auto n : t.shape) w.scalar(n);
    w.scalar(t.type);
    w.scalar(offset);
    offset = (offset + t.data.size() + alignment - 1) / alignment * alignment;
  }
  w.pad(alignment);
  for (const auto& t : tensors) {
    w.out.insert(w.out.end(), t.data.begin(), t.data.end());
    w.pad(alignment);
  }
  return std::move(w.out);
}

// Convenience constructors for metadata values.
inline value make_string(std::string s) { return {value_type::string, std::move(s)}; }
inline value make_u32(std::uint32_t n) { return {value_type::u32, std::uint64_t{n}}; }
inline value make_f32(float x) { return {value_type::f32, static_cast<double>(x)}; }
inline value make_strings(std::vector<std::string> items) {
  return {value_type::array, array_value{value_type::string, std::move(items)}};
}
inline value make_i32s(std::vector<std::int64_t> items) {
  return {value_type::array, array_value{value_type::i32, std::move(items)}};
}

}  // namespace efim::gguf
