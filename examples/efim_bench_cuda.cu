// efim-bench-cuda: efim-bench's in-process workload on the CUDA backend (the same program, compiled
// by nvcc with the CUDA decoder; the HTTP replay stays in efim-bench).
#include "efim/cuda.cuh"
#define EFIM_BENCH_BACKEND efim::kernels::cuda
#include "efim_bench.cpp"
