// Included by targets.hpp once per instruction-set path, inside that path's namespace: fixed-width
// float vectors (GCC/Clang vector extensions) and the one summation order every host kernel uses for a
// dot product, so that a value never depends on the batch or the tile.
//
// Vectors stay local to the functions that use them (never parameters or results) so the code is
// ABI-neutral whatever instruction set it is compiled for.
//
// Every multiply-add is written out (fma, fma_into) rather than left as a * b + c: GCC's default
// -ffp-contract=fast fuses such expressions into FMA instructions where its passes see fit, which can
// differ between two instances of one template (a 4-row and a 1-row matrix tile, say), and then the
// same dot product gives other bits in another batch. Written out, each is rounded once where the
// path has FMA and twice where it has none, whatever the compiler flags.

typedef float vfloat __attribute__((vector_size(lanes * sizeof(float))));
typedef std::int32_t vint __attribute__((vector_size(lanes * sizeof(std::int32_t))));

// a * b + c.
inline float fma(float a, float b, float c) noexcept {
#if EFIM_K_FMA
  return __builtin_fmaf(a, b, c);
#else
  return a * b + c;  // without FMA instructions nothing can be fused
#endif
}

// acc = a * b + acc, lane by lane.
inline void fma_into(vfloat& acc, const vfloat& a, const vfloat& b) noexcept {
#if EFIM_K_AVX512
  __m512 x, y, z;
  std::memcpy(&x, &a, sizeof x);
  std::memcpy(&y, &b, sizeof y);
  std::memcpy(&z, &acc, sizeof z);
  z = _mm512_fmadd_ps(x, y, z);
  std::memcpy(&acc, &z, sizeof z);
#elif EFIM_K_FMA && EFIM_KERNELS_X86
  for (std::size_t h = 0; h < 2; ++h) {
    __m256 x, y, z;
    std::memcpy(&x, reinterpret_cast<const float*>(&a) + 8 * h, sizeof x);
    std::memcpy(&y, reinterpret_cast<const float*>(&b) + 8 * h, sizeof y);
    std::memcpy(&z, reinterpret_cast<const float*>(&acc) + 8 * h, sizeof z);
    z = _mm256_fmadd_ps(x, y, z);
    std::memcpy(reinterpret_cast<float*>(&acc) + 8 * h, &z, sizeof z);
  }
#elif EFIM_K_FMA  // a target whose base set has FMA (AArch64): each lane fused, as the scalar fma
  for (std::size_t i = 0; i < lanes; ++i) acc[i] = __builtin_fmaf(a[i], b[i], acc[i]);
#else
  acc = acc + a * b;
#endif
}

// v = 16 IEEE halves from p, widened to f32 with F16C where the target has it: the values of
// f16_to_f32 (a signaling NaN comes out quiet, as any arithmetic on it would make it).
inline void widen_f16(vfloat& v, const std::byte* p) noexcept {
#if EFIM_K_AVX512
  __m256i h;
  std::memcpy(&h, p, sizeof h);
  const __m512 f = _mm512_maskz_cvtph_ps(0xffff, h);  // the unmasked form trips GCC 12's -Wuninitialized
  std::memcpy(&v, &f, sizeof v);
#else
  float f[lanes];
#if EFIM_K_F16C
  for (std::size_t h = 0; h < 2; ++h) {
    __m128i half;
    std::memcpy(&half, p + 16 * h, sizeof half);
    _mm256_storeu_ps(f + 8 * h, _mm256_cvtph_ps(half));
  }
#else
  for (std::size_t i = 0; i < lanes; ++i) {
    std::uint16_t h;
    std::memcpy(&h, p + 2 * i, sizeof h);
    f[i] = f16_to_f32(h);
  }
#endif
  std::memcpy(&v, f, sizeof v);
#endif
}

// v = 16 bfloat16s from p, widened to f32 (a shift, exact).
inline void widen_bf16(vfloat& v, const std::byte* p) noexcept {
  typedef std::uint16_t vhalf __attribute__((vector_size(lanes * sizeof(std::uint16_t))));
  typedef std::uint32_t vword __attribute__((vector_size(lanes * sizeof(std::uint32_t))));
  vhalf h;
  std::memcpy(&h, p, sizeof h);
  const vword bits = __builtin_convertvector(h, vword) << 16;
  std::memcpy(&v, &bits, sizeof v);
}

// The canonical reduction of 16 lane sums, plus the sum of the elements past the last full vector.
inline float reduce_lanes(const float (&a)[lanes], float tail) noexcept {
  float t8[8], t4[4];
  for (std::size_t i = 0; i < 8; ++i) t8[i] = a[i] + a[i + 8];
  for (std::size_t i = 0; i < 4; ++i) t4[i] = t8[i] + t8[i + 4];
  return ((t4[0] + t4[2]) + (t4[1] + t4[3])) + tail;
}

