#pragma once
// Everything in efim, layer by layer.
#include "efim/version.hpp"

#include "efim/core/aligned.hpp"
#include "efim/core/config.hpp"
#include "efim/core/dtype.hpp"
#include "efim/core/error.hpp"
#include "efim/core/gguf.hpp"
#include "efim/core/random.hpp"
#include "efim/core/thread_pool.hpp"
#include "efim/core/types.hpp"
#include "efim/core/utf8.hpp"

#include "efim/text/bpe_tokenizer.hpp"
#include "efim/text/byte_tokenizer.hpp"
#include "efim/text/concepts.hpp"
#include "efim/text/detokenizer.hpp"
#include "efim/text/fragment.hpp"
#include "efim/text/pre_tokenizer.hpp"
#include "efim/text/token_memo.hpp"
#include "efim/text/unicode.hpp"

#include "efim/prompt/concepts.hpp"
#include "efim/prompt/encode.hpp"
#include "efim/prompt/fim_tokens.hpp"
#include "efim/prompt/formats.hpp"
#include "efim/prompt/layout.hpp"
#include "efim/prompt/session.hpp"
#include "efim/prompt/session_table.hpp"

#include "efim/cache/block_hash.hpp"
#include "efim/cache/block_pool.hpp"
#include "efim/cache/clock.hpp"
#include "efim/cache/concepts.hpp"
#include "efim/cache/eviction.hpp"
#include "efim/cache/manager.hpp"

#include "efim/kv/host_storage.hpp"
#include "efim/kv/layout.hpp"

// The host backend's kernels use GCC vector extensions and per-function target attributes, which
// nvcc's front end does not take: a CUDA translation unit gets the CUDA backend (efim/cuda.cuh)
// and the layers above it instead.
#include "efim/kernels/attention_plan.hpp"
#include "efim/kernels/concepts.hpp"
#include "efim/kernels/isa.hpp"
#include "efim/kernels/rope_table.hpp"
#include "efim/kernels/sampling.hpp"
#if !defined(__CUDACC__)
#include "efim/kernels/attention.hpp"
#include "efim/kernels/decode_tuning.hpp"
#include "efim/kernels/gelu.hpp"
#include "efim/kernels/host.hpp"
#include "efim/kernels/layernorm.hpp"
#include "efim/kernels/matmul.hpp"
#include "efim/kernels/rmsnorm.hpp"
#include "efim/kernels/rope.hpp"
#include "efim/kernels/simd.hpp"
#include "efim/kernels/swiglu.hpp"
#include "efim/model/decode_tuning.hpp"
#include "efim/model/transformer.hpp"
#else
#include "efim/cuda.cuh"
#endif

#include "efim/model/batch.hpp"
#include "efim/model/config.hpp"
#include "efim/model/gguf_model.hpp"
#include "efim/model/reference.hpp"
#include "efim/model/weights.hpp"

#include "efim/engine/async_runner.hpp"
#include "efim/engine/pipeline.hpp"
#include "efim/engine/request.hpp"
#include "efim/engine/scheduler.hpp"
#include "efim/engine/stop_rules.hpp"

#include "efim/server/api.hpp"
#include "efim/server/http.hpp"
#include "efim/server/metrics.hpp"
#include "efim/server/service.hpp"
