// The prefill -> decode K/V hand-off's copies between the paged cache and the block-major
// payload (blocks, layers, 2, block_size, kv_heads, head_dim) of engine/runners/model_runner.py's read_kv /
// write_kv: one memcpy per (block, layer, K or V) — each a block's whole K or V of one layer,
// contiguous on both sides.
//
// Why: torch's index_select / index_copy_ per layer from strided views of the payload ran at
// ~1.5-2.5 GB/s (0.33 ms to write a 128-token prompt's 0.5 MB of the 110M model, 16 ops a
// layer pair plus the stacks), on the decode worker's engine thread between decode steps.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// Checks the caches ([k0, v0, k1, v1, ...], each (slots, kv_heads, hd) contiguous, one dtype)
// and the block ids; returns the bytes of one block of one cache.
int64_t block_bytes(at::TensorList caches, const at::Tensor& block_ids, int64_t block_size) {
  TORCH_CHECK(!caches.empty() && caches.size() % 2 == 0, "kv_blocks: caches must be K, V pairs");
  TORCH_CHECK(block_ids.scalar_type() == at::kLong && block_ids.dim() == 1 &&
                  block_ids.is_contiguous(),
              "kv_blocks: block_ids must be a contiguous int64 vector");
  const at::Tensor& first = caches[0];
  for (const at::Tensor& c : caches)
    TORCH_CHECK(c.is_contiguous() && c.sizes() == first.sizes() &&
                    c.scalar_type() == first.scalar_type() && c.dim() == 3,
                "kv_blocks: caches must be contiguous (slots, kv_heads, hd) of one dtype");
  const int64_t blocks_total = first.size(0) / block_size;
  const int64_t* ids = block_ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < block_ids.size(0); ++i)
    TORCH_CHECK(ids[i] >= 0 && ids[i] < blocks_total, "kv_blocks: block id out of range");
  return block_size * first.size(1) * first.size(2) * first.element_size();
}

std::vector<int64_t> payload_shape(at::TensorList caches, int64_t blocks, int64_t block_size) {
  return {blocks, static_cast<int64_t>(caches.size() / 2), 2, block_size, caches[0].size(1),
          caches[0].size(2)};
}

}  // namespace

namespace evenflow_ops {

// The blocks' K/V as one contiguous (blocks, layers, 2, block_size, kv_heads, hd) payload.
at::Tensor kv_blocks_read(at::TensorList caches, const at::Tensor& block_ids,
                          int64_t block_size) {
  const int64_t bytes = block_bytes(caches, block_ids, block_size);
  const int64_t blocks = block_ids.size(0);
  at::Tensor out = at::empty(payload_shape(caches, blocks, block_size), caches[0].options());
  char* dst = static_cast<char*>(out.data_ptr());
  const int64_t* ids = block_ids.data_ptr<int64_t>();
  for (int64_t b = 0; b < blocks; ++b)
    for (const at::Tensor& c : caches) {
      std::memcpy(dst, static_cast<const char*>(c.data_ptr()) + ids[b] * bytes, bytes);
      dst += bytes;
    }
  return out;
}

// Inverse of kv_blocks_read: a contiguous payload of the caches' dtype into these blocks.
void kv_blocks_write(at::TensorList caches, const at::Tensor& block_ids, const at::Tensor& kv,
                     int64_t block_size) {
  const int64_t bytes = block_bytes(caches, block_ids, block_size);
  const int64_t blocks = block_ids.size(0);
  TORCH_CHECK(kv.is_contiguous() && kv.scalar_type() == caches[0].scalar_type() &&
                  kv.sizes() == at::IntArrayRef(payload_shape(caches, blocks, block_size)),
              "kv_blocks_write: kv must be a contiguous (blocks, layers, 2, block_size, "
              "kv_heads, hd) payload of the caches' dtype");
  const char* src = static_cast<const char*>(kv.data_ptr());
  const int64_t* ids = block_ids.data_ptr<int64_t>();
  for (int64_t b = 0; b < blocks; ++b)
    for (const at::Tensor& c : caches) {
      std::memcpy(static_cast<char*>(c.data_ptr()) + ids[b] * bytes, src, bytes);
      src += bytes;
    }
}

}  // namespace evenflow_ops

TORCH_LIBRARY_FRAGMENT(evenflow_kernels, m) {
  m.def("kv_blocks_read(Tensor[] caches, Tensor block_ids, int block_size) -> Tensor");
  m.def("kv_blocks_write(Tensor(a!)[] caches, Tensor block_ids, Tensor kv, int block_size) -> ()");
}

TORCH_LIBRARY_IMPL(evenflow_kernels, CPU, m) {
  m.impl("kv_blocks_read", &evenflow_ops::kv_blocks_read);
  m.impl("kv_blocks_write", &evenflow_ops::kv_blocks_write);
}
