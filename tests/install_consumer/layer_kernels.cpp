// efim::kernels alone: RMSNorm on the best instruction-set path this CPU has.
#include <cmath>
#include <cstdio>
#include <efim/kernels/rmsnorm.hpp>
#include <vector>

int main() {
  const std::vector<float> x{3, 4, 0, 0}, weight{1, 1, 1, 1};
  std::vector<float> y(4);
  efim::kernels::rmsnorm(x.data(), weight.data(), y.data(), 1, 4, 0.0f);
  std::printf("kernels: rmsnorm %.3f %.3f\n", y[0], y[1]);
  return std::abs(y[0] - 1.2f) < 1e-5f && std::abs(y[1] - 1.6f) < 1e-5f ? 0 : 1;
}
