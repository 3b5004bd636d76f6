#pragma once
// Everything in efim, layer by layer.
#include "efim/version.hpp"

#include "efim/core/config.hpp"
#include "efim/core/error.hpp"
#include "efim/core/random.hpp"
#include "efim/core/thread_pool.hpp"
#include "efim/core/types.hpp"
#include "efim/core/utf8.hpp"

#include "efim/text/byte_tokenizer.hpp"
#include "efim/text/concepts.hpp"
#include "efim/text/detokenizer.hpp"
#include "efim/text/fragment.hpp"

#include "efim/prompt/concepts.hpp"
#include "efim/prompt/encode.hpp"
#include "efim/prompt/fim_tokens.hpp"
#include "efim/prompt/formats.hpp"
#include "efim/prompt/layout.hpp"
#include "efim/prompt/session.hpp"

#include "efim/cache/block_hash.hpp"
#include "efim/cache/block_pool.hpp"
#include "efim/cache/clock.hpp"
#include "efim/cache/concepts.hpp"
#include "efim/cache/eviction.hpp"
#include "efim/cache/manager.hpp"

#include "efim/kv/host_storage.hpp"
#include "efim/kv/layout.hpp"

#include "efim/kernels/attention.hpp"
#include "efim/kernels/concepts.hpp"
#include "efim/kernels/host.hpp"
#include "efim/kernels/matmul.hpp"
#include "efim/kernels/rmsnorm.hpp"
#include "efim/kernels/rope.hpp"
#include "efim/kernels/sampling.hpp"
#include "efim/kernels/simd.hpp"
#include "efim/kernels/swiglu.hpp"

#include "efim/model/config.hpp"
#include "efim/model/reference.hpp"
#include "efim/model/transformer.hpp"
#include "efim/model/weights.hpp"

#include "efim/engine/async_runner.hpp"
#include "efim/engine/pipeline.hpp"
#include "efim/engine/request.hpp"
#include "efim/engine/scheduler.hpp"