// MR x NR dot products of length n, out[i * NR + j] = dot(x[i], w[j]), each in the canonical order:
// lane l sums the products at k = l, l + 16, l + 32, ... in turn; the tail past the last full
// vector is summed in order; reduce_lanes joins them.
template <std::size_t MR, std::size_t NR>
inline void dot_tile(const float* const (&x)[MR], const float* const (&w)[NR], std::size_t n, float* out) noexcept {
  vfloat acc[MR][NR];
  for (std::size_t i = 0; i < MR; ++i)
    for (std::size_t j = 0; j < NR; ++j) acc[i][j] = vfloat{};
  const std::size_t full = n - n % lanes;
  for (std::size_t k = 0; k < full; k += lanes) {
    vfloat xv[MR], wv[NR];
    for (std::size_t i = 0; i < MR; ++i) std::memcpy(&xv[i], x[i] + k, sizeof(vfloat));
    for (std::size_t j = 0; j < NR; ++j) std::memcpy(&wv[j], w[j] + k, sizeof(vfloat));
    for (std::size_t i = 0; i < MR; ++i)
      for (std::size_t j = 0; j < NR; ++j) fma_into(acc[i][j], xv[i], wv[j]);
  }
  for (std::size_t i = 0; i < MR; ++i)
    for (std::size_t j = 0; j < NR; ++j) {
      float tail = 0.0f;
      for (std::size_t k = full; k < n; ++k) tail = fma(x[i][k], w[j][k], tail);
      float a[lanes];
      std::memcpy(a, &acc[i][j], sizeof a);
      out[i * NR + j] = reduce_lanes(a, tail);
    }
}

EFIM_K_ENTRY float dot(const float* x, const float* w, std::size_t n) noexcept {
  const float* const xs[1] = {x};
  const float* const ws[1] = {w};
  float out;
  dot_tile<1, 1>(xs, ws, n, &out);
  return out;
}

// y[i] = y[i] + a * x[i], elementwise (no reduction, so no order to fix).
inline void axpy(float a, const float* x, float* y, std::size_t n) noexcept {
  std::size_t k = 0;
  for (; k + lanes <= n; k += lanes) {
    vfloat xv, yv;
    std::memcpy(&xv, x + k, sizeof xv);
    std::memcpy(&yv, y + k, sizeof yv);
    const vfloat av = vfloat{} + a;
    fma_into(yv, av, xv);
    std::memcpy(y + k, &yv, sizeof yv);
  }
  for (; k < n; ++k) y[k] = fma(a, x[k], y[k]);
}

#if EFIM_K_AVX2 && !EFIM_K_AVX512
// exp16's operations on 8 lanes in ymm registers, one for one.
[[gnu::always_inline]] inline __m256 exp8(__m256 v) noexcept {
  v = _mm256_max_ps(_mm256_set1_ps(-87.3f), v);  // v < lowest ? lowest : v
  v = _mm256_min_ps(_mm256_set1_ps(88.3f), v);
  const __m256 shifter = _mm256_set1_ps(12582912.0f);
  const __m256 n = _mm256_sub_ps(_mm256_fmadd_ps(v, _mm256_set1_ps(1.44269504f), shifter), shifter);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693359375f), v);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
  for (const float c : {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

// e^x for 16 floats in place (relative error below 3e-7). Inputs below -87.3 give e^-87.3 and
// inputs above 88.3 give e^88.3: softmax only asks for x <= 0.
EFIM_K_ENTRY void exp16(float* x) noexcept {
#if EFIM_K_AVX2 && !EFIM_K_AVX512
  _mm256_storeu_ps(x, exp8(_mm256_loadu_ps(x)));
  _mm256_storeu_ps(x + 8, exp8(_mm256_loadu_ps(x + 8)));
#else
  // Constants as vectors (vfloat{} + c broadcasts c); no helper returns a vector, see above.
  const vfloat lowest = vfloat{} + -87.3f, highest = vfloat{} + 88.3f;
  const vfloat shifter = vfloat{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  vfloat v;
  std::memcpy(&v, x, sizeof v);
  v = v < lowest ? lowest : v;
  v = v > highest ? highest : v;
  // x = n ln2 + r with |r| <= ln2 / 2; e^x = 2^n e^r.
  const vfloat log2e = vfloat{} + 1.44269504f;
  vfloat n = shifter;
  fma_into(n, v, log2e);
  n = n - shifter;
  vfloat r = v;  // ln 2 in two parts
  const vfloat ln2_hi = vfloat{} + -0.693359375f, ln2_lo = vfloat{} + 2.12194440e-4f;
  fma_into(r, n, ln2_hi);
  fma_into(r, n, ln2_lo);
  vfloat p = vfloat{} + 1.0f / 5040.0f;
  for (const float c : {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f}) {
    vfloat next = vfloat{} + c;
    fma_into(next, p, r);
    p = next;
  }
  const vint bits = (__builtin_convertvector(n, vint) + 127) << 23;
  vfloat scale;
  std::memcpy(&scale, &bits, sizeof scale);
  v = p * scale;
  std::memcpy(x, &v, sizeof v);
#endif
}
