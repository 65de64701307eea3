// The one routine both panel kernels (fused_moe.cpp, panel_linear.cpp) run per (weight panel,
// block of rows), `run_panel`, and what it needs around it: which way a block of rows takes
// (the weight's kernel plan, else built-in thresholds: dequant_rows), the thread's scratch for
// a dequantized panel, and the rows as the kernels read them (quantized for w8a8 / W4A8, or
// float32 for the float direct paths). The stored forms and their kernels: panel_quant.h.

#pragma once

#include <memory>
#include <vector>

#include "panel_quant.h"

namespace evenflow_panel {

// This thread's scratch for a dequantized panel: at least n values of T, kept for the thread's
// next panels (uninitialized: a zeroed 128 KB vector a task, as it was, cost a memset and at
// times an mmap with its page faults on every call, also where no panel was dequantized).
template <typename T>
T* panel_scratch(size_t n) {
  thread_local std::unique_ptr<T[]> buffer;
  thread_local size_t capacity = 0;
  if (n > capacity) {
    buffer.reset(new T[n]);
    capacity = n;
  }
  return buffer.get();
}

// From how many rows a panel of `wt` is dequantized first: the weight's kernel plan where it
// has one, else the built-in thresholds (w8a8: never, its rows always meet it as int8).
template <typename T>
inline int64_t dequant_rows(const Weight& wt) {
  if (wt.dequant_from > 0) return wt.dequant_from;
  if (wt.format == Format::kW8A8) return INT64_MAX;
  if (vnni_codes(wt.format)) return kDequantRowsW4A8;
  if (std::is_same_v<T, uint16_t> && wt.format == Format::kInt4 && kHasBf16Dot)
    return kDequantRowsInt4Dot;
  return kDequantRows;
}

// sums for rows [0, m) against panel p of `wt`, kRows (or kQuantRows; on AMX tiles, from
// kAmxMinRows bf16 rows, kAmxRows) at a time; epilogue(r0,
// mm, sums) gets each block's mm x 64 sums (int8's scale applied). row_t(i) / row_f(i): row i
// in T / in float32 (the latter read only for quantized weights with few rows); row_q(i): row
// i quantized (a w8a8 weight's rows, or a kInt4Vnni weight's in groups: QuantRows::at).
template <typename T, typename RowT, typename RowF, typename RowQ, typename Epilogue>
void run_panel(const Weight& wt, int64_t p, int64_t k_total, int64_t m, const RowT& row_t,
               const RowF& row_f, const RowQ& row_q, const Epilogue& epilogue,
               int64_t amx_min_rows = kAmxMinRows) {
  alignas(64) float sums[kRows * kPanel];
  const int64_t dequant_from = dequant_rows<T>(wt);
  if (wt.format == Format::kW8A8 && m < dequant_from) {
    for (int64_t r0 = 0; r0 < m; r0 += kW8A8Rows) {
      const int mm = static_cast<int>(std::min<int64_t>(kW8A8Rows, m - r0));
      const uint8_t* rows[kW8A8Rows];
      float scales[kW8A8Rows];
      for (int r = 0; r < mm; ++r) {
        const QuantRow row = row_q(r0 + r);
        rows[r] = row.q;
        scales[r] = row.scale;
      }
      panel_w8a8_rows(wt, p, rows, scales, mm, k_total, sums);
      epilogue(r0, mm, sums);
    }
    return;
  }
  const bool vnni4 = vnni_codes(wt.format);
  if (vnni4 && m < dequant_from && row_q(0).gscale != nullptr) {
    const int64_t groups = k_total / wt.group;
    for (int64_t r0 = 0; r0 < m; r0 += kW4A8Rows) {
      const int mm = static_cast<int>(std::min<int64_t>(kW4A8Rows, m - r0));
      QuantRow rows[kW4A8Rows];
      for (int r = 0; r < mm; ++r) rows[r] = row_q(r0 + r);
      const uint8_t* codes =
          static_cast<const uint8_t*>(wt.data) + p * panel_bytes(wt.format, k_total, 1);
      panel_w4a8_rows(codes, wt.scale_h + p * groups * kPanel, wt.offset_h + p * groups * kPanel,
                      wt.exps != nullptr ? wt.exps + p * groups * kPanel : nullptr, rows, mm,
                      k_total, wt.group, sums, wt.format == Format::kInt5Vnni);
      epilogue(r0, mm, sums);
    }
    return;
  }
  const T* plain = nullptr;
  // fp8 on bf16 rows: the first rows' pass dequantizes the panel (panel_fp8_dequant_dot), where
  // its halves share their scales, AMX tiles will not take the panel, and more rows follow
  // (for one pass alone, writing the panel only costs: the direct pass is the same lookups)
  bool fp8_first = false;
  const int64_t fp8_blocks = (k_total + kFp8Block - 1) / kFp8Block;
  if (wt.format == Format::kPlain) {
    plain = static_cast<const T*>(wt.data) + p * kPanel * k_total;
  } else if (vnni4 || wt.format == Format::kW8A8 ||  // (their few rows were served above)
             m >= dequant_from) {
    T* scratch = panel_scratch<T>(static_cast<size_t>(kPanel * k_total));
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512VBMI__)
    fp8_first = std::is_same_v<T, uint16_t> && wt.format == Format::kFp8 && m > kRows &&
                !amx_usable() &&
                fp8_halves_share_scales(wt.scale + p * fp8_blocks * kPanel, k_total);
#endif
    if (!fp8_first) dequantize_panel(wt, p, k_total, scratch);
    plain = scratch;
  }
  auto scaled = [&](int64_t r0, int mm, float* s) {  // int8, w8a8: its scale, on the sums
    if (wt.format == Format::kInt8 || wt.format == Format::kW8A8) {
      for (int r = 0; r < mm; ++r)
        for (int v = 0; v < 4; ++v) {
          float* at = s + r * kPanel + v * kLanes;
          store(at, load(at) * load(wt.scale + p * kPanel + v * kLanes));
        }
    }
    epilogue(r0, mm, s);
  };
  if constexpr (std::is_same_v<T, uint16_t>) {  // many bf16 rows: AMX tiles, where there are
    if (!fp8_first && plain != nullptr &&
        run_panel_amx(plain, k_total, m, row_t, scaled, amx_min_rows))
      return;
  }
  int64_t done = 0;  // rows already served
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512VBMI__)
  if constexpr (std::is_same_v<T, uint16_t>) {  // few bf16 rows against fp8: panel_fp8.h
    if (plain == nullptr && wt.format == Format::kFp8) {
      for (int64_t r0 = 0; r0 < m; r0 += kFp8DotRows) {
        const int mm = static_cast<int>(std::min<int64_t>(kFp8DotRows, m - r0));
        const uint16_t* rows[kFp8DotRows];
        for (int r = 0; r < mm; ++r) rows[r] = row_t(r0 + r);
        panel_fp8_dot_rows(rows, mm, static_cast<const uint8_t*>(wt.data) + p * kPanel * k_total,
                           wt.scale + p * fp8_blocks * kPanel, k_total, sums);
        epilogue(r0, mm, sums);
      }
      return;
    }
    if (fp8_first) {  // many bf16 rows against fp8: the first pass dequantizes the panel
      const int mm = static_cast<int>(std::min<int64_t>(kRows, m));
      const uint16_t* rows[kRows];
      for (int r = 0; r < mm; ++r) rows[r] = row_t(r);
      panel_fp8_dequant_rows(rows, mm, static_cast<const uint8_t*>(wt.data) + p * kPanel * k_total,
                             wt.scale + p * fp8_blocks * kPanel, k_total,
                             const_cast<uint16_t*>(plain), sums);
      scaled(0, mm, sums);
      done = mm;
    }
  }
