// Weight-only quantized matmul for few rows (decode): out[m, n] = sum_k x[m, k] * w[n, k],
// with w stored as int8 (per-output-channel scale) or int4 nibbles (per-group scale and
// offset), x and out in float32 or bfloat16. Compiled at first use for the machine it runs on
// (-march=native) by evenflow/engine/kernels/native.py.
//
// Why: torch's _weight_int8pack_mm converts the weight for every row again, so its time grows
// linearly with the rows (decode at batch 8-32 sees 4-32 rows per expert). Here a tile of
// NB output channels x KC inputs is dequantized once into float32 in L1, then every row reads
// it: the weight is read from memory once and converted once per call, whatever the rows.
//
// Portable SIMD through GCC/Clang vector extensions: 16 floats a vector, which the compiler
// maps to one AVX-512 register or two AVX2 ones. Threads: ATen's pool (at::parallel_for over
// blocks of output channels), the same threads torch's own kernels use.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "panel.h"

namespace {

typedef float f16v __attribute__((vector_size(64)));      // 16 x float32
typedef uint32_t u16v __attribute__((vector_size(64)));   // 16 x uint32
typedef uint16_t u16x16 __attribute__((vector_size(32)));  // 16 x bf16 bits

constexpr int kLanes = 16;
constexpr int kNB = 4;      // output channels per tile
constexpr int kKC = 512;    // inputs per tile (4 x 512 floats = 8 KiB: stays in L1)
constexpr int kMB = 4;      // rows computed together (register blocking)

inline f16v load_f(const float* p) {
  f16v v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store_f(float* p, f16v v) { std::memcpy(p, &v, sizeof v); }

inline float hsum(f16v v) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

using evenflow_panel::float_to_bf16;  // round to nearest even, as torch does (panel.h)

// x (M, K) as float32, contiguous: a bf16 input is widened once per call.
std::vector<float> rows_as_float(const at::Tensor& x, int64_t m, int64_t k) {
  std::vector<float> out(static_cast<size_t>(m * k));
  if (x.scalar_type() == at::kFloat) {
    std::memcpy(out.data(), x.data_ptr<float>(), out.size() * sizeof(float));
  } else {
    const uint16_t* src = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    for (size_t i = 0; i < out.size(); i += kLanes) {
      u16x16 b;
      std::memcpy(&b, src + i, sizeof b);
      u16v wide = __builtin_convertvector(b, u16v) << 16;
      std::memcpy(out.data() + i, &wide, sizeof wide);
    }
  }
  return out;
}

// partial[r][j] += sum over this tile's kc inputs of xs[r][k] * tile[j][k], kMB rows at a time.
// (Every one of the kNB columns is summed, padding included: a fixed count keeps the
// accumulators in registers.)
inline void tile_rows(const float* tile, int kc, const float* xs, int64_t k_total, int64_t rows,
                      float* partial) {
  int64_t r = 0;
  for (; r + kMB <= rows; r += kMB) {
    f16v acc[kMB][kNB] = {};
    for (int k = 0; k < kc; k += kLanes) {
      f16v w[kNB];
      for (int j = 0; j < kNB; ++j) w[j] = load_f(tile + j * kKC + k);
      for (int i = 0; i < kMB; ++i) {
        f16v xv = load_f(xs + (r + i) * k_total + k);
        for (int j = 0; j < kNB; ++j) acc[i][j] += xv * w[j];
      }
    }
    for (int i = 0; i < kMB; ++i)
      for (int j = 0; j < kNB; ++j) partial[(r + i) * kNB + j] += hsum(acc[i][j]);
  }
  for (; r < rows; ++r) {
    f16v acc[kNB] = {};
    for (int k = 0; k < kc; k += kLanes) {
      f16v xv = load_f(xs + r * k_total + k);
      for (int j = 0; j < kNB; ++j) acc[j] += xv * load_f(tile + j * kKC + k);
    }
    for (int j = 0; j < kNB; ++j) partial[r * kNB + j] += hsum(acc[j]);
  }
}

void write_out(const float* partial, const at::Tensor& out, int64_t rows, int64_t n_total,
               int64_t n0, int64_t n_count) {
  if (out.scalar_type() == at::kFloat) {
    float* o = out.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < n_count; ++j) o[r * n_total + n0 + j] = partial[r * kNB + j];
  } else {
    uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < n_count; ++j)
        o[r * n_total + n0 + j] = float_to_bf16(partial[r * kNB + j]);
  }
}

