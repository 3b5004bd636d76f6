#pragma once
// The CUDA runtime helpers (core/device.cuh) under the kernels' namespace.
#include "efim/core/device.cuh"

namespace efim::kernels::device {
using efim::device::available;
using efim::device::buffer;
using efim::device::check;
using efim::device::device_name;
}  // namespace efim::kernels::device