#endif
  const int step = plain != nullptr ? kRows : kQuantRows;
  for (int64_t r0 = done; r0 < m; r0 += step) {
    const int mm = static_cast<int>(std::min<int64_t>(step, m - r0));
    if (plain != nullptr) {
      const T* rows[kRows];
      for (int r = 0; r < mm; ++r) rows[r] = row_t(r0 + r);
      panel(rows, mm, plain, k_total, sums);
    } else {
      const float* rows[kQuantRows];
      const uint16_t* rows_b[kQuantRows];
      for (int r = 0; r < mm; ++r) {
        rows[r] = row_f(r0 + r);
        if constexpr (std::is_same_v<T, uint16_t>) rows_b[r] = row_t(r0 + r);
      }
      panel_quant(wt, p, rows, std::is_same_v<T, uint16_t> ? rows_b : nullptr, mm, k_total,
                  sums);
    }
    scaled(r0, mm, sums);
  }
}

// The rows as `wt`'s kernel takes them quantized (QuantRows), when it does: w8a8 per row, int4
// in the VNNI layout per group; only when some panel meets fewer than dequant_rows of them at
// once (`few`: more rows dequantize the panel and read x as it is). Otherwise `out` stays empty.
template <typename T>
void quantize_rows_for(const Weight& wt, const T* x, int64_t m, int64_t k, bool few,
                       QuantRows& out) {
  if (wt.format == Format::kW8A8 && few)
    quantize_rows(x, m, k, out);
  else if (vnni_codes(wt.format) && few)
    quantize_rows_grouped(x, m, k, wt.group, out);
}

// Whether `wt`'s few-row path reads the rows in float32 when the activations are T: int8 and
// int4 nibble panels, and fp8 panels, unless bf16 rows meet them on the bf16 dot product
// (panel_int4_bf16, panel_fp8_dot); w8a8 and the VNNI int4 layout read quantized rows. (A
// float copy of a prefill's rows, and of its experts' activations, cost the int4 experts a
// third of their time at 2,048 tokens where nothing read it.)
template <typename T>
inline bool reads_float_rows(const Weight& wt) {
  if constexpr (std::is_same_v<T, uint16_t>) {
    if (wt.format == Format::kFp8 && kFp8Dot) return false;
    if (wt.format == Format::kInt4 && kHasBf16Dot && wt.group % kLanes == 0) return false;
  }
  return wt.format == Format::kInt8 || wt.format == Format::kInt4 || wt.format == Format::kFp8;
}

// x's rows as float32 (a copy for bf16; x itself for float32): the quantized panels' direct path
// reads float rows.
template <typename T>
const float* float_rows(const T* x, int64_t n, std::vector<float>& copy) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    copy.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t bits = static_cast<uint32_t>(x[i]) << 16;
      std::memcpy(&copy[i], &bits, sizeof bits);
    }
    return copy.data();
  }
}

}  // namespace evenflow_panel
