// The consumer's one file that compiles the host kernels' instruction-set paths (the program is built
// with EFIM_KERNELS_SEPARATE: its other files declare them only).
#include <efim/kernels/compiled.hpp>