void check_rows(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous (M, K) matrix");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "x must be float32 or bfloat16");
  TORCH_CHECK(x.size(1) == k, "x has ", x.size(1), " columns, the weight ", k);
  TORCH_CHECK(k % kLanes == 0, "K must be a multiple of ", kLanes);
}

// Scales and offsets are float32 (the caller keeps a float32 copy: no conversion per call).
void check_float32(const at::Tensor& t, int64_t numel, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == numel, name,
              " must be a contiguous float32 tensor of ", numel, " values");
}

// Dequantizing one tile row (kc inputs from k0 of output channel n) into float32.
#if defined(__AVX512BF16__) && defined(__AVX512F__)
// bf16 rows on a CPU with AVX512-BF16: the tile is rounded to bf16 and every row meets it
// with vdpbf16ps (32 multiply-adds an instruction, float32 sums), as oneDNN's bf16 GEMM does.
constexpr bool kBf16Dot = true;

inline void tile_to_bf16(const float* src, uint16_t* dst, int kc) {
  for (int k = 0; k < kc; k += kLanes) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + k),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(src + k))));
  }
}

// dst[0..3] += the lane sums of a[0..3], reduced together (a transposing tree: 13
// instructions for four sums instead of four separate reductions).
static_assert(kNB == 4, "add_sums4 reduces four columns");
inline void add_sums4(const __m512* a, float* dst) {
  const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
  const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
  // per 128-bit lane: [a0, a1, a2, a3] partial sums
  const __m512 u = _mm512_add_ps(
      _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t1))),
      _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t1))));
  const __m256 v = _mm256_add_ps(_mm512_castps512_ps256(u), _mm512_extractf32x8_ps(u, 1));
  const __m128 w = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  _mm_storeu_ps(dst, _mm_add_ps(_mm_loadu_ps(dst), w));
}

inline void tile_rows_bf16(const uint16_t* tile, int kc, const uint16_t* xs, int64_t k_total,
                           int64_t rows, float* partial) {
  auto load = [](const uint16_t* p) {
    return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p));
  };
  int64_t r = 0;
  for (; r + kMB <= rows; r += kMB) {
    __m512 acc[kMB][kNB];
    for (int i = 0; i < kMB; ++i)
      for (int j = 0; j < kNB; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int k = 0; k < kc; k += 2 * kLanes) {
      __m512bh w[kNB];
      for (int j = 0; j < kNB; ++j) w[j] = load(tile + j * kKC + k);
      for (int i = 0; i < kMB; ++i) {
        const __m512bh xv = load(xs + (r + i) * k_total + k);
        for (int j = 0; j < kNB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, w[j]);
      }
    }
    for (int i = 0; i < kMB; ++i) add_sums4(acc[i], partial + (r + i) * kNB);
  }
  for (; r < rows; ++r) {
    __m512 acc[kNB];
    for (int j = 0; j < kNB; ++j) acc[j] = _mm512_setzero_ps();
    for (int k = 0; k < kc; k += 2 * kLanes) {
      const __m512bh xv = load(xs + r * k_total + k);
      for (int j = 0; j < kNB; ++j)
        acc[j] = _mm512_dpbf16_ps(acc[j], xv, load(tile + j * kKC + k));
    }
    add_sums4(acc, partial + r * kNB);
  }
}
#else
constexpr bool kBf16Dot = false;
inline void tile_to_bf16(const float*, uint16_t*, int) {}
inline void tile_rows_bf16(const uint16_t*, int, const uint16_t*, int64_t, int64_t, float*) {}
#endif

