// Built for a baseline instruction set (x86-64-v2 on x86-64, see tests/CMakeLists.txt), as a
// distribution or a runtime builds the library: every header compiles warning-free there, and the
// kernels still take the best path the CPU has. The CPU's features are read from /proc/cpuinfo (what
// the kernel saw and enabled), not from CPUID and XGETBV, which the dispatch itself reads.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "efim/efim.hpp"

namespace {

// The first CPU's "flags" words and its vendor_id, as /proc/cpuinfo gives them.
std::set<std::string> cpu_flags(std::string& vendor) {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("vendor_id", 0) == 0 && vendor.empty()) std::istringstream(line.substr(line.find(':') + 1)) >> vendor;
    if (line.rfind("flags", 0) == 0) {
      std::istringstream words(line.substr(line.find(':') + 1));
      std::set<std::string> flags;
      for (std::string w; words >> w;) flags.insert(w);
      return flags;
    }
  }
  return {};
}

}  // namespace

int main() {
  namespace k = efim::kernels;
  int failures = 0;
#if EFIM_KERNELS_X86 && defined(__linux__)
  std::string vendor;
  const auto flags = cpu_flags(vendor);
  const auto has = [&](const char* f) { return flags.count(f) > 0; };
  const bool v3 = has("avx2") && has("fma") && has("f16c") && has("bmi2");
  const bool avx512 = has("avx512f") && has("avx512bw") && has("avx512dq") && has("avx512vl");
  const k::isa expected = v3 && avx512 ? k::isa::avx512 : v3 ? k::isa::avx2 : k::isa::generic;
  std::printf("cpu: %s; kernels: %s\n", std::string(k::isa_name(expected)).c_str(),
              std::string(k::isa_name(k::active_isa())).c_str());
  if (std::getenv("EFIM_ISA") == nullptr && k::active_isa() != expected) {
    std::printf("FAILED: the kernels run the %s path on a CPU with %s\n",
                std::string(k::isa_name(k::active_isa())).c_str(), std::string(k::isa_name(expected)).c_str());
    ++failures;
  }
  // The features the kernels choose tiles by, read by the library from CPUID and XGETBV.
  if (k::has_avx512_vnni() != (avx512 && has("avx512_vnni"))) {
    std::printf("FAILED: AVX-512 VNNI detected %d, /proc/cpuinfo says %d\n", k::has_avx512_vnni(),
                avx512 && has("avx512_vnni"));
    ++failures;
  }
  // (the kernel names AVX-VNNI "avx_vnni"; it lists AVX features only where the OS saves the YMM state)
  if (k::runs(k::int8_dot::vex) != has("avx_vnni")) {
    std::printf("FAILED: AVX-VNNI detected %d, /proc/cpuinfo says %d\n", k::runs(k::int8_dot::vex),
                has("avx_vnni"));
    ++failures;
  }
  // AMX: only where the kernel lists AMX-TILE and AMX-INT8 (it lists them where it enabled their
  // state) and granted the tile data (without which the first tile instruction is SIGILL); never
  // under EFIM_AMX=off (ctest runs this program with it too, baseline_isa_no_amx). Where it runs, an
  // int8 prefill product on the tiles below gives the VNNI form's bits.
  const char* amx_env = std::getenv("EFIM_AMX");
  const bool amx_off = amx_env != nullptr && (std::string(amx_env) == "off" || std::string(amx_env) == "0");
  if (k::runs(k::int8_dot::amx) && (amx_off || !has("amx_tile") || !has("amx_int8"))) {
    std::printf("FAILED: AMX taken with EFIM_AMX %s and /proc/cpuinfo amx_tile %d amx_int8 %d\n",
                amx_env ? amx_env : "unset", has("amx_tile"), has("amx_int8"));
    ++failures;
  }
  if (amx_off && k::int8_dot_for(k::isa::avx512) == k::int8_dot::amx) {
    std::printf("FAILED: EFIM_AMX=off, and the avx512 path still takes AMX\n");
    ++failures;
  }
  std::printf("amx: cpuinfo amx_tile %d amx_int8 %d, EFIM_AMX %s, tiles %s\n", has("amx_tile"), has("amx_int8"),
              amx_env ? amx_env : "unset", k::amx_ready() ? "granted and used" : "not used");
  std::printf("int8 products: %s on the avx2 path, %s on the avx512 path\n",
              std::string(k::int8_dot_name(k::int8_dot_for(k::isa::avx2))).c_str(),
              std::string(k::int8_dot_name(k::int8_dot_for(k::isa::avx512))).c_str());
  if (k::amd_cpu() != (vendor == "AuthenticAMD")) {
    std::printf("FAILED: AMD detected %d, the vendor is %s\n", k::amd_cpu(), vendor.c_str());
    ++failures;
  }
#endif
  // The dispatched product equals the canonical dot of the same path.
  efim::thread_pool pool(2);
  std::vector<float> x(3 * 100), w(5 * 100), y(3 * 5);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 7) * 0.25f - 0.5f;
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(i % 11) * 0.125f - 0.6f;
  k::matmul(pool, x.data(), w.data(), y.data(), 3, 5, 100);
  for (std::size_t i = 0; i < 3; ++i)
    for (std::size_t j = 0; j < 5; ++j)
      if (y[i * 5 + j] != k::detail::dot(x.data() + i * 100, w.data() + j * 100, 100)) {
        std::printf("FAILED: y[%zu][%zu] is not the canonical dot\n", i, j);
        ++failures;
      }
  // An int8 prefill product of q8_0 weights (40 x rows: two tiles of 16 on AMX where it runs, and 8
  // on the VNNI tiles) gives the generic path's bits.
  {
    const std::size_t rows = 37, cols = 256, m = 40, rb = cols / 32 * 34;
    std::vector<std::byte> q(rows * rb);
    for (std::size_t b = 0; b < rows * cols / 32; ++b) {
      const std::uint16_t d = efim::f32_to_f16(0.001f * static_cast<float>(b % 13 + 1));
      std::memcpy(q.data() + 34 * b, &d, 2);
      for (std::size_t j = 0; j < 32; ++j) q[34 * b + 2 + j] = static_cast<std::byte>((b * 31 + j * 17) % 256);
    }
    const k::weight_view wq{efim::dtype::q8_0, rows, cols, q.data()};
    std::vector<float> xs(m * cols), got(m * rows), want(m * rows);
    for (std::size_t i = 0; i < xs.size(); ++i) xs[i] = static_cast<float>(i % 29) * 0.07f - 1.0f;
    k::matmul(pool, xs.data(), wq, got.data(), m, k::accumulate::no, k::products::int8);
    const k::isa was = k::active_isa();
    k::select_isa(k::isa::generic);
    k::matmul(pool, xs.data(), wq, want.data(), m, k::accumulate::no, k::products::int8);
    k::select_isa(was);
    if (std::memcmp(got.data(), want.data(), got.size() * sizeof(float)) != 0) {
      std::printf("FAILED: the int8 q8_0 product (%s) differs from the generic path's\n",
                  std::string(k::int8_dot_name(k::int8_dot_for(was))).c_str());
      ++failures;
    }
  }
  if (failures == 0) std::printf("baseline build: ok\n");
  return failures == 0 ? 0 : 1;
}
