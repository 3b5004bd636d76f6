// Included by targets.hpp once per instruction-set path, inside that path's namespace: the
// element-wise and row-wise kernels (public declarations and contracts in rmsnorm.hpp, swiglu.hpp,
// gelu.hpp, layernorm.hpp and rope.hpp).

// x, y: (rows, n); weight: (n). y may alias x.
EFIM_K_ENTRY void rmsnorm(const float* x, const float* weight, float* y, std::size_t rows, std::size_t n,
                          float eps) noexcept {
  for (std::size_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    float* yr = y + r * n;
    const float mean_square = dot(xr, xr, n) / static_cast<float>(n);
    const float scale = 1.0f / std::sqrt(mean_square + eps);
    for (std::size_t i = 0; i < n; ++i) yr[i] = xr[i] * scale * weight[i];
  }
}

// gate, up, out: n elements; out may alias gate.
EFIM_K_ENTRY void swiglu(const float* gate, const float* up, float* out, std::size_t n) noexcept {
  float e[lanes];
  std::size_t i = 0;
#if EFIM_K_AVX2 && !EFIM_K_AVX512
  for (; i + 8 <= n; i += 8) {  // the same operations, 8 lanes at a time
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 ex = exp8(_mm256_xor_ps(g, _mm256_set1_ps(-0.0f)));
    const __m256 r = _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), ex)), _mm256_loadu_ps(up + i));
    _mm256_storeu_ps(out + i, _mm256_andnot_ps(_mm256_cmp_ps(g, _mm256_set1_ps(-88.0f), _CMP_LT_OQ), r));
  }
#endif
  for (; i + lanes <= n; i += lanes) {  // whole vectors: the same operations lane by lane
    vfloat g, u, r;
    std::memcpy(&g, gate + i, sizeof g);
    std::memcpy(&u, up + i, sizeof u);
    r = -g;
    std::memcpy(e, &r, sizeof r);
    exp16(e);
    std::memcpy(&r, e, sizeof r);
    r = g / (1.0f + r) * u;
    r = g < -88.0f ? vfloat{} : r;
    std::memcpy(out + i, &r, sizeof r);
  }
  for (; i < n; i += lanes) {
    const std::size_t m = n - i < lanes ? n - i : lanes;
    for (std::size_t j = 0; j < lanes; ++j) e[j] = j < m ? -gate[i + j] : 0.0f;
    exp16(e);
    // Below -88, e^-gate is past what exp16 reaches, and silu(gate) is 0 to within 1e-36.
    for (std::size_t j = 0; j < m; ++j)
      out[i + j] = gate[i + j] < -88.0f ? 0.0f : gate[i + j] / (1.0f + e[j]) * up[i + j];
  }
}

// x, out: n elements; out may alias x.
EFIM_K_ENTRY void gelu(const float* x, float* out, std::size_t n) noexcept {
  constexpr float sqrt_2_over_pi = 0.7978845608028654f, cubic = 0.044715f;
  float e[lanes];
  for (std::size_t i = 0; i < n; i += lanes) {
    const std::size_t m = n - i < lanes ? n - i : lanes;
    for (std::size_t j = 0; j < lanes; ++j) {
      const float v = j < m ? x[i + j] : 0.0f;
      e[j] = 2.0f * sqrt_2_over_pi * fma(cubic * v, v * v, v);
    }
    exp16(e);
    for (std::size_t j = 0; j < m; ++j) {
      const float tanh_u = 1.0f - 2.0f / (e[j] + 1.0f);
      out[i + j] = 0.5f * x[i + j] * (1.0f + tanh_u);
    }
  }
}

// x, y: (rows, n); weight, bias: (n). y may alias x.
EFIM_K_ENTRY void layernorm(const float* x, const float* weight, const float* bias, float* y, std::size_t rows,
                            std::size_t n, float eps) noexcept {
  for (std::size_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    float* yr = y + r * n;
    float sum = 0.0f;
    for (std::size_t i = 0; i < n; ++i) sum += xr[i];
    const float mean = sum / static_cast<float>(n);
    float squares = 0.0f;
    for (std::size_t i = 0; i < n; ++i) squares = fma(xr[i] - mean, xr[i] - mean, squares);
    const float scale = 1.0f / std::sqrt(squares / static_cast<float>(n) + eps);
    for (std::size_t i = 0; i < n; ++i) yr[i] = fma((xr[i] - mean) * scale, weight[i], bias[i]);
  }
}

// Rotates x (tokens, heads, head_dim) in place with the table from rope_table.
EFIM_K_ENTRY void rope(float* x, std::size_t tokens, std::size_t heads, std::size_t head_dim, const float* cos_t,
                       const float* sin_t, rope_style style) noexcept {
  const std::size_t pairs = head_dim / 2;
  for (std::size_t t = 0; t < tokens; ++t)
    for (std::size_t h = 0; h < heads; ++h) {
      float* v = x + (t * heads + h) * head_dim;
      for (std::size_t i = 0; i < pairs; ++i) {
        const std::size_t a = style == rope_style::adjacent ? 2 * i : i;
        const std::size_t b = style == rope_style::adjacent ? 2 * i + 1 : i + pairs;
        const float c = cos_t[t * pairs + i], s = sin_t[t * pairs + i];
        const float x0 = v[a], x1 = v[b];
        v[a] = fma(x0, c, -(x1 * s));  // written out: see simd.hpp
        v[b] = fma(x0, s, x1 * c);
      }
    }
}
