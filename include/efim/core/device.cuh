#pragma once
// The CUDA runtime as efim uses it (the CUDA backend's kernels, device KV storage, device weights):
// every failure an efim::error, device memory owned by a buffer, work ordered on the caller's stream
// (nothing here synchronizes unless asked to).
#include <cuda_runtime.h>

#include <cstddef>
#include <string>
#include <utility>

#include "efim/core/error.hpp"

namespace efim::device {

inline void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw error(errc::unavailable, std::string("CUDA: ") + what + ": " + cudaGetErrorString(status));
}

// Whether a CUDA device is there to run on (false without a driver or without a device).
inline bool available() noexcept {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // clear it: the next call must not see it
    return false;
  }
  return count > 0;
}

// The name of device 0, for benchmarks and logs.
inline std::string device_name() {
  cudaDeviceProp p{};
  check(cudaGetDeviceProperties(&p, 0), "cudaGetDeviceProperties");
  return p.name;
}

// The multiprocessors of the current device (how many thread blocks a kernel needs to fill it).
inline std::size_t multiprocessors() {
  int device = 0, count = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  return static_cast<std::size_t>(count);
}

// The current device's compute capability, major * 10 + minor (80: sm_80).
inline int compute_capability() {
  int device = 0, major = 0, minor = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "cudaDeviceGetAttribute");
  check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device), "cudaDeviceGetAttribute");
  return 10 * major + minor;
}

// The most shared memory one thread block of the current device may take, opting in (bytes).
inline std::size_t shared_memory_optin() {
  int device = 0, bytes = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), "cudaDeviceGetAttribute");
  return static_cast<std::size_t>(bytes);
}

// Device memory for `count` elements of T, freed with the buffer.
template <class T>
class buffer {
 public:
  buffer() = default;
  explicit buffer(std::size_t count) : count_(count) {
    if (count > 0) check(cudaMalloc(reinterpret_cast<void**>(&data_), count * sizeof(T)), "cudaMalloc");
  }
  buffer(const buffer&) = delete;
  buffer& operator=(const buffer&) = delete;
  buffer(buffer&& o) noexcept : data_(std::exchange(o.data_, nullptr)), count_(std::exchange(o.count_, 0)) {}
  buffer& operator=(buffer&& o) noexcept {
    if (this != &o) {
      release();
      data_ = std::exchange(o.data_, nullptr);
      count_ = std::exchange(o.count_, 0);
    }
    return *this;
  }
  ~buffer() { release(); }

  [[nodiscard]] T* data() const noexcept { return data_; }
  [[nodiscard]] std::size_t size() const noexcept { return count_; }

  // Copies between host memory and the first n elements, ordered on `stream`.
  void upload(const T* host, std::size_t n, cudaStream_t stream = nullptr) {
    require(n <= count_, errc::invalid_argument, "device::buffer: upload past the end");
    check(cudaMemcpyAsync(data_, host, n * sizeof(T), cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync");
  }
  void download(T* host, std::size_t n, cudaStream_t stream = nullptr) const {
    require(n <= count_, errc::invalid_argument, "device::buffer: download past the end");
    check(cudaMemcpyAsync(host, data_, n * sizeof(T), cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync");
  }

 private:
  void release() noexcept {
    if (data_ != nullptr) (void)cudaFree(data_);
    data_ = nullptr;
    count_ = 0;
  }
  T* data_ = nullptr;
  std::size_t count_ = 0;
};

// A CUDA stream owned for its lifetime.
class stream {
 public:
  stream() { check(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking), "cudaStreamCreate"); }
  stream(const stream&) = delete;
  stream& operator=(const stream&) = delete;
  ~stream() { (void)cudaStreamDestroy(s_); }
  [[nodiscard]] cudaStream_t get() const noexcept { return s_; }
  void synchronize() const { check(cudaStreamSynchronize(s_), "cudaStreamSynchronize"); }

 private:
  cudaStream_t s_ = nullptr;
};

}  // namespace efim::device