// Dequantizing one tile row (kc inputs from k0 of output channel n) into float32.
// int8 -> bf16 in one pass (exact: |q| <= 128 fits bf16's 8-bit mantissa).
inline void int8_row_to_bf16(const int8_t* src, uint16_t* dst, int kc) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  for (int k = 0; k < kc; k += kLanes) {
    const __m512 f = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + k),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(f)));
  }
#else
  (void)src, (void)dst, (void)kc;
#endif
}

// int4 -> bf16 for one group-aligned run of kc weights: 16 bytes hold 32 weights (even k low
// nibble, odd k high), scaled and offset per group of group_size.
inline bool int4_row_to_bf16(const uint8_t* src, const float* scales, const float* offsets,
                             int64_t group_size, uint16_t* dst, int kc) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  const __m128i nibble = _mm_set1_epi8(0x0F);
  for (int k = 0; k < kc; k += 2 * kLanes) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k / 2));
    const __m128i low = _mm_and_si128(bytes, nibble);
    const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
    const __m128i first = _mm_unpacklo_epi8(low, high), second = _mm_unpackhi_epi8(low, high);
    const int64_t g = k / group_size;  // group_size is a multiple of 32 here
    const __m512 s = _mm512_set1_ps(scales[g]), o = _mm512_set1_ps(offsets[g]);
    const __m512 a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(first)), s, o);
    const __m512 b = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(second)), s, o);
    _mm512_storeu_si512(dst + k, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a)));
  }
  return true;
#else
  (void)src, (void)scales, (void)offsets, (void)group_size, (void)dst, (void)kc;
  return false;
#endif
}

// dequant_row(n, k0, kc, float* dst): kc weights of output channel n from input k0, in
// float32; direct_bf16(n, k0, kc, uint16_t* dst): the same straight into bf16 if the format
// has such a path (returns false if not). col_scale (or null): a per-output-channel factor
// applied to the sums.
template <typename Dequant, typename DirectBf16>
at::Tensor tiled_matmul(const at::Tensor& x, int64_t n_total, int64_t k_total,
                        const float* col_scale, const Dequant& dequant_row,
                        const DirectBf16& direct_bf16) {
  const int64_t rows = x.size(0);
  const bool bf16_dot = kBf16Dot && x.scalar_type() == at::kBFloat16 && k_total % 32 == 0;
  std::vector<float> xs;
  if (!bf16_dot) xs = rows_as_float(x, rows, k_total);
  const uint16_t* xb = bf16_dot ? reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>())
                                : nullptr;
  at::Tensor out = at::empty({rows, n_total}, x.options());
  const int64_t blocks = (n_total + kNB - 1) / kNB;
  // grain: enough blocks a task that a thread's share is worth the hand-off
  at::parallel_for(0, blocks, 8, [&](int64_t begin, int64_t end) {
    alignas(64) float tile[kNB * kKC];
    alignas(64) uint16_t tile_bf16[kNB * kKC];
    std::vector<float> partial(static_cast<size_t>(rows * kNB));
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kNB;
      const int64_t n_count = std::min<int64_t>(kNB, n_total - n0);
      std::fill(partial.begin(), partial.end(), 0.f);
      for (int64_t k0 = 0; k0 < k_total; k0 += kKC) {
        const int kc = static_cast<int>(std::min<int64_t>(kKC, k_total - k0));
        for (int j = 0; j < kNB; ++j) {
          if (j >= n_count) {
            std::fill(tile + j * kKC, tile + j * kKC + kc, 0.f);
          } else if (bf16_dot && direct_bf16(n0 + j, k0, kc, tile_bf16 + j * kKC)) {
            continue;
          } else {
            dequant_row(n0 + j, k0, kc, tile + j * kKC);
          }
          if (bf16_dot) tile_to_bf16(tile + j * kKC, tile_bf16 + j * kKC, kc);
        }
        if (bf16_dot) {
          tile_rows_bf16(tile_bf16, kc, xb + k0, k_total, rows, partial.data());
        } else {
          tile_rows(tile, kc, xs.data() + k0, k_total, rows, partial.data());
        }
      }
      if (col_scale != nullptr) {
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t j = 0; j < n_count; ++j) partial[r * kNB + j] *= col_scale[n0 + j];
      }
      write_out(partial.data(), out, rows, n_total, n0, n_count);
    }
  });
  return out;
}

