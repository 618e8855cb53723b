// Fused elementwise passes of the chunked CPU attention engine (ops/common/reference.py, reference_backward.py):
// the forward's online-softmax step over one score tile and the backward's probabilities and dS, each in one or
// two sweeps over the tile instead of PyTorch's four to six (every sweep of a 2-8 MB tile goes through L2/L3).
//
// The formulas are the PyTorch path's: P = exp2((s - max) * log2(e)) in the forward (the max subtracted first,
// exactly where s ~ max), exp2(fma(s - max, log2(e), -log2(sum))) in the backward, dS = P * (dP - D). exp2 is
// Cephes' exp2f polynomial (about 2 ulp, where PyTorch's vectorised exp2 is about 1); exp2 of -inf and of anything
// below -126 is 0 (a masked score gives exactly 0), of 128 and above inf, of NaN NaN. Row maxima and sums
// propagate NaN like torch.amax and torch.sum. Sums run in a fixed order (one accumulator per lane, then a fixed
// tree), so a result does not depend on the thread.
//
// AVX-512F where the compiler targets it, else AVX2 + FMA, else plain loops (aarch64, portable builds); the vector
// and scalar paths evaluate the same formulas, so a tail computed by the scalar code matches its vector twin.
//
// Each pass may also write its result rounded to bf16 (to nearest even; denormals flushed to zero, as AVX512-BF16's
// conversion and products do) into a second tile, row by row while the row is in L1: the operands of the bf16
// GEMM (gemm_bf16.cpp). Pass a null pointer for none.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX512F__)
#define ATTNOPS_SM_LANES 16
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define ATTNOPS_SM_LANES 8
#include <immintrin.h>
#else
#define ATTNOPS_SM_LANES 1
#endif

