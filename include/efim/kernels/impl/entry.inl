// Included by targets.hpp once per instruction-set path where the kernels are compiled elsewhere
// (EFIM_KERNELS_SEPARATE: efim/kernels/compiled.hpp, in one source file of the program): the path's
// entry points, the ones the public kernels dispatch to, declared only. Their definitions are the
// functions marked EFIM_K_ENTRY in impl/*.inl; the signatures here must stay theirs (a mismatch is an
// undefined symbol when the program links).
namespace efim::kernels::detail::EFIM_K_NAMESPACE {
float dot(const float* x, const float* w, std::size_t n) noexcept;
void exp16(float* x) noexcept;
void matmul(thread_pool& pool, const float* x, const weight_view& w, float* y, std::size_t m, accumulate acc);
void quantize_q8_k(const float* x, std::size_t n, kquant::block_q8_k* out) noexcept;
void matmul_int8(thread_pool& pool, const kquant::block_q8_k* xq, const weight_view& w, float* y, std::size_t m,
                 accumulate acc, int8_dot d);
void quantize_q8_32(const float* x, std::size_t n, kquant::block_q8_32* out) noexcept;
void matmul_int8_32(thread_pool& pool, const kquant::block_q8_32* xq, const weight_view& w, float* y, std::size_t m,
                    accumulate acc, int8_dot d);
void rmsnorm(const float* x, const float* weight, float* y, std::size_t rows, std::size_t n, float eps) noexcept;
void swiglu(const float* gate, const float* up, float* out, std::size_t n) noexcept;
void gelu(const float* x, float* out, std::size_t n) noexcept;
void layernorm(const float* x, const float* weight, const float* bias, float* y, std::size_t rows, std::size_t n,
               float eps) noexcept;
void rope(float* x, std::size_t tokens, std::size_t heads, std::size_t head_dim, const float* cos_t,
          const float* sin_t, rope_style style) noexcept;
// Instantiated in compiled.hpp for float and half elements, rows 1 to max_rows.
template <class E, std::size_t... R>
void attend_rows_n(std::size_t n, std::index_sequence<R...>, const kv::paged_layout& l, const E* k_cache,
                   const E* v_cache, std::span<const block_id> table, std::size_t kv_head, const attention_row* rows,
                   float scale, float* scratch, std::size_t stride) noexcept;
}  // namespace efim::kernels::detail::EFIM_K_NAMESPACE
#undef EFIM_K_NAMESPACE
