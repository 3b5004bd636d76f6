#pragma once
// Sampling on the CUDA backend, the host's contracts (kernels/sampling.hpp) row by row:
// - greedy: the argmax of each row, the lowest id among equal logits, one thread block per row;
// - temperature with top-k and top-p: each row's logits sorted (CUB's segmented radix sort, stable,
//   so equal logits keep id order as on the host), then one block per row weighs the kept tokens
//   in double, cuts at top_p by a block-wide prefix sum and draws with the row's uniform number.
// Memory is the caller's: sample_workspace() says how many bytes a shape needs.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_segmented_radix_sort.cuh>

#include "efim/core/types.hpp"
#include "efim/kernels/cuda/runtime.cuh"
#include "efim/kernels/sampling.hpp"

namespace efim::kernels::device {

namespace policy {
struct argmax {
  static constexpr int threads = 512;
};
struct sample {
  static constexpr int threads = 256;  // one block per row, over the sorted logits in chunks
};
}  // namespace policy

namespace agent {

// Each thread keeps the best of a strided pass; a block reduction keeps the larger logit, and the
// lower id of equal ones.
template <class Policy>
struct argmax {
  struct best {
    float value;
    token_id id;
  };
  struct more {
    __device__ best operator()(const best& a, const best& b) const {
      if (a.value > b.value || (a.value == b.value && a.id < b.id)) return a;
      return b;
    }
  };
  using reduce = cub::BlockReduce<best, Policy::threads>;
  using storage = typename reduce::TempStorage;

  __device__ static token_id run(storage& temp, const float* logits, std::size_t n) {
    best mine{-__int_as_float(0x7f800000), static_cast<token_id>(n)};  // -inf, an id past every real one
    for (std::size_t i = threadIdx.x; i < n; i += Policy::threads)
      mine = more{}(mine, best{logits[i], static_cast<token_id>(i)});
    return reduce(temp).Reduce(mine, more{}).id;
  }
};

// One row of sorted logits (descending, ids beside them): the first index whose inclusive prefix
// sum of weights exp((x - top) / T) reaches a bound, found chunk by chunk with a block scan; the
// same decisions as the host's sequential loop (sums in another order: within double rounding).
template <class Policy>
struct sample {
  using scan = cub::BlockScan<double, Policy::threads>;
  using reduce = cub::BlockReduce<double, Policy::threads>;
  using first = cub::BlockReduce<unsigned, Policy::threads>;
  struct lower {
    __device__ unsigned operator()(unsigned a, unsigned b) const { return a < b ? a : b; }
  };
  struct storage {
    union {
      typename scan::TempStorage scan;
      typename reduce::TempStorage reduce;
      typename first::TempStorage first;
    } temp;
    double total, carry;
    unsigned found;
  };

  __device__ static double weight(const float* sorted, std::size_t i, float temperature) {
    return exp((static_cast<double>(sorted[i]) - static_cast<double>(sorted[0])) / static_cast<double>(temperature));
  }

  // The first i < keep with prefix(i) >= bound (strict: > bound), or keep if none.
  __device__ static unsigned first_reaching(storage& s, const float* sorted, unsigned keep, float temperature,
                                            double bound, bool strict) {
    if (threadIdx.x == 0) s.carry = 0.0;
    __syncthreads();
    for (unsigned base = 0; base < keep; base += Policy::threads) {
      const unsigned i = base + threadIdx.x;
      const double w = i < keep ? weight(sorted, i, temperature) : 0.0;
      double prefix;
      scan(s.temp.scan).InclusiveSum(w, prefix);
      __syncthreads();
      prefix += s.carry;
      const bool hit = i < keep && (strict ? prefix > bound : prefix >= bound);
      const unsigned at = first(s.temp.first).Reduce(hit ? i : keep, lower{});
      __syncthreads();
      if (threadIdx.x == Policy::threads - 1) s.carry = prefix;
      if (threadIdx.x == 0) s.found = at;
      __syncthreads();
      if (s.found < keep) return s.found;
    }
    return keep;
  }

