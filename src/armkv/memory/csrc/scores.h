#pragma once

#include "common.h"

namespace armkv {

// ---------------------------------------------------------------- portable reference loops
// scores [R, S] = per group sum of q . codes, times the group's scale (codes [d/2, S] channel-major);
// slots from `first` on. Here and in the loops below, ld is the codes' row stride and ldo the
// scores' (S for a whole pool; the pool's S for one run of its slots, read in place)
inline void key_scores_scalar(const float* q, const uint8_t* codes, const float* scale, float* out, int64_t R,
                              int64_t d, int64_t S, int64_t ng, int64_t first, int64_t ld, int64_t ldo) {
  const int64_t half = d / 2, gs = d / ng;
  for (int64_t s = first; s < S; ++s) {
    for (int64_t r = 0; r < R; ++r) {
      float total = 0.0f;
      for (int64_t g = 0; g < ng; ++g) {
        float part = 0.0f;
        for (int64_t ch = g * gs; ch < (g + 1) * gs; ++ch) {
          const uint8_t b = codes[(ch % half) * ld + s];
          part += q[r * d + ch] * (ch < half ? low_nibble(b) : high_nibble(b));
        }
        total += part * scale[s * ng + g];
      }
      out[r * ldo + s] = total;
    }
  }
}

// out [R, d] = sum_s w[r, s] * scale[s, group] * code[s, ch] (codes [S, d/2]; w's rows ldw
// apart); accumulate: out += that
inline void weighted_values_scalar(const float* w, const uint8_t* codes, const float* scale, float* out, int64_t R,
                                   int64_t d, int64_t S, int64_t ng, int64_t ldw, bool accumulate) {
  const int64_t half = d / 2, gs = d / ng;
  if (!accumulate) std::fill(out, out + R * d, 0.0f);
  for (int64_t s = 0; s < S; ++s)
    for (int64_t r = 0; r < R; ++r) {
      const float wr = w[r * ldw + s];
      if (wr == 0.0f) continue;
      for (int64_t c = 0; c < half; ++c) {
        const uint8_t b = codes[s * half + c];
        out[r * d + c] += wr * scale[s * ng + c / gs] * low_nibble(b);
        out[r * d + c + half] += wr * scale[s * ng + (c + half) / gs] * high_nibble(b);
      }
    }
}

#ifdef ARMKV_AVX2
// 8 bytes -> their signed low and high nibbles as 8 floats each
__attribute__((target("avx2,fma"))) inline void decode8(const uint8_t* p, __m256& lo, __m256& hi) {
  const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  hi = _mm256_cvtepi32_ps(_mm256_srai_epi32(v, 4));
  lo = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 28), 28));  // the low nibble, sign-extended
}

// The query heads of a KV head: RR where the caller fixed it at compile time (the loops over
// them unroll and their accumulators stay in registers; with a run-time count the compiler
// keeps the accumulator arrays in memory, a load and a store around every FMA), else R.
template <int RR>
constexpr int64_t heads(int64_t R) { return RR > 0 ? RR : R; }
template <int RR>
constexpr int kAcc = RR > 0 ? RR : kMaxRep;

// key scores for slots [s0, s0 + 8) (all present), groups that do not straddle the halves
template <int RR>
__attribute__((target("avx2,fma"), always_inline)) inline void key_scores_block8(const float* q, const uint8_t* codes,
                                                                                 const float* scale, float* out, int64_t R_,
                                                                                 int64_t d, int64_t ld, int64_t ldo, int64_t ng,
                                                                                 int64_t s0) {
  const int64_t R = heads<RR>(R_), half = d / 2, gs = d / ng, seg = std::min(gs, half);
  __m256 res[kAcc<RR>];
  for (int64_t r = 0; r < R; ++r) res[r] = _mm256_setzero_ps();
  for (int64_t c0 = 0; c0 < half; c0 += seg) {
    __m256 alo[kAcc<RR>], ahi[kAcc<RR>];
    for (int64_t r = 0; r < R; ++r) alo[r] = ahi[r] = _mm256_setzero_ps();
    for (int64_t c = c0; c < c0 + seg; ++c) {
      __m256 lo, hi;
      decode8(codes + c * ld + s0, lo, hi);
      for (int64_t r = 0; r < R; ++r) {
        alo[r] = _mm256_fmadd_ps(_mm256_set1_ps(q[r * d + c]), lo, alo[r]);
        ahi[r] = _mm256_fmadd_ps(_mm256_set1_ps(q[r * d + c + half]), hi, ahi[r]);
      }
    }
    const int64_t glo = c0 / gs, ghi = (c0 + half) / gs;
    const __m256i idx = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(static_cast<int>(ng)));
    const __m256 slo = _mm256_i32gather_ps(scale + s0 * ng + glo, idx, 4);
    const __m256 shi = _mm256_i32gather_ps(scale + s0 * ng + ghi, idx, 4);
    for (int64_t r = 0; r < R; ++r) res[r] = _mm256_fmadd_ps(alo[r], slo, _mm256_fmadd_ps(ahi[r], shi, res[r]));
  }
  for (int64_t r = 0; r < R; ++r) _mm256_storeu_ps(out + r * ldo + s0, res[r]);
}

