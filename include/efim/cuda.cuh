#pragma once
// The CUDA backend, for CUDA translation units (nvcc): the kernels::cuda tag with its kernels, device
// KV storage, device weights and the decoder on the device. With it, engine::pipeline<...,
// kernels::cuda> runs the request path on the GPU with the same policies and scheduler as on the host.
#include "efim/core/device.cuh"
#include "efim/kernels/cuda/backend.cuh"
#include "efim/kv/device_storage.cuh"
#include "efim/model/cuda_transformer.cuh"
#include "efim/model/device_weights.cuh"