namespace {

constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLowest = -126.0f;  // exp2 below this is 0 (masked scores are -inf)
constexpr float kHighest = 128.0f;  // 2^128 = inf, as exp2 overflows
// Cephes exp2f: 2^f for f in [-0.5, 0.5]
constexpr float kP0 = 1.535336188319500e-4f, kP1 = 1.339887440266574e-3f, kP2 = 9.618437357674640e-3f,
                kP3 = 5.550332471162809e-2f, kP4 = 2.402264791363012e-1f, kP5 = 6.931472028550421e-1f;

inline float exp2_scalar(float x) {
  if (std::isnan(x)) return x;
  if (x < kLowest) return 0.0f;
  x = std::fmin(x, kHighest);
  const float n = std::nearbyint(x);
  const float f = x - n;
  float p = std::fma(kP0, f, kP1);
  p = std::fma(p, f, kP2);
  p = std::fma(p, f, kP3);
  p = std::fma(p, f, kP4);
  p = std::fma(p, f, kP5);
  p = std::fma(p, f, 1.0f);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// NaN-propagating max and sum of a row, the scalar twins of the vector reductions below
inline float nan_max(float a, float b) { return (std::isnan(a) || std::isnan(b)) ? NAN : (a > b ? a : b); }

#if ATTNOPS_SM_LANES == 16
using V = __m512;
inline V vset(float x) { return _mm512_set1_ps(x); }
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, V x) { _mm512_storeu_ps(p, x); }
inline V vsub(V a, V b) { return _mm512_sub_ps(a, b); }
inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V vmax(V a, V b) { return _mm512_max_ps(a, b); }
inline V vmin(V a, V b) { return _mm512_min_ps(a, b); }
inline V vround(V x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline V vpow2i(V n) {  // 2^n for integral n in [-126, 128] (128: inf)
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
inline V vzero_where_below(V r, V x, float lo) {
  return _mm512_mask_mov_ps(r, _mm512_cmp_ps_mask(x, vset(lo), _CMP_LT_OQ), _mm512_setzero_ps());
}
inline V vnan_where_nan(V r, V x) { return _mm512_mask_mov_ps(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x); }
inline bool vany_nan(V x) { return _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q) != 0; }
inline V vzero_where_unit(V r, V p) {
  return _mm512_mask_mov_ps(r, _mm512_cmp_ps_mask(p, vset(1.0f), _CMP_EQ_OQ), _mm512_setzero_ps());
}
inline void vspill(float* out, V x) { _mm512_storeu_ps(out, x); }
#elif ATTNOPS_SM_LANES == 8
using V = __m256;
inline V vset(float x) { return _mm256_set1_ps(x); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, V x) { _mm256_storeu_ps(p, x); }
inline V vsub(V a, V b) { return _mm256_sub_ps(a, b); }
inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V vmax(V a, V b) { return _mm256_max_ps(a, b); }
inline V vmin(V a, V b) { return _mm256_min_ps(a, b); }
inline V vround(V x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline V vpow2i(V n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline V vzero_where_below(V r, V x, float lo) {
  return _mm256_blendv_ps(r, _mm256_setzero_ps(), _mm256_cmp_ps(x, vset(lo), _CMP_LT_OQ));
}
inline V vnan_where_nan(V r, V x) { return _mm256_blendv_ps(r, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q)); }
inline bool vany_nan(V x) { return _mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)) != 0; }
inline V vzero_where_unit(V r, V p) {
  return _mm256_blendv_ps(r, _mm256_setzero_ps(), _mm256_cmp_ps(p, vset(1.0f), _CMP_EQ_OQ));
}
inline void vspill(float* out, V x) { _mm256_storeu_ps(out, x); }
#endif

#if ATTNOPS_SM_LANES > 1
constexpr int64_t L = ATTNOPS_SM_LANES;

inline V vexp2(V x0) {
  V x = vmin(vmax(x0, vset(kLowest)), vset(kHighest));  // NaN lanes become kLowest here, restored below
  const V n = vround(x);
  const V f = vsub(x, n);
  V p = vfma(vset(kP0), f, vset(kP1));
  p = vfma(p, f, vset(kP2));
  p = vfma(p, f, vset(kP3));
  p = vfma(p, f, vset(kP4));
  p = vfma(p, f, vset(kP5));
  p = vfma(p, f, vset(1.0f));
  return vnan_where_nan(vzero_where_below(vmul(p, vpow2i(n)), x0, kLowest), x0);
}

inline float hsum(V x) {  // lanes added in a fixed tree (pairs of halves)
  float lanes[L];
  vspill(lanes, x);
  for (int64_t w = L / 2; w >= 1; w /= 2)
    for (int64_t i = 0; i < w; ++i) lanes[i] += lanes[i + w];
  return lanes[0];
}

inline float hmax(V x) {
  float lanes[L];
  vspill(lanes, x);
  float m = lanes[0];
  for (int64_t i = 1; i < L; ++i) m = m > lanes[i] ? m : lanes[i];
  return m;
}
#endif

float row_max(const float* s, int64_t cols) {
  int64_t j = 0;
  float m = -std::numeric_limits<float>::infinity();
  bool nan = false;
#if ATTNOPS_SM_LANES > 1
  if (cols >= L) {
    V acc = vset(m);
    for (; j + L <= cols; j += L) {
      const V x = vload(s + j);
      nan = nan || vany_nan(x);
      acc = vmax(acc, x);
    }
    m = hmax(acc);
  }
#endif
  for (; j < cols; ++j) {
    nan = nan || std::isnan(s[j]);
    m = m > s[j] ? m : s[j];
  }
  return nan ? NAN : m;
}

// s[j] = exp2((s[j] - m) * log2(e)) in place; returns the row sum
float exp_row(float* s, int64_t cols, float m) {
  int64_t j = 0;
  float sum = 0.0f;
#if ATTNOPS_SM_LANES > 1
  const V vm = vset(m), vl = vset(kLog2e);
  V acc = vset(0.0f);
  for (; j + L <= cols; j += L) {
    const V p = vexp2(vmul(vsub(vload(s + j), vm), vl));
    vstore(s + j, p);
    acc = vadd(acc, p);
  }
  sum = hsum(acc);
#else
  float acc[8] = {};  // eight running sums, as an 8-lane vector would keep
  for (; j + 8 <= cols; j += 8)
    for (int64_t k = 0; k < 8; ++k) {
      s[j + k] = exp2_scalar((s[j + k] - m) * kLog2e);
      acc[k] += s[j + k];
    }
  for (int64_t w = 4; w >= 1; w /= 2)
    for (int64_t k = 0; k < w; ++k) acc[k] += acc[k + w];
  sum = acc[0];
#endif
  for (; j < cols; ++j) {
    s[j] = exp2_scalar((s[j] - m) * kLog2e);
    sum += s[j];
  }
  return sum;
}

// x rounded to bf16 (to nearest even; NaN stays a quiet NaN, denormals become a signed 0)
inline uint16_t bf16_rne(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  if ((bits & 0x7f800000u) == 0) return static_cast<uint16_t>((bits >> 16) & 0x8000u);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

void round_row(const float* src, uint16_t* dst, int64_t cols) {
  int64_t j = 0;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  for (; j + 16 <= cols; j += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + j)));
#endif
  for (; j < cols; ++j) dst[j] = bf16_rne(src[j]);
}