  __device__ static token_id run(storage& s, const float* sorted, const token_id* ids, std::size_t n,
                                 const sample_params& p) {
    if (p.temperature <= 0.0f || n == 1) return ids[0];  // sorted, stable: the argmax
    unsigned keep = static_cast<unsigned>(n);
    if (p.top_k > 0 && p.top_k < keep) keep = p.top_k;
    double sum = 0.0;
    for (unsigned i = threadIdx.x; i < keep; i += Policy::threads) sum += weight(sorted, i, p.temperature);
    const double all = reduce(s.temp.reduce).Sum(sum);
    if (threadIdx.x == 0) s.total = all;
    __syncthreads();
    double total = s.total;
    if (p.top_p < 1.0f) {  // the fewest tokens whose mass reaches top_p: up to the first prefix >= top_p * total
      const unsigned last = first_reaching(s, sorted, keep, p.temperature, static_cast<double>(p.top_p) * total, false);
      const unsigned cut = last < keep ? last + 1 : keep;
      // Their mass, as the host keeps it (the sum of the kept weights).
      double mass = 0.0;
      for (unsigned i = threadIdx.x; i < cut; i += Policy::threads) mass += weight(sorted, i, p.temperature);
      __syncthreads();
      const double kept = reduce(s.temp.reduce).Sum(mass);
      if (threadIdx.x == 0) s.total = kept > 0.0 ? kept : 1.0;
      __syncthreads();
      keep = cut;
      total = s.total;
    }
    const unsigned at = first_reaching(s, sorted, keep, p.temperature, p.u * total, true);
    return ids[at < keep ? at : keep - 1];
  }
};

}  // namespace agent

namespace detail {
template <class Policy>
__global__ void __launch_bounds__(Policy::threads) argmax_kernel(const float* logits, std::size_t n, token_id* out) {
  __shared__ typename agent::argmax<Policy>::storage temp;
  const token_id id = agent::argmax<Policy>::run(temp, logits + blockIdx.x * n, n);
  if (threadIdx.x == 0) out[blockIdx.x] = id < static_cast<token_id>(n) ? id : 0;  // (n: every logit NaN)
}

// Row r's ids 0..n-1 and the segment offsets r * n.
__global__ void sample_setup_kernel(token_id* ids, int* offsets, std::size_t rows, std::size_t n) {
  const std::size_t total = rows * n;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    ids[i] = static_cast<token_id>(i % n);
    if (i % n == 0) offsets[i / n] = static_cast<int>(i);
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) offsets[rows] = static_cast<int>(total);
}

template <class Policy>
__global__ void __launch_bounds__(Policy::threads)
    sample_kernel(const float* sorted, const token_id* ids, std::size_t n, const sample_params* params, token_id* out) {
  __shared__ typename agent::sample<Policy>::storage temp;
  const std::size_t row = blockIdx.x;
  const token_id id = agent::sample<Policy>::run(temp, sorted + row * n, ids + row * n, n, params[row]);
  if (threadIdx.x == 0) out[row] = id;
}

inline std::size_t align_up(std::size_t bytes) noexcept { return (bytes + 255) / 256 * 256; }

// The radix sort's own temporary bytes for a shape.
inline std::size_t sort_bytes(std::size_t rows, std::size_t n) {
  std::size_t bytes = 0;
  check(cub::DeviceSegmentedRadixSort::SortPairsDescending(nullptr, bytes, static_cast<const float*>(nullptr),
                                                           static_cast<float*>(nullptr),
                                                           static_cast<const token_id*>(nullptr),
                                                           static_cast<token_id*>(nullptr), static_cast<int>(rows * n),
                                                           static_cast<int>(rows), static_cast<const int*>(nullptr),
                                                           static_cast<const int*>(nullptr) + 1),
        "cub::DeviceSegmentedRadixSort (size query)");
  return bytes;
}
}  // namespace detail

// logits: (rows, n); out: rows ids.
template <class Policy = policy::argmax>
void argmax(const float* logits, std::size_t rows, std::size_t n, token_id* out, cudaStream_t stream = nullptr) {
  if (rows == 0 || n == 0) return;
  require(rows <= 0x7FFFFFFFu && n <= 0x7FFFFFFFu, errc::invalid_argument, "device::argmax: too many rows or logits");
  detail::argmax_kernel<Policy><<<static_cast<unsigned>(rows), Policy::threads, 0, stream>>>(logits, n, out);
  check(cudaGetLastError(), "argmax launch");
}

// Bytes of workspace `sample` needs for (rows, n) logits.
inline std::size_t sample_workspace(std::size_t rows, std::size_t n) {
  require(rows * n <= 0x7FFFFFFFu, errc::invalid_argument, "device::sample: more than 2^31 - 1 logits");
  return detail::align_up(rows * n * sizeof(float)) + 2 * detail::align_up(rows * n * sizeof(token_id)) +
         detail::align_up((rows + 1) * sizeof(int)) + detail::align_up(detail::sort_bytes(rows, n));
}

// logits: (rows, n); params: rows parameter sets (device memory); out: rows ids. Draws as
// kernels::sample does on the host with the same u.
template <class Policy = policy::sample>
void sample(const float* logits, std::size_t rows, std::size_t n, const sample_params* params, token_id* out,
            void* workspace, std::size_t workspace_bytes, cudaStream_t stream = nullptr) {
  if (rows == 0 || n == 0) return;
  require(workspace_bytes >= sample_workspace(rows, n), errc::invalid_argument, "device::sample: workspace too small");
  auto* at = static_cast<std::byte*>(workspace);
  auto* sorted = reinterpret_cast<float*>(at);
  at += detail::align_up(rows * n * sizeof(float));
  auto* ids = reinterpret_cast<token_id*>(at);
  at += detail::align_up(rows * n * sizeof(token_id));
  auto* sorted_ids = reinterpret_cast<token_id*>(at);
  at += detail::align_up(rows * n * sizeof(token_id));
  auto* offsets = reinterpret_cast<int*>(at);
  at += detail::align_up((rows + 1) * sizeof(int));
  std::size_t sort_bytes = detail::sort_bytes(rows, n);
  detail::sample_setup_kernel<<<static_cast<unsigned>((rows * n + 255) / 256 < 65535 ? (rows * n + 255) / 256 : 65535),
                                256, 0, stream>>>(ids, offsets, rows, n);
  check(cudaGetLastError(), "sample setup launch");
  check(cub::DeviceSegmentedRadixSort::SortPairsDescending(at, sort_bytes, logits, sorted, ids, sorted_ids,
                                                           static_cast<int>(rows * n), static_cast<int>(rows), offsets,
                                                           offsets + 1, 0, static_cast<int>(sizeof(float) * 8), stream),
        "cub::DeviceSegmentedRadixSort");
  detail::sample_kernel<Policy>
      <<<static_cast<unsigned>(rows), Policy::threads, 0, stream>>>(sorted, sorted_ids, n, params, out);
  check(cudaGetLastError(), "sample launch");
}

}  // namespace efim::kernels::device