template <int RR>
__attribute__((target("avx2,fma"))) void key_scores_avx2_r(const float* q, const uint8_t* codes, const float* scale,
                                                          float* out, int64_t R, int64_t d, int64_t S, int64_t ng,
                                                          const uint8_t* then, int64_t then_row, int64_t ld, int64_t ldo) {
  // blocks of 8 slots; the last S % 8 (S >= 8) in a block that ends at S, whose slots before
  // them are scored again, to the same values (a lane's sums do not depend on the block)
  const int64_t last = S - 8, half = d / 2;
  for (int64_t i = 0; i < S && last >= 0; i += 8) {
    const int64_t s0 = std::min(i, last);
    // the codes are channel-major: a block reads 8 bytes from each of d/2 rows S bytes apart,
    // more streams than the hardware prefetcher follows, and at decode time they come from
    // memory (the weights' matmuls between two layers' reads evict them): ask for each row's
    // line kPrefetchAhead bytes ahead once per line
    if (s0 % 64 == 0 && s0 + kPrefetchAhead < S)
      for (int64_t c = 0; c < half; ++c) _mm_prefetch(reinterpret_cast<const char*>(codes + c * ld + s0 + kPrefetchAhead), _MM_HINT_T0);
    // and the rows the caller reads next (the value codes of these slots), while these compute
    if (then)
      for (int64_t b = 0; b < 8 * then_row; b += 64) _mm_prefetch(reinterpret_cast<const char*>(then + s0 * then_row + b), _MM_HINT_T0);
    key_scores_block8<RR>(q, codes, scale, out, R, d, ld, ldo, ng, s0);
  }
  if (last < 0) key_scores_scalar(q, codes, scale, out, R, d, S, ng, 0, ld, ldo);  // fewer than 8 slots
}

