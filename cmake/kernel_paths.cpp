// The host kernels' instruction-set paths, compiled once for the project's programs (efim_kernel_paths
// in CMakeLists.txt; every program that links it is built with EFIM_KERNELS_SEPARATE).
#include "efim/kernels/compiled.hpp"
