// The int8 KV cache's write (kv_cache_dtype="int8"): new tokens' K or V quantized into their
// cache slots, with one float32 scale per (block, KV head) that only grows while the block
// fills. engine/model/kv_quant.py's write_quantized is the same in torch (and the reference the
// tests hold this to).
//
// Per run of consecutive tokens landing in one block (a prefill chunk's tokens, a decode's
// one token), per KV head:
//   - the block's old scale is 0 when the run starts at the block's first slot (a fresh block:
//     whatever the scale held belonged to the block's previous owner), else what it holds;
//   - new scale = max(old, amax(run's values) / 127);
//   - if it grew, the block's earlier slots [0, first offset) are requantized to it:
//     q = round(q * old / new) (each requantization rounds once more, by at most half a step);
//   - the run's values: q = round(x / new), clamped to [-127, 127] (0 where the scale is 0).
// Rounding is to nearest, ties to even (torch.round's).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

inline int8_t quantize(float x, float scale) {
  if (!(scale > 0.f)) return 0;
  const float q = std::nearbyint(x / scale);
  return static_cast<int8_t>(std::clamp(q, -127.f, 127.f));
}

template <typename T>
void write_runs(const T* x, int8_t* cache, float* scales, const int64_t* slots, int64_t tokens,
                int64_t kv_heads, int64_t head_dim, int64_t block_size) {
  const int64_t row = kv_heads * head_dim;
  // runs: [start, end) of tokens in one block at consecutive offsets
  std::vector<int64_t> starts;
  for (int64_t t = 0; t < tokens; ++t)
    if (t == 0 || slots[t] / block_size != slots[t - 1] / block_size ||
        slots[t] != slots[t - 1] + 1)
      starts.push_back(t);
  starts.push_back(tokens);
  const int64_t runs = static_cast<int64_t>(starts.size()) - 1;
  at::parallel_for(0, runs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / kv_heads, g = task % kv_heads;
      const int64_t first = starts[r], last = starts[r + 1];
      const int64_t block = slots[first] / block_size, offset = slots[first] % block_size;
      float& scale = scales[block * kv_heads + g];
      const float old = offset == 0 ? 0.f : scale;
      float amax = 0.f;
      for (int64_t t = first; t < last; ++t) {
        const T* v = x + t * row + g * head_dim;
        for (int64_t d = 0; d < head_dim; ++d)
          amax = std::max(amax, std::abs(static_cast<float>(v[d])));
      }
      const float fresh = std::max(old, amax / 127.f);
      if (fresh > old && old > 0.f) {  // the block's earlier values, to the grown scale
        const float ratio = old / fresh;
        for (int64_t o = 0; o < offset; ++o) {
          int8_t* q = cache + (block * block_size + o) * row + g * head_dim;
          for (int64_t d = 0; d < head_dim; ++d)
            q[d] = static_cast<int8_t>(std::nearbyint(static_cast<float>(q[d]) * ratio));
        }
      }
      scale = fresh;
      for (int64_t t = first; t < last; ++t) {
        const T* v = x + t * row + g * head_dim;
        int8_t* q = cache + slots[t] * row + g * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) q[d] = quantize(static_cast<float>(v[d]), fresh);
      }
    }
  });
}

}  // namespace

namespace evenflow_ops {

// x (T, kv_heads, hd) float32 or bf16, contiguous; cache (slots + 1, kv_heads, hd) int8;
// scales (blocks + 1, kv_heads) float32; slot_mapping (T,) int64, each block's tokens in one
// run of consecutive slots (as a step writes them).
void kv_write_int8(const at::Tensor& x, const at::Tensor& cache, const at::Tensor& scales,
                   const at::Tensor& slot_mapping, int64_t block_size) {
  TORCH_CHECK(x.dim() == 3 && x.is_contiguous(), "x must be a contiguous (T, kv_heads, hd)");
  TORCH_CHECK(cache.dim() == 3 && cache.is_contiguous() && cache.scalar_type() == at::kChar &&
                  cache.size(1) == x.size(1) && cache.size(2) == x.size(2),
              "cache must be a contiguous (slots, kv_heads, hd) int8 tensor matching x");
  TORCH_CHECK(scales.dim() == 2 && scales.is_contiguous() && scales.scalar_type() == at::kFloat
                  && scales.size(1) == x.size(1) && block_size >= 1 &&
                  cache.size(0) <= scales.size(0) * block_size,
              "scales must be a contiguous (blocks + 1, kv_heads) float32 tensor");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.is_contiguous() &&
                  slot_mapping.scalar_type() == at::kLong && slot_mapping.size(0) == x.size(0),
              "slot_mapping must be a contiguous (T,) int64 tensor");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < x.size(0); ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < cache.size(0), "slot out of range");
  int8_t* q = static_cast<int8_t*>(cache.data_ptr());
  float* s = scales.data_ptr<float>();
  if (x.scalar_type() == at::kFloat) {
    write_runs(x.data_ptr<float>(), q, s, slots, x.size(0), x.size(1), x.size(2), block_size);
  } else if (x.scalar_type() == at::kBFloat16) {
    write_runs(x.data_ptr<c10::BFloat16>(), q, s, slots, x.size(0), x.size(1), x.size(2),
               block_size);
  } else {
    TORCH_CHECK(false, "kv_write_int8 takes float32 or bfloat16 values");
  }
}

}  // namespace evenflow_ops

TORCH_LIBRARY_FRAGMENT(evenflow_kernels, m) {
  m.def("kv_write_int8(Tensor x, Tensor(a!) cache, Tensor(b!) scales, Tensor slot_mapping, "
        "int block_size) -> ()");
}

TORCH_LIBRARY_IMPL(evenflow_kernels, CPU, m) {
  m.impl("kv_write_int8", &evenflow_ops::kv_write_int8);
}
