// bf16 panels on AMX tiles (Sapphire Rapids and later): from kAmxMinRows rows, blocks of 16
// rows meet a panel of 64 output channels through four 16 x 16 float32 accumulator tiles.
//
// Why: prefill and large decode batches are compute-bound, and a TDPBF16PS does 16 x 16 x 32
// multiply-adds, 8x what AVX512-BF16's vdpbf16ps does in the same time. oneDNN and vLLM's CPU
// MoE use AMX there; without it the fused MoE and the panel linears ran a 2,048-token GPT-OSS
// prefill at a sixth of vLLM-CPU's speed on such a machine.
//
// No new layout: the panel layout (panel.h, (N/64, K/2, 64, 2) bf16) is already AMX's B layout
// ("VNNI" pairs of inputs side by side) with a row stride of 256 bytes: tile j of a panel is
// channels [16j, 16j + 16), 16 input pairs a tile, read in place. The rows (A) are copied into
// a contiguous 16 x K buffer first (the fused MoE gathers them from scattered tokens); a
// block's rows past the last are read too and their sums dropped.
//
// Switched off process-wide by `set_amx_tiles(false)`: by EVENFLOW_NATIVE_AMX=0, and by
// deterministic mode, which promises a row's sums do not depend on its call's row count (tiles
// or registers). Here the two gave bit-identical rows (bf16 pairs summed in order, float32
// accumulation, K of 128-2,880), but nothing documents that TDPBF16PS rounds as VDPBF16PS does. Linux asks each process to request the tile
// state once (arch_prctl).

#pragma once

#include <immintrin.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace evenflow_panel {

constexpr int kAmxRows = 16;     // rows a tile holds
// One row stays on the register kernels (faster on a weight the caches hold); the fused
// experts, whose weights come from memory, take tiles from one row (their loads keep more
// misses in flight: 24 GB/s against 21 here).
constexpr int kAmxMinRows = 2;
constexpr int kAmxMinRowsExperts = 1;

inline std::atomic<bool>& amx_switched_on() {
  static std::atomic<bool> on{true};
  return on;
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)

inline bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

inline bool amx_usable() {
  return amx_switched_on().load(std::memory_order_relaxed) && amx_permitted();
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: the sums (16 rows x 16 channels each); 4: the rows' 32 inputs; 5, 6: a panel's
// 16 input pairs x 16 channels (alternating, so a load overlaps the previous dot product).
inline void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 7; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

// The accumulator tiles 0-3 (16 rows x 64 channels) zeroed; += a (16 rows of k_total bf16,
// `a_row` apart) @ one panel w ((k_total / 2, 64, 2) bf16, k_total a multiple of 32); stored
// into sums (rows `sums_row` floats apart). Tiles configured.
inline void tiles_zero() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

inline void tiles_accumulate(const uint16_t* a, int64_t a_row, const uint16_t* w,
                             int64_t k_total) {
  const int64_t a_stride = a_row * 2;  // bytes
  for (int64_t kp = 0; kp < k_total / 2; kp += 16) {
    const uint16_t* wp = w + kp * 2 * 64;
    _tile_loadd(4, a + 2 * kp, a_stride);
    _tile_loadd(5, wp, 256);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, wp + 32, 256);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, wp + 64, 256);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(6, wp + 96, 256);
    _tile_dpbf16ps(3, 4, 6);
  }
}

inline void tiles_store(float* sums, int64_t sums_row) {
  const int64_t stride = sums_row * 4;  // bytes
  _tile_stored(0, sums, stride);
  _tile_stored(1, sums + 16, stride);
  _tile_stored(2, sums + 32, stride);
  _tile_stored(3, sums + 48, stride);
}

// sums (16 x 64 float32, rows of 64) = a (16 rows of k_total bf16, `a_row` apart) @ one panel
// w ((k_total / 2, 64, 2) bf16). k_total a multiple of 32; tiles configured.
inline void panel_bf16_amx(const uint16_t* a, int64_t a_row, const uint16_t* w, int64_t k_total,
                           float* sums) {
  tiles_zero();
  tiles_accumulate(a, a_row, w, k_total);
  tiles_store(sums, 64);
}

// Rows [0, m) (row(i): a bf16 row of k_total) against one plain bf16 panel, 16 at a time;
// epilogue(r0, mm, sums) as run_panel's. Whether it ran (else the caller's kernels serve).
template <typename RowT, typename Epilogue>
bool run_panel_amx(const uint16_t* panel_w, int64_t k_total, int64_t m, const RowT& row,
                   const Epilogue& epilogue, int64_t min_rows = kAmxMinRows) {
  if (m < min_rows || k_total % 32 != 0 || !amx_usable()) return false;
  thread_local std::unique_ptr<uint16_t[]> rows;
  thread_local int64_t capacity = 0;
  if (kAmxRows * k_total > capacity) {
    capacity = kAmxRows * k_total;
    rows.reset(new uint16_t[capacity]);
  }
  alignas(64) float sums[kAmxRows * 64];
  configure_tiles();  // (each call: ATen's own AMX kernels may have loaded another config)
  for (int64_t r0 = 0; r0 < m; r0 += kAmxRows) {
    const int mm = static_cast<int>(std::min<int64_t>(kAmxRows, m - r0));
    const uint16_t* first = row(r0);
    bool in_place = mm == kAmxRows;  // 16 rows already one after another (a dense layer's x)
    for (int r = 1; r < mm && in_place; ++r) in_place = row(r0 + r) == first + r * k_total;
    if (!in_place)  // (rows past mm hold whatever they held: their sums are dropped)
      for (int r = 0; r < mm; ++r) std::memcpy(rows.get() + r * k_total, row(r0 + r), k_total * 2);
    panel_bf16_amx(in_place ? first : rows.get(), k_total, panel_w, k_total, sums);
    epilogue(r0, mm, sums);
  }
  _tile_release();
  return true;
}

inline void release_tiles() { _tile_release(); }

constexpr bool kHasAmx = true;

#else

inline void configure_tiles() {}
inline void tiles_zero() {}
inline void tiles_accumulate(const uint16_t*, int64_t, const uint16_t*, int64_t) {}
inline void tiles_store(float*, int64_t) {}
inline void panel_bf16_amx(const uint16_t*, int64_t, const uint16_t*, int64_t, float*) {}
inline void release_tiles() {}

inline bool amx_usable() { return false; }

template <typename RowT, typename Epilogue>
bool run_panel_amx(const uint16_t*, int64_t, int64_t, const RowT&, const Epilogue&,
                   int64_t = kAmxMinRows) {
  return false;
}

constexpr bool kHasAmx = false;

#endif

}  // namespace evenflow_panel