// Row i of a tile with the band (lo, hi, prefix) (MaskSpec.tile_band): columns j outside lo <= j - i <= hi and
// not below prefix become -inf, as the engine's Python masking sets them (NaN scores included), before the pass
// reads the row. Only the masked columns are written: a row the band keeps whole costs a few integer operations.
void mask_row(float* row, int64_t i, int64_t cols, int64_t lo, int64_t hi, int64_t prefix) {
  const auto clamp = [](int64_t x, int64_t a, int64_t b) { return x < a ? a : (x > b ? b : x); };
  const int64_t start = clamp(i + lo, 0, cols), end = clamp(i + hi + 1, start, cols), keep = clamp(prefix, 0, cols);
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t j = keep; j < start; ++j) row[j] = ninf;
  for (int64_t j = end > keep ? end : keep; j < cols; ++j) row[j] = ninf;
}

}  // namespace

extern "C" {

// One column block of the forward's online softmax over rows x cols scores s (row stride ld), in place (and into
// out16, row stride ld16, rounded to bf16, unless null): m (row max, running), l (row sum, running) and, unless
// first, rescale[i] = exp2((m_old - m_new) * log2(e)), the factor the output accumulated so far must be scaled by.
// first: m and l start here; clamp: a first block's max of -inf becomes the lowest float (rows without a kept
// score yet). lo, hi, prefix: the tile's band (see mask_row; lo = -rows, hi = cols, prefix = 0: none). Returns 0.
int attnops_softmax_block(float* s, int64_t rows, int64_t cols, int64_t ld, float* m, float* l, float* rescale,
                          int first, int clamp, uint16_t* out16, int64_t ld16, int64_t lo, int64_t hi,
                          int64_t prefix) {
  const float lowest = std::numeric_limits<float>::lowest();
  for (int64_t i = 0; i < rows; ++i) {
    float* row = s + i * ld;
    mask_row(row, i, cols, lo, hi, prefix);
    const float block_max = row_max(row, cols);
    float m_new;
    if (first) {
      m_new = (clamp && !(block_max >= lowest) && !std::isnan(block_max)) ? lowest : block_max;
    } else {
      m_new = nan_max(m[i], block_max);
      rescale[i] = exp2_scalar((m[i] - m_new) * kLog2e);
    }
    const float sum = exp_row(row, cols, m_new);
    l[i] = first ? sum : l[i] * rescale[i] + sum;
    m[i] = m_new;
    if (out16) round_row(row, out16 + i * ld16, cols);
  }
  return 0;
}

// The backward's probabilities in place: s[i, j] = exp2(fma(s[i, j] - m[i], log2(e), neg_log2_l[i])), after the
// band's masking (lo, hi, prefix: as attnops_softmax_block's). Returns 0.
int attnops_softmax_probs(float* s, int64_t rows, int64_t cols, int64_t ld, const float* m, const float* neg_log2_l,
                          uint16_t* out16, int64_t ld16, int64_t lo, int64_t hi, int64_t prefix) {
  for (int64_t i = 0; i < rows; ++i) {
    float* row = s + i * ld;
    mask_row(row, i, cols, lo, hi, prefix);
    const float mi = m[i], ci = neg_log2_l[i];
    int64_t j = 0;
#if ATTNOPS_SM_LANES > 1
    const V vm = vset(mi), vc = vset(ci), vl = vset(kLog2e);
    for (; j + L <= cols; j += L) vstore(row + j, vexp2(vfma(vsub(vload(row + j), vm), vl, vc)));
#endif
    for (; j < cols; ++j) row[j] = exp2_scalar(std::fma(row[j] - mi, kLog2e, ci));
    if (out16) round_row(row, out16 + i * ld16, cols);
  }
  return 0;
}

// dS in place of P: p[i, j] = p[i, j] * (dp[i, j] - delta[i]) (row strides ld_p, ld_dp); unit_zero: 0 where
// p[i, j] == 1 (a row's only key: there dp - delta is all rounding, and the exact dS is 0). Returns 0.
int attnops_softmax_grad(float* p, const float* dp, int64_t rows, int64_t cols, int64_t ld_p, int64_t ld_dp,
                         const float* delta, int unit_zero, uint16_t* out16, int64_t ld16) {
  for (int64_t i = 0; i < rows; ++i) {
    float* prow = p + i * ld_p;
    const float* drow = dp + i * ld_dp;
    const float di = delta[i];
    int64_t j = 0;
#if ATTNOPS_SM_LANES > 1
    const V vd = vset(di);
    if (unit_zero) {
      for (; j + L <= cols; j += L) {
        const V pv = vload(prow + j);
        vstore(prow + j, vzero_where_unit(vmul(pv, vsub(vload(drow + j), vd)), pv));
      }
    } else {
      for (; j + L <= cols; j += L) vstore(prow + j, vmul(vload(prow + j), vsub(vload(drow + j), vd)));
    }
#endif
    for (; j < cols; ++j) prow[j] = (unit_zero && prow[j] == 1.0f) ? 0.0f : prow[j] * (drow[j] - di);
    if (out16) round_row(prow, out16 + i * ld16, cols);
  }
  return 0;
}

}  // extern "C"