// int8, per output channel: w[n, k] = q[n, k] * scale[n]
at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale) {
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && q.scalar_type() == at::kChar,
              "q must be a contiguous (N, K) int8 matrix");
  const int64_t n_total = q.size(0), k_total = q.size(1);
  check_rows(x, k_total);
  check_float32(scale, n_total, "scale");
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* scales = scale.data_ptr<float>();
  // the scale goes on the sums: the tile holds q itself
  return tiled_matmul(
      x, n_total, k_total, scales,
      [&](int64_t n, int64_t k0, int kc, float* dst) {
        const int8_t* __restrict src = qp + n * k_total + k0;
        for (int k = 0; k < kc; ++k) dst[k] = static_cast<float>(src[k]);  // vectorized
      },
      [&](int64_t n, int64_t k0, int kc, uint16_t* dst) {
        int8_row_to_bf16(qp + n * k_total + k0, dst, kc);
        return true;
      });
}

// int4, per group: w[n, k] = q[n, k] * scale[n, g] + offset[n, g], g = k / group_size; the
// nibbles (N, K/2) hold even k in the low half of a byte, odd k in the high half.
at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& scale,
                   const at::Tensor& offset, int64_t group_size) {
  TORCH_CHECK(nibbles.dim() == 2 && nibbles.is_contiguous() &&
                  nibbles.scalar_type() == at::kByte,
              "nibbles must be a contiguous (N, K/2) uint8 matrix");
  const int64_t n_total = nibbles.size(0), k_total = nibbles.size(1) * 2;
  check_rows(x, k_total);
  TORCH_CHECK(group_size % kLanes == 0 && kKC % group_size == 0,
              "group size must be a multiple of 16 dividing 512");
  const int64_t groups = k_total / group_size;
  check_float32(scale, n_total * groups, "scale");
  check_float32(offset, n_total * groups, "offset");
  const float* scales = scale.data_ptr<float>();
  const float* offsets = offset.data_ptr<float>();
  const uint8_t* np = nibbles.data_ptr<uint8_t>();
  auto direct = [&](int64_t n, int64_t k0, int kc, uint16_t* dst) {
    return group_size % 32 == 0 &&
           int4_row_to_bf16(np + (n * k_total + k0) / 2, scales + n * groups + k0 / group_size,
                            offsets + n * groups + k0 / group_size, group_size, dst, kc);
  };
  return tiled_matmul(x, n_total, k_total, nullptr, [&](int64_t n, int64_t k0, int kc,
                                                        float* dst) {
    const uint8_t* __restrict src = np + (n * k_total + k0) / 2;
    for (int start = 0; start < kc; start += static_cast<int>(group_size)) {
      const int64_t g = n * groups + (k0 + start) / group_size;
      const float s = scales[g], o = offsets[g];
      const uint8_t* __restrict bytes = src + start / 2;
      float* __restrict out = dst + start;
      for (int i = 0; i < group_size / 2; ++i) {  // even k in the low nibble, odd k high
        out[2 * i] = static_cast<float>(bytes[i] & 0xF) * s + o;
        out[2 * i + 1] = static_cast<float>(bytes[i] >> 4) * s + o;
      }
    }
  }, direct);
}

}  // namespace

TORCH_LIBRARY(evenflow_kernels, m) {
  m.def("int8_mm(Tensor x, Tensor q, Tensor scale) -> Tensor");
  m.def("int4_mm(Tensor x, Tensor nibbles, Tensor scale, Tensor offset, int group_size) -> "
        "Tensor");
}

TORCH_LIBRARY_IMPL(evenflow_kernels, CPU, m) {
  m.impl("int8_mm", &int8_mm);
  m.impl("int4_mm", &int4_mm);
}