// weighted values, channels in blocks of 8 bytes (16 channels), accumulators in registers
template <int RR>
__attribute__((target("avx2,fma"))) void weighted_values_avx2_r(const float* w, const uint8_t* codes, const float* scale,
                                                               float* out, int64_t R_, int64_t d, int64_t S, int64_t ng,
                                                               int64_t ldw, bool accumulate) {
  const int64_t R = heads<RR>(R_), half = d / 2, gs = d / ng;
  // each weight times its slot's group scale, once: ws[(g * R + r) * S + s] (the inner loop
  // then broadcasts it from memory instead of multiplying two scalars per head and block)
  std::vector<float> ws(ng * R * S);
  for (int64_t g = 0; g < ng; ++g)
    for (int64_t r = 0; r < R; ++r) {
      float* row = ws.data() + (g * R + r) * S;
      const float* wr = w + r * ldw;
      for (int64_t s = 0; s < S; ++s) row[s] = wr[s] * scale[s * ng + g];
    }
  for (int64_t c0 = 0; c0 < half; c0 += 8) {
    __m256 alo[kAcc<RR>], ahi[kAcc<RR>];
    for (int64_t r = 0; r < R; ++r) alo[r] = ahi[r] = _mm256_setzero_ps();
    const float* wlo = ws.data() + (c0 / gs) * R * S;
    const float* whi = ws.data() + ((c0 + half) / gs) * R * S;
    for (int64_t s = 0; s < S; ++s) {
      __m256 lo, hi;
      decode8(codes + s * half + c0, lo, hi);
      for (int64_t r = 0; r < R; ++r) {
        alo[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(wlo + r * S + s), lo, alo[r]);
        ahi[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(whi + r * S + s), hi, ahi[r]);
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      float *lo = out + r * d + c0, *hi = out + r * d + half + c0;
      _mm256_storeu_ps(lo, accumulate ? _mm256_add_ps(_mm256_loadu_ps(lo), alo[r]) : alo[r]);
      _mm256_storeu_ps(hi, accumulate ? _mm256_add_ps(_mm256_loadu_ps(hi), ahi[r]) : ahi[r]);
    }
  }
}

// Dispatch on the number of query heads per KV head: the common GQA ratios get their own
// unrolled loops, any other count (up to kMaxRep) the run-time loop.
#define ARMKV_BY_HEADS(FN, R, ...)        \
  switch (R) {                            \
    case 1: return FN<1>(__VA_ARGS__);    \
    case 2: return FN<2>(__VA_ARGS__);    \
    case 3: return FN<3>(__VA_ARGS__);    \
    case 4: return FN<4>(__VA_ARGS__);    \
    case 5: return FN<5>(__VA_ARGS__);    \
    case 6: return FN<6>(__VA_ARGS__);    \
    case 7: return FN<7>(__VA_ARGS__);    \
    case 8: return FN<8>(__VA_ARGS__);    \
    default: return FN<0>(__VA_ARGS__);   \
  }

inline void key_scores_avx2(const float* q, const uint8_t* codes, const float* scale, float* out, int64_t R, int64_t d,
                            int64_t S, int64_t ng, const uint8_t* then, int64_t then_row, int64_t ld, int64_t ldo) {
  ARMKV_BY_HEADS(key_scores_avx2_r, R, q, codes, scale, out, R, d, S, ng, then, then_row, ld, ldo)
}

inline void weighted_values_avx2(const float* w, const uint8_t* codes, const float* scale, float* out, int64_t R, int64_t d,
                                 int64_t S, int64_t ng, int64_t ldw, bool accumulate) {
  ARMKV_BY_HEADS(weighted_values_avx2_r, R, w, codes, scale, out, R, d, S, ng, ldw, accumulate)
}
#endif

// Whether the vector loops apply: an AVX2 CPU, whole 8-byte blocks, groups of 8 channels or
// more that never straddle the two halves, at most kMaxRep query heads per KV head.
inline bool use_avx2(int64_t R, int64_t d, int64_t ng) {
#ifdef ARMKV_AVX2
  const int64_t half = d / 2, gs = d / ng;
  const bool groups_fit = (gs >= half) ? (gs % half == 0 && ng <= 2) : (half % gs == 0 && gs % 8 == 0);
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && half % 8 == 0 && R <= kMaxRep && groups_fit;
#else
  return false;
#endif
}

// then, then_row: rows of then_row bytes a slot that the caller reads next (prefetched alongside);
// ld, ldo: the row strides of the codes and the scores (0: S)
inline void key_scores(const float* q, const uint8_t* codes, const float* scale, float* out, int64_t R, int64_t d,
                       int64_t S, int64_t ng, const uint8_t* then = nullptr, int64_t then_row = 0, int64_t ld = 0,
                       int64_t ldo = 0) {
  ld = ld ? ld : S, ldo = ldo ? ldo : S;
#ifdef ARMKV_AVX2
  if (use_avx2(R, d, ng)) return key_scores_avx2(q, codes, scale, out, R, d, S, ng, then, then_row, ld, ldo);
#endif
  key_scores_scalar(q, codes, scale, out, R, d, S, ng, 0, ld, ldo);
}

// ldw: the weights' row stride (0: S); accumulate: add to out
inline void weighted_values(const float* w, const uint8_t* codes, const float* scale, float* out, int64_t R, int64_t d,
                            int64_t S, int64_t ng, int64_t ldw = 0, bool accumulate = false) {
  ldw = ldw ? ldw : S;
#ifdef ARMKV_AVX2
  if (use_avx2(R, d, ng)) return weighted_values_avx2(w, codes, scale, out, R, d, S, ng, ldw, accumulate);
#endif
  weighted_values_scalar(w, codes, scale, out, R, d, S, ng, ldw, accumulate);
}

// ---------------------------------------------------------------- int8 keys (k8v4, int8 slots)
// scores [R, S] = (q . codes[:, s]) * scale[s], codes [d, S] int8 channel-major, one scale a slot;
// slots from `first` on
inline void int8_key_scores_scalar(const float* q, const int8_t* codes, const float* scale, float* out, int64_t R,
                                   int64_t d, int64_t S, int64_t first, int64_t ld, int64_t ldo) {
  for (int64_t s = first; s < S; ++s)
    for (int64_t r = 0; r < R; ++r) {
      float total = 0.0f;
      for (int64_t c = 0; c < d; ++c) total += q[r * d + c] * static_cast<float>(codes[c * ld + s]);
      out[r * ldo + s] = total * scale[s];
    }
}

#ifdef ARMKV_AVX2
// blocks of 16 slots: one 16-byte load per channel row feeds two accumulators per query head
template <int RR>
__attribute__((target("avx2,fma"))) void int8_key_scores_avx2_r(const float* q, const int8_t* codes, const float* scale,
                                                               float* out, int64_t R_, int64_t d, int64_t S,
                                                               const uint8_t* then, int64_t then_row, int64_t ld, int64_t ldo) {
  // the last S % 16 (S >= 16) in a block that ends at S, as key_scores_avx2_r's last 8
  const int64_t R = heads<RR>(R_), last = S - 16;
  for (int64_t i = 0; i < S && last >= 0; i += 16) {
    const int64_t s0 = std::min(i, last);
    // prefetches as in key_scores_avx2_r: each channel row's line ahead, and the rows read next
    if (s0 % 64 == 0 && s0 + kPrefetchAhead < S)
      for (int64_t c = 0; c < d; ++c) _mm_prefetch(reinterpret_cast<const char*>(codes + c * ld + s0 + kPrefetchAhead), _MM_HINT_T0);
    if (then)
      for (int64_t b = 0; b < 16 * then_row; b += 64) _mm_prefetch(reinterpret_cast<const char*>(then + s0 * then_row + b), _MM_HINT_T0);
    __m256 lo[kAcc<RR>], hi[kAcc<RR>];
    for (int64_t r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
    for (int64_t c = 0; c < d; ++c) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + c * ld + s0));
      const __m256 k0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
      const __m256 k1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
      for (int64_t r = 0; r < R; ++r) {
        const __m256 qc = _mm256_set1_ps(q[r * d + c]);
        lo[r] = _mm256_fmadd_ps(qc, k0, lo[r]);
        hi[r] = _mm256_fmadd_ps(qc, k1, hi[r]);
      }
    }
    const __m256 s_lo = _mm256_loadu_ps(scale + s0), s_hi = _mm256_loadu_ps(scale + s0 + 8);
    for (int64_t r = 0; r < R; ++r) {
      _mm256_storeu_ps(out + r * ldo + s0, _mm256_mul_ps(lo[r], s_lo));
      _mm256_storeu_ps(out + r * ldo + s0 + 8, _mm256_mul_ps(hi[r], s_hi));
    }
  }
  if (last < 0) int8_key_scores_scalar(q, codes, scale, out, R, d, S, 0, ld, ldo);  // fewer than 16 slots
}

inline void int8_key_scores_avx2(const float* q, const int8_t* codes, const float* scale, float* out, int64_t R, int64_t d,
                                 int64_t S, const uint8_t* then, int64_t then_row, int64_t ld, int64_t ldo) {
  ARMKV_BY_HEADS(int8_key_scores_avx2_r, R, q, codes, scale, out, R, d, S, then, then_row, ld, ldo)
}
#endif

inline bool int8_use_avx2(int64_t R) {
#ifdef ARMKV_AVX2
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && R <= kMaxRep;
#else
  return false;
#endif
}

inline void int8_key_scores(const float* q, const int8_t* codes, const float* scale, float* out, int64_t R, int64_t d,
                            int64_t S, const uint8_t* then = nullptr, int64_t then_row = 0, int64_t ld = 0, int64_t ldo = 0) {
  ld = ld ? ld : S, ldo = ldo ? ldo : S;  // as key_scores
#ifdef ARMKV_AVX2
  if (int8_use_avx2(R)) return int8_key_scores_avx2(q, codes, scale, out, R, d, S, then, then_row, ld, ldo);
#endif
  int8_key_scores_scalar(q, codes, scale, out, R, d, S, 0, ld, ldo);
}

}  // namespace armkv
