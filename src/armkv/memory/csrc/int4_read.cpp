// Fused CPU reads of int4 slots for the decode step, built on first use by
// armkv.memory.kernels (torch.utils.cpp_extension), one file so that its hash covers it all.
//
// Slot vectors are int4 codes, two a byte: channel c in the low nibble and channel c + d/2
// in the high nibble of byte c, two's complement (armkv.memory.quant.pack_int4), with one
// scale per group of d / ng channels. PyTorch's eager path (MemoryState.key_scores and
// weighted_values: the reference these are tested against) splits the nibbles, converts
// them to floats and multiplies: a dozen passes over the state, each allocating. Here each
// byte is read once and decoded in registers; the arithmetic is the same (per group, the
// integer codes are summed against the query or the weights, then scaled).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define ARMKV_AVX2 1
#endif

namespace armkv {

constexpr int kMaxRep = 16;  // query heads per KV head handled by the kernels
// how far ahead in a channel row the key loops prefetch (bytes = slots): measured on the
// decode read of cold slots, 256 and 512 alike, 1,024 no better than none
constexpr int64_t kPrefetchAhead = 256;

// name(ARGS, vectorised): name##_body<true> compiled for AVX2 and FMA where the CPU has them and
// `vectorised` (false: the portable loops, for tests), else name##_body<false>
#ifdef ARMKV_AVX2
#define ARMKV_DISPATCH(name, ARGS, CALL)                                                              \
  __attribute__((target("avx2,fma"))) void name##_avx2(ARGS) { name##_body<true>(CALL); }           \
  void name##_baseline(ARGS) { name##_body<false>(CALL); }                                          \
  inline void name(ARGS, bool vectorised) {                                                         \
    if (vectorised && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return name##_avx2(CALL); \
    name##_baseline(CALL);                                                                          \
  }
#else
#define ARMKV_DISPATCH(name, ARGS, CALL)                                                              \
  void name##_baseline(ARGS) { name##_body<false>(CALL); }                                          \
  inline void name(ARGS, bool) { name##_baseline(CALL); }
#endif

inline float low_nibble(uint8_t b) { int v = static_cast<int8_t>(b); return static_cast<float>(((v - ((v >> 4) << 4)) ^ 8) - 8); }
inline float high_nibble(uint8_t b) { return static_cast<float>(static_cast<int8_t>(b) >> 4); }

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

// ---------------------------------------------------------------- the whole decode-step read
// One new token of one KV head group (ARMLayer._decode_read): its R query heads over the
// slots (int4 or int8 key codes, int4 value codes; mixed slots read with the mixed query),
// the exact entries and the token itself, in one softmax. In PyTorch this is some twenty
// small ops per layer, each dispatched from Python; here one call per layer.

#ifdef ARMKV_AVX2
// exp of 8 floats (Cephes' polynomial, relative error about 1e-7); inputs under -87 give 0
__attribute__((target("avx2,fma"))) inline __m256 exp8(__m256 x) {
  const __m256 gone = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(gone, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

// x[i] = exp(x[i] - peak) in place; returns their sum
__attribute__((target("avx2,fma"))) inline float exp_shift_sum_avx2(float* x, int64_t n, float peak) {
  const __m256 p = _mm256_set1_ps(peak);
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), p));
    _mm256_storeu_ps(x + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  alignas(32) float part[8];
  _mm256_store_ps(part, acc);
  float total = part[0] + part[1] + part[2] + part[3] + part[4] + part[5] + part[6] + part[7];
  for (; i < n; ++i) total += (x[i] = std::exp(x[i] - peak));
  return total;
}
#endif

#ifdef ARMKV_AVX2
__attribute__((target("avx2,fma"))) inline float dot_avx2(const float* a, const float* b, int64_t d) {
  __m256 acc = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= d; c += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + c), _mm256_loadu_ps(b + c), acc);
  alignas(32) float part[8];
  _mm256_store_ps(part, acc);
  float total = part[0] + part[1] + part[2] + part[3] + part[4] + part[5] + part[6] + part[7];
  for (; c < d; ++c) total += a[c] * b[c];
  return total;
}
#endif

// x[i] = x[i] * scaling + bias[i] in place; returns their maximum (-inf for n = 0)
inline float affine_max_scalar(float* x, const float* bias, int64_t n, float scaling) {
  float peak = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) peak = std::max(peak, x[i] = x[i] * scaling + bias[i]);
  return peak;
}

#ifdef ARMKV_AVX2
// the same, 8 at a time (the same roundings: a product, then a sum): the compiler does not
// vectorise a float max reduction without fast-math
__attribute__((target("avx2,fma"))) inline float affine_max_avx2(float* x, const float* bias, int64_t n, float scaling) {
  const __m256 f = _mm256_set1_ps(scaling);
  __m256 acc = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 y = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), f), _mm256_loadu_ps(bias + i));
    _mm256_storeu_ps(x + i, y);
    acc = _mm256_max_ps(acc, y);
  }
  alignas(32) float part[8];
  _mm256_store_ps(part, acc);
  float peak = part[0];
  for (int k = 1; k < 8; ++k) peak = std::max(peak, part[k]);
  for (; i < n; ++i) peak = std::max(peak, x[i] = x[i] * scaling + bias[i]);
  return peak;
}

// the largest of x [n], 8 at a time (a maximum is exact: any order gives the same)
__attribute__((target("avx2"))) inline float max_avx2(const float* x, int64_t n) {
  __m256 acc = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_max_ps(acc, _mm256_loadu_ps(x + i));
  alignas(32) float part[8];
  _mm256_store_ps(part, acc);
  float peak = part[0];
  for (int k = 1; k < 8; ++k) peak = std::max(peak, part[k]);
  for (; i < n; ++i) peak = std::max(peak, x[i]);
  return peak;
}

#endif

template <bool AVX>
__attribute__((always_inline)) inline float max_of(const float* x, int64_t n) {
#ifdef ARMKV_AVX2
  if constexpr (AVX) return max_avx2(x, n);
#endif
  float peak = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) peak = std::max(peak, x[i]);
  return peak;
}

template <bool AVX>
__attribute__((always_inline)) inline float affine_max(float* x, const float* bias, int64_t n, float scaling) {
#ifdef ARMKV_AVX2
  if constexpr (AVX) return affine_max_avx2(x, bias, n, scaling);
#endif
  return affine_max_scalar(x, bias, n, scaling);
}

inline float exp_shift_sum_scalar(float* x, int64_t n, float peak) {
  float total = 0.0f;
  for (int64_t i = 0; i < n; ++i) total += (x[i] = std::exp(x[i] - peak));
  return total;
}

inline float bf16_to_float(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(float));
  return out;
}

#ifdef ARMKV_AVX2
// 8 bfloat16 -> 8 float32 (exact: a bfloat16 is the high half of a float32)
__attribute__((target("avx2"))) inline __m256 bf16x8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

__attribute__((target("avx2"))) inline void bf16_to_float_avx2(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, bf16x8(src + i));
  for (; i < n; ++i) dst[i] = bf16_to_float(src[i]);
}
#endif

// A [S, ng] table of scales as the pool stores them, float32 or bfloat16. A read converts only
// the rows it reads (a sparse read a fraction of them), into a buffer of its thread that lives
// from call to call instead of a new tensor each call.
struct Scales {
  const float* f32 = nullptr;      // float32 scales, or
  const uint16_t* bf16 = nullptr;  // bfloat16 ones (the high half of a float32's bits)
  int64_t ng = 1;

  float at(int64_t i) const { return f32 ? f32[i] : bf16_to_float(bf16[i]); }  // element i of the flat table

  // where row s0 lies as stored, and the bytes of a row
  const void* row(int64_t s0) const { return f32 ? static_cast<const void*>(f32 + s0 * ng) : bf16 + s0 * ng; }
  int64_t row_bytes() const { return ng * (f32 ? 4 : 2); }

  // rows [s0, s0 + n) as float32: the table's own where it is float32, else converted into buf
  const float* rows(int64_t s0, int64_t n, std::vector<float>& buf) const {
    if (f32) return f32 + s0 * ng;
    buf.resize(std::max<int64_t>(n * ng, 1));
    const uint16_t* src = bf16 + s0 * ng;
    float* dst = buf.data();
#ifdef ARMKV_AVX2
    if (__builtin_cpu_supports("avx2")) {
      bf16_to_float_avx2(src, dst, n * ng);
      return dst;
    }
#endif
    for (int64_t i = 0; i < n * ng; ++i) dst[i] = bf16_to_float(src[i]);
    return dst;
  }
};

struct DecodeGroup {  // one group's inputs and outputs (pointers into contiguous tensors)
  const float* q;         // [R, d]
  const float* own_k;     // [d]
  const float* own_v;     // [d]
  bool own_ok;
  const float* exact_k;   // [L, d]
  const float* exact_v;   // [L, d]
  const bool* exact_ok;   // [L]
  const void* key_codes;  // uint8 [d/2, S] or int8 [d, S], rows ld apart
  int64_t ld;             // the key codes' row stride (>= S: a pool's first S slots are a view)
  Scales key_scale;       // [S, ngk]
  const uint8_t* value_codes;  // [S, d/2]
  Scales value_scale;     // [S, ngv]
  const float* bias;      // [S] (-inf: free)
  float* out;             // [R, d]
};

template <bool AVX>
__attribute__((always_inline)) inline float dot(const float* a, const float* b, int64_t d) {
#ifdef ARMKV_AVX2
  if constexpr (AVX) return dot_avx2(a, b, d);
#endif
  float total = 0.0f;
  for (int64_t c = 0; c < d; ++c) total += a[c] * b[c];
  return total;
}

// q [R, d] in the slots' basis: q Q where they are mixed (mix [d, d] row-major, as an axpy
// loop over contiguous rows, which the compiler vectorises), else a copy
inline void mix_query(const float* q, const float* mix, int64_t R, int64_t d, float* qm) {
  for (int64_t r = 0; r < R; ++r) {
    float* row = qm + r * d;
    if (!mix) {
      std::copy(q + r * d, q + (r + 1) * d, row);
      continue;
    }
    std::fill(row, row + d, 0.0f);
    for (int64_t c = 0; c < d; ++c) {
      const float x = q[r * d + c];
      const float* m = mix + c * d;
      for (int64_t j = 0; j < d; ++j) row[j] += x * m[j];
    }
  }
}

// The rest of a group's decode read once its S slots are scored: slot_w [R, S] holds their
// logits (q.k * scaling + bias), peaks [R] their largest per head where the caller has them
// (else null: taken here). One softmax over the slots, the exact entries and the token; values(slot_w, tmp) then puts
// the slots' weighted values [R, d] in tmp (weighted_values over the S slots' codes, or run by
// run where they lie in a pool), and those, unmixed (mix_t = Q^T, or null), go into a.out.
// read_summaries: the units (buckets or pages) a read skips, one softmax entry each (read.unit_summaries),
// in the slots' basis: logit qm . k * scaling + lw, value v
struct UnitEntries {
  const float* k = nullptr;   // [U, d] each unit's weighted mean key
  const float* v = nullptr;   // [U, d] and value
  const float* lw = nullptr;  // [U] the log of its total weight (-inf: an empty unit)
  const char* skip = nullptr; // [U] 1 where the read skips the unit
  const float* qm = nullptr;  // [R, d] the query in the slots' basis
  float* w = nullptr;         // [R, U] scratch: the entries' logits, then their weights
  int64_t U = 0;
};

// the logits of the units `e` skips for head r (-inf for the others) into e.w; returns their largest
template <bool AVX>
__attribute__((always_inline)) inline float unit_logits(const UnitEntries& e, int64_t r, int64_t d, float scaling) {
  const float ninf = -std::numeric_limits<float>::infinity();
  float* uw = e.w + r * e.U;
  float peak = ninf;
  for (int64_t u = 0; u < e.U; ++u) {
    uw[u] = e.skip[u] && e.lw[u] > ninf ? dot<AVX>(e.qm + r * d, e.k + u * d, d) * scaling + e.lw[u] : ninf;
    peak = std::max(peak, uw[u]);
  }
  return peak;
}

// out [d] += sum over u of w[u] * e.v[u] (the weights of the entries e.w holds for one head)
inline void unit_values(const UnitEntries& e, const float* w, int64_t d, float* out) {
  for (int64_t u = 0; u < e.U; ++u) {
    if (w[u] == 0.0f) continue;
    const float* v = e.v + u * d;
    for (int64_t j = 0; j < d; ++j) out[j] += w[u] * v[j];
  }
}

// units: the entries of the units the read skips (read_summaries), or null
template <bool AVX, class Values>
__attribute__((always_inline)) inline void decode_tail(const DecodeGroup& a, const float* mix_t, int64_t R, int64_t d,
                                                     int64_t L, int64_t S, float scaling, float* slot_w, const float* peaks,
                                                     float* exact_w, float* tmp, const Values& values,
                                                     const UnitEntries* units = nullptr) {
  const float ninf = -std::numeric_limits<float>::infinity();
  const int64_t U = units ? units->U : 0;
  for (int64_t r = 0; r < R; ++r) {
    float* sw = slot_w + r * S;
    float* ew = exact_w + r * (L + 1);
    float* uw = units ? units->w + r * U : nullptr;
    const float* qr = a.q + r * d;
    float peak = peaks ? peaks[r] : max_of<AVX>(sw, S);
    for (int64_t l = 0; l <= L; ++l) {
      const float* k = l < L ? a.exact_k + l * d : a.own_k;
      const bool ok = l < L ? a.exact_ok[l] : a.own_ok;
      ew[l] = ok ? dot<AVX>(qr, k, d) * scaling : ninf;
      peak = std::max(peak, ew[l]);
    }
    if (units) peak = std::max(peak, unit_logits<AVX>(*units, r, d, scaling));
    if (peak == ninf) {  // nothing to read (a padding token with an empty state): zeros
      std::fill(sw, sw + S, 0.0f);
      std::fill(ew, ew + L + 1, 0.0f);
      if (units) std::fill(uw, uw + U, 0.0f);
      continue;
    }
    float total;
#ifdef ARMKV_AVX2
    if constexpr (AVX)
      total = exp_shift_sum_avx2(sw, S, peak) + exp_shift_sum_avx2(ew, L + 1, peak) + (units ? exp_shift_sum_avx2(uw, U, peak) : 0.0f);
    else
#endif
      total = exp_shift_sum_scalar(sw, S, peak) + exp_shift_sum_scalar(ew, L + 1, peak) +
              (units ? exp_shift_sum_scalar(uw, U, peak) : 0.0f);
    const float inv = 1.0f / total;
    for (int64_t s = 0; s < S; ++s) sw[s] *= inv;
    for (int64_t l = 0; l <= L; ++l) ew[l] *= inv;
    for (int64_t u = 0; u < U; ++u) uw[u] *= inv;
  }
  values(slot_w, tmp);
  if (units)  // (in the slots' basis, as the slots' weighted values: unmixed with them below)
    for (int64_t r = 0; r < R; ++r) unit_values(*units, units->w + r * U, d, tmp + r * d);
  for (int64_t r = 0; r < R; ++r) {
    const float* ew = exact_w + r * (L + 1);
    float* o = a.out + r * d;
    if (mix_t) {  // back from the slots' basis: (w V Q) Q^T
      std::fill(o, o + d, 0.0f);
      for (int64_t c = 0; c < d; ++c) {
        const float x = tmp[r * d + c];
        const float* m = mix_t + c * d;
        for (int64_t j = 0; j < d; ++j) o[j] += x * m[j];
      }
    } else {
      std::copy(tmp + r * d, tmp + (r + 1) * d, o);
    }
    for (int64_t l = 0; l < L; ++l) {
      const float w = ew[l];
      if (w == 0.0f) continue;
      const float* v = a.exact_v + l * d;
      for (int64_t j = 0; j < d; ++j) a.out[r * d + j] += w * v[j];
    }
    if (a.own_ok && ew[L] != 0.0f)
      for (int64_t j = 0; j < d; ++j) a.out[r * d + j] += ew[L] * a.own_v[j];
  }
}

// ---------------------------------------------------------------- the write's passes over the pool
// A write (ARMLayer._flush) needs every slot as pre-RoPE floats and, when the pool is full,
// each slot's nearest neighbour among the `width` slots on either side in bucket order. In
// PyTorch each is a dozen passes over the state; here one.

inline float dot_scalar(const float* a, const float* b, int64_t d) {
  float s = 0.0f;
  for (int64_t c = 0; c < d; ++c) s += a[c] * b[c];
  return s;
}

// out[o - 1] = rows[order[i]] . rows[order[i + o]] for o = 1..n (the rows of one group, [S, d])
inline void band_row_scalar(const float* rows, const int64_t* order, int64_t i, int64_t n, int64_t d, float* out) {
  const float* a = rows + order[i] * d;
  for (int64_t o = 1; o <= n; ++o) out[o - 1] = dot_scalar(a, rows + order[i + o] * d, d);
}

#ifdef ARMKV_AVX2
__attribute__((target("avx2,fma"))) inline float hsum_avx2(__m256 acc) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  h = _mm_hadd_ps(h, h);
  h = _mm_hadd_ps(h, h);
  return _mm_cvtss_f32(h);
}

// The same dots, four partners at a time: four independent accumulator chains instead of
// one (a single chain waits out the FMA latency at every step), each partner's sum taken in
// the same order as one at a time, so the results are the same bits.
__attribute__((target("avx2,fma"))) inline void band_row_avx2(const float* rows, const int64_t* order, int64_t i, int64_t n,
                                                              int64_t d, float* out) {
  const float* a = rows + order[i] * d;
  const int64_t d8 = d - d % 8;
  int64_t o = 1;
  for (; o + 3 <= n; o += 4) {
    const float* b0 = rows + order[i + o] * d;
    const float* b1 = rows + order[i + o + 1] * d;
    const float* b2 = rows + order[i + o + 2] * d;
    const float* b3 = rows + order[i + o + 3] * d;
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
    for (int64_t c = 0; c < d8; c += 8) {
      const __m256 x = _mm256_loadu_ps(a + c);
      s0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b0 + c), s0);
      s1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b1 + c), s1);
      s2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b2 + c), s2);
      s3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b3 + c), s3);
    }
    float r0 = hsum_avx2(s0), r1 = hsum_avx2(s1), r2 = hsum_avx2(s2), r3 = hsum_avx2(s3);
    for (int64_t c = d8; c < d; ++c) r0 += a[c] * b0[c], r1 += a[c] * b1[c], r2 += a[c] * b2[c], r3 += a[c] * b3[c];
    out[o - 1] = r0, out[o] = r1, out[o + 1] = r2, out[o + 2] = r3;
  }
  for (; o <= n; ++o) {
    const float* b = rows + order[i + o] * d;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t c = 0; c < d8; c += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + c), _mm256_loadu_ps(b + c), acc);
    float s = hsum_avx2(acc);
    for (int64_t c = d8; c < d; ++c) s += a[c] * b[c];
    out[o - 1] = s;
  }
}
#endif

inline void band_row(const float* rows, const int64_t* order, int64_t i, int64_t n, int64_t d, float* out) {
#ifdef ARMKV_AVX2
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return band_row_avx2(rows, order, i, n, d, out);
#endif
  band_row_scalar(rows, order, i, n, d, out);
}

// One group of write.banded_neighbours (the cosine of the keys). order [S]: the slots in bucket order; bucket [S]: each
// slot's bucket, -1 where free. Place i's candidates are places i +- o, o = 1..width, that
// hold an occupied slot of the same bucket; the nearest place wins a tie, the later side
// only when strictly better (as the PyTorch reference's max over the band). Writes each
// slot's best similarity (-inf: none) and partner slot, in slot indexing.
inline void band_neighbours_group(const float* key, const int64_t* order, const int64_t* bucket,
                                  int64_t S, int64_t d, int64_t width, float* nn_sim, int64_t* nn_idx) {
  const float ninf = -std::numeric_limits<float>::infinity();
  std::vector<float> inv_k(S), fwd(S, ninf), back(S, ninf), dots(width);
  std::vector<int64_t> fwd_o(S, 1), back_o(S, 1);
  for (int64_t s = 0; s < S; ++s) inv_k[s] = 1.0f / std::max(std::sqrt(dot_scalar(key + s * d, key + s * d, d)), 1e-12f);
  for (int64_t i = 0; i < S; ++i) {
    const int64_t a = order[i], ba = bucket[a];
    if (ba < 0) continue;
    int64_t n = std::min(width, S - 1 - i);
    while (n > 0 && bucket[order[i + n]] != ba) --n;  // bucket order: the same bucket is one run
    if (n == 0) continue;
    band_row(key, order, i, n, d, dots.data());
    for (int64_t o = 1; o <= n; ++o) {
      const int64_t b = order[i + o];
      if (bucket[b] != ba) continue;
      const float sim = dots[o - 1] * inv_k[a] * inv_k[b];
      if (sim > fwd[i]) fwd[i] = sim, fwd_o[i] = o;                   // the nearest of equals: first seen
      if (sim >= back[i + o] || back[i + o] == ninf) back[i + o] = sim, back_o[i + o] = o;  // seen farthest first
    }
  }
  for (int64_t i = 0; i < S; ++i) {
    const bool use_back = back[i] > fwd[i];
    const int64_t place = std::min(std::max<int64_t>(use_back ? i - back_o[i] : i + fwd_o[i], 0), S - 1);
    nn_sim[order[i]] = use_back ? back[i] : fwd[i];
    nn_idx[order[i]] = order[place];
  }
}

// One token of write.plan_writes' choice among the slots (its cosines cos [S] to every slot),
// in one pass: the best occupied slot of the token's bucket (the merge candidate) and the
// best occupied slot of any bucket (where the token would go if the full pool demoted it).
// eligible [S]: each slot's bucket, -1 where free; bucket: the token's (-2 matches none).
// Ties go to the first slot, as torch's max; -inf and index 0 where nothing is eligible.
inline void best_slots_row_scalar(const float* cos, const int32_t* eligible, int32_t bucket, int64_t S, float* same,
                                  int64_t* same_idx, float* any, int64_t* any_idx) {
  const float ninf = -std::numeric_limits<float>::infinity();
  float ms = ninf, ma = ninf;
  for (int64_t s = 0; s < S; ++s) {
    const float c = cos[s];
    ma = std::max(ma, eligible[s] >= 0 ? c : ninf);
    ms = std::max(ms, eligible[s] == bucket ? c : ninf);
  }
  int64_t is = 0, ia = 0;
  bool found_s = ms == ninf, found_a = ma == ninf;
  for (int64_t s = 0; s < S && !(found_s && found_a); ++s) {
    const float c = cos[s];
    if (!found_a && eligible[s] >= 0 && c == ma) ia = s, found_a = true;
    if (!found_s && eligible[s] == bucket && c == ms) is = s, found_s = true;
  }
  *same = ms, *same_idx = is, *any = ma, *any_idx = ia;
}

#ifdef ARMKV_AVX2
// The same, 8 slots a step: the maxima, then the first slot holding each
__attribute__((target("avx2,fma"))) void best_slots_row_avx2(const float* cos, const int32_t* eligible, int32_t bucket,
                                                              int64_t S, float* same, int64_t* same_idx, float* any,
                                                              int64_t* any_idx) {
  const float ninf = -std::numeric_limits<float>::infinity();
  const __m256 vninf = _mm256_set1_ps(ninf);
  const __m256i vb = _mm256_set1_epi32(bucket), vfree = _mm256_set1_epi32(-1);
  __m256 vms = vninf, vma = vninf;
  int64_t s = 0;
  for (; s + 8 <= S; s += 8) {
    const __m256 c = _mm256_loadu_ps(cos + s);
    const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(eligible + s));
    const __m256 occ = _mm256_castsi256_ps(_mm256_cmpgt_epi32(e, vfree));
    const __m256 mine = _mm256_castsi256_ps(_mm256_cmpeq_epi32(e, vb));
    vma = _mm256_max_ps(vma, _mm256_blendv_ps(vninf, c, occ));
    vms = _mm256_max_ps(vms, _mm256_blendv_ps(vninf, c, mine));
  }
  alignas(32) float la[8], ls[8];
  _mm256_store_ps(la, vma);
  _mm256_store_ps(ls, vms);
  float ma = ninf, ms = ninf;
  for (int j = 0; j < 8; ++j) ma = std::max(ma, la[j]), ms = std::max(ms, ls[j]);
  for (; s < S; ++s) {
    ma = std::max(ma, eligible[s] >= 0 ? cos[s] : ninf);
    ms = std::max(ms, eligible[s] == bucket ? cos[s] : ninf);
  }
  int64_t is = 0, ia = 0;
  bool found_s = ms == ninf, found_a = ma == ninf;
  const __m256 vxa = _mm256_set1_ps(ma), vxs = _mm256_set1_ps(ms);
  for (s = 0; s + 8 <= S && !(found_s && found_a); s += 8) {
    const __m256 c = _mm256_loadu_ps(cos + s);
    const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(eligible + s));
    if (!found_a) {
      const int hit = _mm256_movemask_ps(_mm256_and_ps(_mm256_cmp_ps(c, vxa, _CMP_EQ_OQ), _mm256_castsi256_ps(_mm256_cmpgt_epi32(e, vfree))));
      if (hit) ia = s + __builtin_ctz(hit), found_a = true;
    }
    if (!found_s) {
      const int hit = _mm256_movemask_ps(_mm256_and_ps(_mm256_cmp_ps(c, vxs, _CMP_EQ_OQ), _mm256_castsi256_ps(_mm256_cmpeq_epi32(e, vb))));
      if (hit) is = s + __builtin_ctz(hit), found_s = true;
    }
  }
  for (; s < S && !(found_s && found_a); ++s) {
    if (!found_a && eligible[s] >= 0 && cos[s] == ma) ia = s, found_a = true;
    if (!found_s && eligible[s] == bucket && cos[s] == ms) is = s, found_s = true;
  }
  *same = ms, *same_idx = is, *any = ma, *any_idx = ia;
}
#endif

// One group of write.plan_writes' choice under demote_scope="bucket": tokens [N, d] and slots
// [S, d]; slot_bucket [S] (negative: free), token_bucket [N]. Each token's most similar
// occupied slot of its own bucket (the merge candidate, and where a full pool would demote
// it): the cosines of the token with the slots of its bucket alone, N x (slots of the bucket)
// dot products where the cosine matrix would take N x S. Cosine = x.k / (max(|x|, 1e-12)
// max(|k|, 1e-12)), as F.normalize's rows. The occupied slots are copied in bucket order
// (ascending index within one, so the first of equal cosines wins, as torch's max), each
// scaled to unit length; -inf and index 0 where the bucket holds no slot.
template <bool AVX>
void bucket_best_group(const float* tok, const float* slots, const int32_t* sb, const int32_t* tb, int64_t N, int64_t S,
                       int64_t d, float* best, int64_t* idx) {
  const float ninf = -std::numeric_limits<float>::infinity();
  int64_t nb = 0;
  for (int64_t s = 0; s < S; ++s) nb = std::max<int64_t>(nb, static_cast<int64_t>(sb[s]) + 1);
  std::vector<int64_t> start(nb + 1, 0);
  for (int64_t s = 0; s < S; ++s)
    if (sb[s] >= 0) ++start[sb[s] + 1];
  for (int64_t b = 0; b < nb; ++b) start[b + 1] += start[b];
  std::vector<int64_t> order(start[nb]), fill(start.begin(), start.end() - 1);
  for (int64_t s = 0; s < S; ++s)
    if (sb[s] >= 0) order[fill[sb[s]]++] = s;
  // the occupied slots in bucket order, unit rows: each bucket one run; only the buckets some
  // token reads are normalised (a decode-time write has 16 tokens against thousands of slots)
  std::vector<char> read(nb, 0);
  for (int64_t t = 0; t < N; ++t)
    if (tb[t] >= 0 && tb[t] < nb) read[tb[t]] = 1;
  std::unique_ptr<float[]> rows(new float[std::max<int64_t>(start[nb] * d, 1)]);
  for (int64_t b = 0; b < nb; ++b) {
    if (!read[b]) continue;
    for (int64_t j = start[b]; j < start[b + 1]; ++j) {
      const float* k = slots + order[j] * d;
      const float inv = 1.0f / std::max(std::sqrt(dot_scalar(k, k, d)), 1e-12f);
      for (int64_t c = 0; c < d; ++c) rows[j * d + c] = k[c] * inv;
    }
  }
  std::vector<float> x(d);
  for (int64_t t = 0; t < N; ++t) {
    float m = ninf;
    int64_t at = 0;
    const int64_t b = tb[t];
    if (b >= 0 && b < nb && start[b + 1] > start[b]) {
      const float* raw = tok + t * d;
      const float inv = 1.0f / std::max(std::sqrt(dot_scalar(raw, raw, d)), 1e-12f);
      for (int64_t c = 0; c < d; ++c) x[c] = raw[c] * inv;
      for (int64_t j = start[b]; j < start[b + 1]; ++j) {
        const float c = dot<AVX>(x.data(), rows.get() + j * d, d);
        if (c > m) m = c, at = order[j];
      }
    }
    best[t] = m, idx[t] = at;
  }
}

inline void best_slots_row(const float* cos, const int32_t* eligible, int32_t bucket, int64_t S, float* same,
                           int64_t* same_idx, float* any, int64_t* any_idx, bool vectorised) {
#ifdef ARMKV_AVX2
  if (vectorised && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    return best_slots_row_avx2(cos, eligible, bucket, S, same, same_idx, any, any_idx);
#endif
  best_slots_row_scalar(cos, eligible, bucket, S, same, same_idx, any, any_idx);
}

// In-place fast Walsh-Hadamard transform of x [d] (d a power of two), Sylvester order:
// x H, H the +-1 matrix of quant.mixing_matrix before its 1 / sqrt(d)
__attribute__((always_inline)) inline void fwht(float* x, int64_t d) {
  for (int64_t h = 1; h < d; h *= 2)
    for (int64_t i = 0; i < d; i += 2 * h)
      for (int64_t j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
}

// Slots [s0, s1) of one group from int4 codes to the floats a write uses: keys dequantised,
// unmixed (x Q^T with Q = H / sqrt(d), symmetric) and un-rotated (RoPE at the slot's read
// position: cos, sin [S, d/2] per frequency; out = (x cos - rotate_half(x) sin) / scaling),
// values dequantised and unmixed.
__attribute__((always_inline)) inline void unpack_slots_body(const uint8_t* kc, const float* ks, const uint8_t* vc, const float* vs, const float* cs,
                         const float* sn, int64_t S, int64_t d, int64_t ngk, int64_t ngv, bool mixed, float inv_scaling,
                         float* key, float* value, bool int8_keys) {
  const int64_t half = d / 2;
  const float norm = mixed ? 1.0f / std::sqrt(static_cast<float>(d)) : 1.0f;
  std::vector<int64_t> gk(d), gv(d);  // each channel's scale group (no division in the loops)
  for (int64_t c = 0; c < d; ++c) gk[c] = c / (d / ngk), gv[c] = c / (d / ngv);
  constexpr int64_t kBlock = 16;  // slots decoded together: the channel-major key bytes are read in runs
  std::vector<float> x(kBlock * d);
  for (int64_t s0 = 0; s0 < S; s0 += kBlock) {
    const int64_t n = std::min(kBlock, S - s0);
    if (int8_keys) {  // int8 codes [d, S] (k8v4, the ladder's first rung)
      if (s0 % 64 == 0 && s0 + kPrefetchAhead < S)
        for (int64_t c = 0; c < d; ++c) __builtin_prefetch(kc + c * S + s0 + kPrefetchAhead);
      for (int64_t c = 0; c < d; ++c) {
        const int8_t* row = reinterpret_cast<const int8_t*>(kc) + c * S + s0;
        for (int64_t j = 0; j < n; ++j) x[j * d + c] = static_cast<float>(row[j]);
      }
    } else {
      // channel-major rows S bytes apart, cold at decode time: each row's line ahead, as the
      // decode read does (kPrefetchAhead)
      if (s0 % 64 == 0 && s0 + kPrefetchAhead < S)
        for (int64_t c = 0; c < half; ++c) __builtin_prefetch(kc + c * S + s0 + kPrefetchAhead);
      for (int64_t c = 0; c < half; ++c) {
        const uint8_t* row = kc + c * S + s0;
        for (int64_t j = 0; j < n; ++j) {
          x[j * d + c] = low_nibble(row[j]);
          x[j * d + c + half] = high_nibble(row[j]);
        }
      }
    }
    for (int64_t j = 0; j < n; ++j) {
      const int64_t s = s0 + j;
      float* xs = x.data() + j * d;
      const float* sc = ks + s * ngk;
      for (int64_t c = 0; c < d; ++c) xs[c] *= sc[gk[c]];
      if (mixed) fwht(xs, d);
      float* k = key + s * d;
      if (!cs) {  // no rotation (int4_dequantise): the keys as stored
        for (int64_t c = 0; c < d; ++c) k[c] = xs[c] * norm;
      } else {
        for (int64_t c = 0; c < half; ++c) {
          const float x1 = xs[c] * norm, x2 = xs[c + half] * norm, co = cs[s * half + c], si = sn[s * half + c];
          k[c] = (x1 * co + x2 * si) * inv_scaling;
          k[c + half] = (x2 * co - x1 * si) * inv_scaling;
        }
      }
      float* v = value + s * d;
      const uint8_t* vb = vc + s * half;
      const float* vsc = vs + s * ngv;
      for (int64_t c = 0; c < half; ++c) {
        v[c] = low_nibble(vb[c]) * vsc[gv[c]];
        v[c + half] = high_nibble(vb[c]) * vsc[gv[c + half]];
      }
      if (mixed) {
        fwht(v, d);
        for (int64_t c = 0; c < d; ++c) v[c] *= norm;
      }
    }
  }
}

// the same loops compiled for AVX2 where the CPU has it (the compiler vectorises them), else baseline
#define ARMKV_UNPACK_ARGS                                                                                          \
  const uint8_t *kc, const float *ks, const uint8_t *vc, const float *vs, const float *cs, const float *sn, int64_t S, \
      int64_t d, int64_t ngk, int64_t ngv, bool mixed, float inv_scaling, float *key, float *value, bool int8_keys
#define ARMKV_UNPACK_CALL kc, ks, vc, vs, cs, sn, S, d, ngk, ngv, mixed, inv_scaling, key, value, int8_keys
#ifdef ARMKV_AVX2
__attribute__((target("avx2,fma"))) void unpack_slots_avx2(ARMKV_UNPACK_ARGS) { unpack_slots_body(ARMKV_UNPACK_CALL); }
#endif
void unpack_slots_baseline(ARMKV_UNPACK_ARGS) { unpack_slots_body(ARMKV_UNPACK_CALL); }
inline void unpack_slots(ARMKV_UNPACK_ARGS) {
#ifdef ARMKV_AVX2
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return unpack_slots_avx2(ARMKV_UNPACK_CALL);
#endif
  unpack_slots_baseline(ARMKV_UNPACK_CALL);
}

}  // namespace armkv

// ---------------------------------------------------------------- the slots of chosen buckets
namespace armkv {

// An index's units (buckets, or their pages): unit k lists the slots ord[st[k] : st[k] + sz[k]]
// of the order (listed > 0; listed = 0: a pool laid unit by unit, which lists slot p at p),
// read run by run: the order's runs of consecutive slots, in list order, run j the slots
// slot[j] .. at positions pos[j] .. pos[j + 1] - 1 (pos[runs]: where the units' lists end). Built once per
// index (a decode step's bound call keeps them from one write to the next; a pool that is re-laid
// once its order breaks too often has few), a read then finds each unit's best logit and its
// chosen units' slots run by run, never slot by slot through the order.
struct UnitRuns {
  std::vector<int32_t> pos, slot;
  const int32_t *st = nullptr, *sz = nullptr;
  int64_t nb = 0;

  void build(const int32_t* ord, int64_t listed, const int32_t* st_, const int32_t* sz_, int64_t nb_, int64_t S,
             const char* name) {
    st = st_, sz = sz_, nb = nb_;
    int64_t end = 0;  // (the units' lists end there: the free slots listed after them are not read)
    for (int64_t k = 0; k < nb; ++k) {
      TORCH_CHECK(st[k] >= 0 && sz[k] >= 0 && st[k] + sz[k] <= (listed ? listed : S), name, ": a bucket's list runs past order");
      if (sz[k]) end = std::max<int64_t>(end, st[k] + sz[k]);
    }
    pos.clear(), slot.clear();
    if (!listed) {  // the pool lies unit by unit: slot p at p, one run
      pos.push_back(0), slot.push_back(0), pos.push_back(static_cast<int32_t>(S));
      return;
    }
    for (int64_t p = 0; p < end; ++p) {
      const int32_t s = ord[p];
      TORCH_CHECK(s >= 0 && s < S, name, ": a slot id outside the pool");
      if (p == 0 || s != slot.back() + (p - pos.back())) pos.push_back(static_cast<int32_t>(p)), slot.push_back(s);
    }
    pos.push_back(static_cast<int32_t>(end));
  }

  int64_t runs() const { return static_cast<int64_t>(slot.size()); }
  int64_t nbytes() const { return 4 * static_cast<int64_t>(pos.size() + slot.size()); }

  // f(first slot, count) for each run of unit k's slots, in list order
  template <class F>
  void each(int64_t k, F&& f) const {
    int64_t p = st[k], n = sz[k];
    if (n <= 0) return;
    int64_t j = std::upper_bound(pos.begin(), pos.end() - 1, static_cast<int32_t>(p)) - pos.begin() - 1;
    for (; n > 0; ++j) {
      const int64_t take = std::min<int64_t>(n, pos[j + 1] - p);
      f(static_cast<int64_t>(slot[j]) + (p - pos[j]), take);
      p += take, n -= take;
    }
  }
};

// The runs of consecutive slots that the lists of `count` units make (ids `chosen`, best first;
// ids outside [0, nb) are skipped), joined where one ends where the next begins. Returns the
// slots they hold in all.
inline int64_t chosen_runs(const UnitRuns& u, const int64_t* chosen, int64_t count, std::vector<int64_t>& run_start,
                           std::vector<int64_t>& run_len) {
  run_start.clear();
  run_len.clear();
  int64_t W = 0;
  for (int64_t j = 0; j < count; ++j) {
    const int64_t unit = chosen[j];
    if (unit < 0 || unit >= u.nb) continue;
    u.each(unit, [&](int64_t s0, int64_t n) {
      W += n;
      if (!run_start.empty() && run_start.back() + run_len.back() == s0)
        run_len.back() += n;
      else
        run_start.push_back(s0), run_len.push_back(n);
    });
  }
  return W;
}

#ifdef ARMKV_AVX2
// out [R, d] = the weighted values of the slots of the runs (bucket_runs) of a pool (value
// codes [S, d/2], scales [S, ng]), read where they lie: w [R, W] the runs' slots' weights in
// run order; run by run, each added to the ones before
inline void run_values(const float* w, const uint8_t* codes, const Scales& scale, float* out, int64_t R, int64_t d,
                       int64_t W, int64_t ng, const std::vector<int64_t>& start, const std::vector<int64_t>& len) {
  thread_local std::vector<float> buf;
  if (start.empty()) std::fill(out, out + R * d, 0.0f);
  for (size_t k = 0, at = 0; k < start.size(); at += len[k], ++k)
    weighted_values(w + at, codes + start[k] * (d / 2), scale.rows(start[k], len[k], buf), out, R, d, len[k], ng, W, k > 0);
}

// lo = sum wl[j] x the low nibble of row[j], hi = the same of wh and the high nibbles, over the
// first whole blocks of 8 of the n bytes; returns how many bytes that covered
__attribute__((target("avx2,fma"))) inline int64_t nibble_dots_avx2(const uint8_t* row, const float* wl, const float* wh,
                                                                   int64_t n, float& lo, float& hi) {
  __m256 alo = _mm256_setzero_ps(), ahi = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 l, h;
    decode8(row + j, l, h);
    alo = _mm256_fmadd_ps(l, _mm256_loadu_ps(wl + j), alo);
    ahi = _mm256_fmadd_ps(h, _mm256_loadu_ps(wh + j), ahi);
  }
  lo = hsum_avx2(alo), hi = hsum_avx2(ahi);
  return j;
}

// One unit of read.unit_summaries from the codes: over the slots of its runs (bucket_runs),
// with weights w [W] in run order, key_sum [d] = sum w k and value_sum [d] = sum w v in the
// slots' basis (key codes channel-major, rows ld apart: int4 [d/2, S] with scales [S, ngk], or
// int8 [d, S] with one scale a slot; value codes [S, d/2] with scales [S, ngv])
template <bool AVX>
__attribute__((always_inline)) inline void unit_sums_body(const float* w, const void* key_codes, bool int8_keys,
                                                        const Scales& key_scale, const uint8_t* value_codes,
                                                        const Scales& value_scale, int64_t d, int64_t ld, int64_t ngk,
                                                        int64_t ngv, int64_t W, const std::vector<int64_t>& start,
                                                        const std::vector<int64_t>& len, float* key_sum, float* value_sum) {
  thread_local std::vector<float> buf, ws;
  const int64_t half = d / 2;
  std::fill(key_sum, key_sum + d, 0.0f);
  run_values(w, value_codes, value_scale, value_sum, 1, d, W, ngv, start, len);
  for (size_t k = 0, at = 0; k < start.size(); at += len[k], ++k) {
    const int64_t s0 = start[k], n = len[k];
    const float* sc = key_scale.rows(s0, n, buf);
    const float* wk = w + at;
    if (int8_keys) {  // one scale a slot
      ws.resize(n);
      for (int64_t j = 0; j < n; ++j) ws[j] = wk[j] * sc[j];
      const int8_t* codes = static_cast<const int8_t*>(key_codes) + s0;
      for (int64_t c = 0; c < d; ++c) {
        const int8_t* row = codes + c * ld;
        float acc = 0.0f;
        for (int64_t j = 0; j < n; ++j) acc += ws[j] * static_cast<float>(row[j]);
        key_sum[c] += acc;
      }
      continue;
    }
    const int64_t gs = d / ngk;  // (each group's weights w x scale, then one pass over each code row)
    ws.resize(ngk * n);
    for (int64_t g = 0; g < ngk; ++g)
      for (int64_t j = 0; j < n; ++j) ws[g * n + j] = wk[j] * sc[j * ngk + g];
    const uint8_t* codes = static_cast<const uint8_t*>(key_codes) + s0;
    for (int64_t c = 0; c < half; ++c) {
      const uint8_t* row = codes + c * ld;
      const float* wl = ws.data() + (c / gs) * n;
      const float* wh = ws.data() + ((c + half) / gs) * n;
      float lo = 0.0f, hi = 0.0f;
      int64_t j = 0;
      if constexpr (AVX) j = nibble_dots_avx2(row, wl, wh, n, lo, hi);
      for (; j < n; ++j) lo += wl[j] * low_nibble(row[j]), hi += wh[j] * high_nibble(row[j]);
      key_sum[c] += lo, key_sum[c + half] += hi;
    }
  }
}

#define ARMKV_SUMS_ARGS                                                                                              \
  const float *w, const void *key_codes, bool int8_keys, const Scales &key_scale, const uint8_t *value_codes,      \
      const Scales &value_scale, int64_t d, int64_t ld, int64_t ngk, int64_t ngv, int64_t W,                          \
      const std::vector<int64_t> &start, const std::vector<int64_t> &len, float *key_sum, float *value_sum
#define ARMKV_SUMS_CALL w, key_codes, int8_keys, key_scale, value_codes, value_scale, d, ld, ngk, ngv, W, start, len, key_sum, value_sum
ARMKV_DISPATCH(unit_sums, ARMKV_SUMS_ARGS, ARMKV_SUMS_CALL)

// slot_w [R, W] = the logits q.k * scaling + bias[s] of the slots of the runs of a pool (S
// slots; key codes channel-major, rows S apart, int4 or int8), read where they lie, run by
// run; peaks [R]: each head's largest
template <bool AVX>
__attribute__((always_inline)) inline void run_logits(const float* qm, const void* key_codes, bool int8_keys,
                                                    const Scales& key_scale, const float* bias, const uint8_t* value_codes,
                                                    float* slot_w, int64_t R, int64_t d, int64_t ld, int64_t W, int64_t ngk,
                                                    float scaling, const std::vector<int64_t>& start,
                                                    const std::vector<int64_t>& len, float* peaks) {
  thread_local std::vector<float> buf;
  const int64_t half = d / 2;
  std::fill(peaks, peaks + R, -std::numeric_limits<float>::infinity());
  for (size_t k = 0, at = 0; k < start.size(); at += len[k], ++k) {
    const int64_t s0 = start[k], n = len[k];
    const uint8_t* then = value_codes + s0 * half;  // (the run's values, read next)
    const float* ks = key_scale.rows(s0, n, buf);
    if (int8_keys)
      int8_key_scores(qm, static_cast<const int8_t*>(key_codes) + s0, ks, slot_w + at, R, d, n, then, half, ld, W);
    else
      key_scores(qm, static_cast<const uint8_t*>(key_codes) + s0, ks, slot_w + at, R, d, n, ngk, then, half, ld, W);
    for (int64_t r = 0; r < R; ++r) peaks[r] = std::max(peaks[r], affine_max<AVX>(slot_w + r * W + at, bias + s0, n, scaling));
  }
}

// Every line the runs' reads will touch (their key codes' rows, scales, value codes and bias)
// loaded once, one byte each, before the first is read: in a decode step each layer's slots
// come cold from memory, the runs lie apart, and each channel row of a run is a line of its
// own. Loads with nothing waiting on them keep many misses in flight at once, where the
// scoring loops, row by row, keep few. (Prefetch instructions for the same lines changed
// nothing measurable in the model; these loads cut the runs' scoring by a sixth, net.)
inline void load_runs(const DecodeGroup& a, bool int8_keys, int64_t d, const std::vector<int64_t>& start,
                      const std::vector<int64_t>& len) {
  const int64_t rows = int8_keys ? d : d / 2;
  const char* kc = static_cast<const char*>(a.key_codes);
  uint8_t sink = 0;
  auto span = [&sink](const void* p, int64_t bytes) {  // the lines of [p, p + bytes)
    const uintptr_t first = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63};
    for (uintptr_t line = first; bytes > 0 && line < reinterpret_cast<uintptr_t>(p) + bytes; line += 64)
      sink ^= *reinterpret_cast<const volatile uint8_t*>(std::max(line, reinterpret_cast<uintptr_t>(p)));
  };
  for (size_t k = 0; k < start.size(); ++k) {
    const int64_t s0 = start[k], n = len[k];
    for (int64_t c = 0; c < rows; ++c) span(kc + c * a.ld + s0, n);
    span(a.key_scale.row(s0), n * a.key_scale.row_bytes());
    span(a.value_codes + s0 * (d / 2), n * (d / 2));
    span(a.value_scale.row(s0), n * a.value_scale.row_bytes());
    span(a.bias + s0, n * 4);
  }
  asm volatile("" : : "r"(sink));
}

// One group's decode read of the slots of the runs of its pool (a: the pool's), read where
// they lie: no copy of their codes. qm, slot_w [R, W], exact_w, tmp: scratch. (A sparse read
// loads its runs' lines first, load_runs; the dense read's one run, the whole pool, is
// read in order, which the CPU's own prefetchers follow.)
template <bool AVX>
__attribute__((always_inline)) inline void runs_group_body(const DecodeGroup& a, const float* mix, const float* mix_t,
                                                         bool int8_keys, int64_t R, int64_t d, int64_t L, int64_t ngk,
                                                         int64_t ngv, float scaling,
                                                         const std::vector<int64_t>& start, const std::vector<int64_t>& len,
                                                         int64_t W, float* qm, float* slot_w, float* exact_w, float* tmp,
                                                         UnitEntries* units) {
  float peaks[kMaxRep];
  mix_query(a.q, mix, R, d, qm);
  if (units) units->qm = qm;
  run_logits<AVX>(qm, a.key_codes, int8_keys, a.key_scale, a.bias, a.value_codes, slot_w, R, d, a.ld, W, ngk, scaling, start, len,
                  peaks);
  decode_tail<AVX>(a, mix_t, R, d, L, W, scaling, slot_w, peaks, exact_w, tmp, [&](const float* w, float* out) {
    run_values(w, a.value_codes, a.value_scale, out, R, d, W, ngv, start, len);
  }, units);
}

#define ARMKV_RUNS_ARGS                                                                                             \
  const DecodeGroup &a, const float *mix, const float *mix_t, bool int8_keys, int64_t R, int64_t d, int64_t L,     \
      int64_t ngk, int64_t ngv, float scaling, const std::vector<int64_t> &start,                                    \
      const std::vector<int64_t> &len, int64_t W, float *qm, float *slot_w, float *exact_w, float *tmp,            \
      UnitEntries *units
#define ARMKV_RUNS_CALL a, mix, mix_t, int8_keys, R, d, L, ngk, ngv, scaling, start, len, W, qm, slot_w, exact_w, tmp, units
ARMKV_DISPATCH(runs_group, ARMKV_RUNS_ARGS, ARMKV_RUNS_CALL)

#endif

// Each unit's best logit from top [S] (each slot's largest logit over the heads), over its
// runs; -inf for a unit with none. Where `vectorised`, 8 at a time.
inline void unit_maxima(const float* top, const UnitRuns& u, float* best, bool vectorised) {
#ifdef ARMKV_AVX2
  const bool avx2 = vectorised && __builtin_cpu_supports("avx2");
#endif
  for (int64_t k = 0; k < u.nb; ++k) {
    float v = -std::numeric_limits<float>::infinity();
    u.each(k, [&](int64_t s0, int64_t n) {
#ifdef ARMKV_AVX2
      if (avx2) {
        v = std::max(v, max_avx2(top + s0, n));
        return;
      }
#endif
      for (int64_t p = s0; p < s0 + n; ++p) v = std::max(v, top[p]);
    });
    best[k] = v;
  }
}

// the m largest of best [nb] into idx (best first, ties to the lower id)
inline void top_buckets(const float* best, int64_t nb, int64_t m, std::vector<int64_t>& idx) {
  idx.resize(nb);
  for (int64_t k = 0; k < nb; ++k) idx[k] = k;
  std::partial_sort(idx.begin(), idx.begin() + m, idx.end(),
                    [&](int64_t a, int64_t c) { return best[a] > best[c] || (best[a] == best[c] && a < c); });
}

// Per-thread buffers of best_group and ranked_query
struct BestScratch {
  std::vector<float> qm, sw, top, best, cw, exact_w, tmp, uw;
  std::vector<int64_t> idx, run_start, run_len;
  std::vector<char> skip;
};

// U flags in buf: 1 for each unit but the first `count` of `chosen` (the ones a read takes)
inline const char* skipped(int64_t U, const int64_t* chosen, int64_t count, std::vector<char>& buf) {
  buf.assign(U, 1);
  for (int64_t j = 0; j < count; ++j)
    if (chosen[j] >= 0 && chosen[j] < U) buf[chosen[j]] = 0;
  return buf.data();
}

// One group of arm_best_decode_read: every slot scored once (the key codes read once), the
// logits q.k * scaling + bias; each bucket ranked by its best logit over the slots and the R
// heads; the first `take` of the m best buckets read: their slots' logits (kept, not scored
// again) copied run by run, then decode_tail, their values read where they lie. chosen [m]
// gets the m buckets.
template <bool AVX>
__attribute__((always_inline)) inline void best_group_body(const DecodeGroup& a, const float* mix, const float* mix_t,
                                                         bool int8_keys, int64_t R, int64_t d, int64_t L, int64_t S,
                                                         int64_t ngk, int64_t ngv, float scaling, const UnitRuns& u,
                                                         int64_t m, int64_t take, BestScratch& w, int64_t* chosen,
                                                         UnitEntries* units) {
  thread_local std::vector<float> kbuf;
  mix_query(a.q, mix, R, d, w.qm.data());
  float* sw = w.sw.data();
  const float* ks = a.key_scale.rows(0, S, kbuf);
  if (int8_keys)
    int8_key_scores(w.qm.data(), static_cast<const int8_t*>(a.key_codes), ks, sw, R, d, S, nullptr, 0, a.ld);
  else
    key_scores(w.qm.data(), static_cast<const uint8_t*>(a.key_codes), ks, sw, R, d, S, ngk, nullptr, 0, a.ld);
  for (int64_t r = 0; r < R; ++r) affine_max<AVX>(sw + r * S, a.bias, S, scaling);
  float* top = w.top.data();
  std::copy(sw, sw + S, top);
  for (int64_t r = 1; r < R; ++r)
    for (int64_t s = 0; s < S; ++s) top[s] = std::max(top[s], sw[r * S + s]);
  unit_maxima(top, u, w.best.data(), AVX);
  top_buckets(w.best.data(), u.nb, m, w.idx);
  std::copy(w.idx.begin(), w.idx.begin() + m, chosen);
  const int64_t W = chosen_runs(u, chosen, std::min(take, m), w.run_start, w.run_len);
  w.cw.resize(R * std::max<int64_t>(W, 1));
  for (size_t k = 0, at = 0; k < w.run_start.size(); at += w.run_len[k], ++k) {
    const int64_t s0 = w.run_start[k], n = w.run_len[k];
    for (int64_t r = 0; r < R; ++r) std::copy(sw + r * S + s0, sw + r * S + s0 + n, w.cw.data() + r * W + at);
  }
  if (units) units->qm = w.qm.data(), units->skip = skipped(units->U, chosen, std::min(take, m), w.skip);
  decode_tail<AVX>(a, mix_t, R, d, L, W, scaling, w.cw.data(), nullptr, w.exact_w.data(), w.tmp.data(),
                   [&](const float* wt, float* out) { run_values(wt, a.value_codes, a.value_scale, out, R, d, W, ngv, w.run_start, w.run_len); },
                   units);
}

// ---------------------------------------------------------------- a chunk's ranked read
// One query of ranked_slot_read: l [R, S] its logits of every slot (heads `hs` apart, q.k
// scaled, not biased), bias [S] (-inf: free), values [S, d] floats. Each unit ranked by its
// best biased logit over its slots and the R heads; the slots of the m best (ties to the
// lower id) read: per head, peak = their largest logit, den = sum exp(logit - peak), acc [d] =
// sum exp(logit - peak) * value (heads `as` apart; peak and den `ps` apart); -inf, 0, 0 where
// they hold no slot. With U > 0 (read_summaries) each unit it skips joins as one entry: ul [R, U]
// their logits (heads `uhs` apart: q.k * scaling + log weight, -inf for an empty unit), uv [U, d]
// their values.
template <bool AVX>
__attribute__((always_inline)) inline void ranked_query_body(const float* l, int64_t hs, const float* bias, const float* values,
                                                           int64_t S, int64_t R, int64_t d, const UnitRuns& u, int64_t m,
                                                           BestScratch& w, float* acc, int64_t as, float* peak, float* den,
                                                           int64_t ps, const float* ul, int64_t uhs, const float* uv, int64_t U) {
  float* top = w.top.data();
  for (int64_t s = 0; s < S; ++s) top[s] = l[s] + bias[s];
  for (int64_t r = 1; r < R; ++r)
    for (int64_t s = 0; s < S; ++s) top[s] = std::max(top[s], l[r * hs + s] + bias[s]);
  unit_maxima(top, u, w.best.data(), AVX);
  top_buckets(w.best.data(), u.nb, m, w.idx);
  const int64_t W = chosen_runs(u, w.idx.data(), m, w.run_start, w.run_len);
  w.cw.resize(R * std::max<int64_t>(W, 1));
  float* sw = w.cw.data();
  for (size_t k = 0, at = 0; k < w.run_start.size(); at += w.run_len[k], ++k) {
    const int64_t s0 = w.run_start[k], n = w.run_len[k];
    for (int64_t r = 0; r < R; ++r)
      for (int64_t j = 0; j < n; ++j) sw[r * W + at + j] = l[r * hs + s0 + j] + bias[s0 + j];
  }
  const float ninf = -std::numeric_limits<float>::infinity();
  const char* skip = U ? skipped(U, w.idx.data(), m, w.skip) : nullptr;
  w.uw.resize(std::max<int64_t>(U, 1));
  float* uw = w.uw.data();
  for (int64_t r = 0; r < R; ++r) {
    float* a = acc + r * as;
    std::fill(a, a + d, 0.0f);
    float p = max_of<AVX>(sw + r * W, W);
    for (int64_t u = 0; u < U; ++u) uw[u] = skip[u] ? ul[r * uhs + u] : ninf, p = std::max(p, uw[u]);
    peak[r * ps] = p;
    if ((W == 0 && U == 0) || p == ninf) {
      den[r * ps] = 0.0f;
      continue;
    }
#ifdef ARMKV_AVX2
    if constexpr (AVX) den[r * ps] = exp_shift_sum_avx2(sw + r * W, W, p) + (U ? exp_shift_sum_avx2(uw, U, p) : 0.0f);
    else
#endif
    den[r * ps] = exp_shift_sum_scalar(sw + r * W, W, p) + (U ? exp_shift_sum_scalar(uw, U, p) : 0.0f);
    for (int64_t u = 0; u < U; ++u) {  // (the units left out, one entry each)
      if (uw[u] == 0.0f) continue;
      const float* v = uv + u * d;
      for (int64_t c = 0; c < d; ++c) a[c] += uw[u] * v[c];
    }
    for (size_t k = 0, at = 0; k < w.run_start.size(); at += w.run_len[k], ++k) {
      const float* v = values + w.run_start[k] * d;
      const float* e = sw + r * W + at;
      for (int64_t j = 0; j < w.run_len[k]; ++j, v += d)
        for (int64_t c = 0; c < d; ++c) a[c] += e[j] * v[c];
    }
  }
}

#define ARMKV_RANKED_ARGS                                                                                            \
  const float *l, int64_t hs, const float *bias, const float *values, int64_t S, int64_t R, int64_t d,             \
      const UnitRuns &u, int64_t m, BestScratch &w, float *acc, int64_t as, float *peak, float *den, int64_t ps,     \
      const float *ul, int64_t uhs, const float *uv, int64_t U
#define ARMKV_RANKED_CALL l, hs, bias, values, S, R, d, u, m, w, acc, as, peak, den, ps, ul, uhs, uv, U
ARMKV_DISPATCH(ranked_query, ARMKV_RANKED_ARGS, ARMKV_RANKED_CALL)

// ---------------------------------------------------------------- read_rank="partial"
// The key-code rows a query ranks by (read.partial_rows): row c holds channels c and c + d/2
// (one byte a slot of int4 codes, two rows of int8 ones); the n rows with the largest
// sum over the R heads of q_c^2 + q_{c+d/2}^2, ties to the lower row, in increasing order
inline void partial_rows(const float* qm, int64_t R, int64_t d, int64_t n, std::vector<float>& energy,
                         std::vector<int64_t>& rows) {
  const int64_t half = d / 2;
  energy.assign(d, 0.0f);  // each channel's sum over the heads, then a row's two channels
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < d; ++c) energy[c] += qm[r * d + c] * qm[r * d + c];
  for (int64_t c = 0; c < half; ++c) energy[c] += energy[c + half];
  rows.resize(half);
  for (int64_t c = 0; c < half; ++c) rows[c] = c;
  std::partial_sort(rows.begin(), rows.begin() + n, rows.end(), [&](int64_t a, int64_t b) {
    return energy[a] > energy[b] || (energy[a] == energy[b] && a < b);
  });
  rows.resize(n);
  std::sort(rows.begin(), rows.end());  // (the rows are then read in memory order)
}

// The query a partial ranking multiplies the codes by: each head's 2n chosen channels (c and
// c + d/2 of each row c of rows [n]) rounded to int8 at its own scale, qs[r] = max |q| / 127
// (1 where all are 0): qi [R, 2n] (the n low channels, then the n high ones) = round(q / qs).
// The sums of qi x codes are then integers, exact in any order and in float32, so the vector
// loops below (int16 or float lanes) and MemoryState.partial_key_scores sum the same values.
inline void partial_query(const float* qm, int64_t R, int64_t d, const int64_t* rows, int64_t n, int8_t* qi, float* qs) {
  const int64_t half = d / 2;
  for (int64_t r = 0; r < R; ++r) {
    const float* q = qm + r * d;
    float peak = 0.0f;
    for (int64_t j = 0; j < n; ++j) peak = std::max(peak, std::max(std::fabs(q[rows[j]]), std::fabs(q[rows[j] + half])));
    const float scale = peak > 0.0f ? peak / 127.0f : 1.0f;
    qs[r] = scale;
    for (int64_t j = 0; j < n; ++j) {
      qi[r * 2 * n + j] = static_cast<int8_t>(std::clamp(std::nearbyint(q[rows[j]] / scale), -127.0f, 127.0f));
      qi[r * 2 * n + n + j] = static_cast<int8_t>(std::clamp(std::nearbyint(q[rows[j] + half] / scale), -127.0f, 127.0f));
    }
  }
}

// top [S]: each slot's partial logit, the largest over the R heads of
//   (sum over its scale groups g of scale[s, g] x the integer sum of qi x codes over the
//    chosen channels of g) x f[r] + bias[s],   f[r] = qs[r] x scaling,
// from slot `first` on (int4 codes [d/2, S], scales [S, ng]; int8 codes [d, S], one scale a
// slot): what read_rank="partial" ranks buckets by. glo, ghi [n]: the scale group of each
// row's two channels, c and c + d/2
inline void partial_top_scalar(const int8_t* qi, const float* f, const void* codes_, bool int8_keys, const Scales& scale,
                               const float* bias, float* top, int64_t R, int64_t d, int64_t S, int64_t ld, int64_t ng,
                               const int64_t* rows, const int64_t* glo, const int64_t* ghi, int64_t n, int64_t first = 0) {
  const int64_t half = d / 2, groups = int8_keys ? 1 : ng;
  std::vector<int32_t> part(groups);
  for (int64_t s = first; s < S; ++s) {
    float peak = -std::numeric_limits<float>::infinity();
    for (int64_t r = 0; r < R; ++r) {
      const int8_t* q = qi + r * 2 * n;
      std::fill(part.begin(), part.end(), 0);
      for (int64_t j = 0; j < n; ++j) {
        const int64_t c = rows[j];
        int32_t lo, hi;
        if (int8_keys) {
          const auto* codes = static_cast<const int8_t*>(codes_);
          lo = codes[c * ld + s], hi = codes[(c + half) * ld + s];
        } else {
          const uint8_t b = static_cast<const uint8_t*>(codes_)[c * ld + s];
          lo = static_cast<int32_t>(low_nibble(b)), hi = static_cast<int32_t>(high_nibble(b));
        }
        part[int8_keys ? 0 : glo[j]] += q[j] * lo;
        part[int8_keys ? 0 : ghi[j]] += q[n + j] * hi;
      }
      float total = 0.0f;
      for (int64_t g = 0; g < groups; ++g) total += static_cast<float>(part[g]) * scale.at(s * groups + g);
      peak = std::max(peak, total * f[r] + bias[s]);
    }
    top[s] = peak;
  }
}

#ifdef ARMKV_AVX2
constexpr int kMaxGroups = 16;  // scale groups of a key the vector loops hold (d / 32 at d = 512)

// the scales of slots [s0, s0 + 8) of each of the ng groups (scale [S, ng], float32 or
// bfloat16 as stored): one load for one group, two loads and a de-interleave for two, one
// slot at a time beyond
__attribute__((target("avx2"))) inline __m256 scales8(const Scales& scale, int64_t i) {  // 8 from flat index i
  return scale.f32 ? _mm256_loadu_ps(scale.f32 + i) : bf16x8(scale.bf16 + i);
}

__attribute__((target("avx2,fma"))) inline void block_scales(const Scales& scale, int64_t s0, int64_t ng, __m256* sg) {
  if (ng == 1) {
    sg[0] = scales8(scale, s0);
  } else if (ng == 2) {
    const __m256 a = scales8(scale, 2 * s0), b = scales8(scale, 2 * s0 + 8);
    sg[0] = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0))), 0xD8));
    sg[1] = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1))), 0xD8));
  } else {
    alignas(32) float part[8];
    for (int64_t g = 0; g < ng; ++g) {
      for (int64_t k = 0; k < 8; ++k) part[k] = scale.at((s0 + k) * ng + g);
      sg[g] = _mm256_load_ps(part);
    }
  }
}

// the largest over the R heads of res[r] x f[r] + bias, for 8 slots (a product, then a sum: as
// the scalar loop rounds)
template <int RR>
__attribute__((target("avx2,fma"), always_inline)) inline __m256 head_peak(const __m256* res, const float* f, const float* bias,
                                                                           int64_t R) {
  const __m256 b = _mm256_loadu_ps(bias);
  __m256 peak = _mm256_add_ps(_mm256_mul_ps(res[0], _mm256_set1_ps(f[0])), b);
  for (int64_t r = 1; r < R; ++r) peak = _mm256_max_ps(peak, _mm256_add_ps(_mm256_mul_ps(res[r], _mm256_set1_ps(f[r])), b));
  return peak;
}

// int8 codes in float lanes (their products with the query's int8 codes would overflow int16
// lanes), 8 slots a block: each row's two channels' products (integers, exact) summed, then
// times the slot's one scale
template <int RR>
__attribute__((target("avx2,fma"))) void partial_top_int8_avx2_r(const int8_t* qi, const float* f, const int8_t* codes,
                                                                const Scales& scale, const float* bias, float* top,
                                                                int64_t R_, int64_t d, int64_t S, int64_t ld, const int64_t* rows,
                                                                const int64_t* glo, const int64_t* ghi, int64_t n) {
  const int64_t R = heads<RR>(R_), half = d / 2, full = S / 8 * 8;
  std::vector<float> qf(R * 2 * n);  // the rounded query as floats
  for (int64_t i = 0; i < R * 2 * n; ++i) qf[i] = static_cast<float>(qi[i]);
  for (int64_t s0 = 0; s0 < full; s0 += 8) {
    // the chosen rows' lines kPrefetchAhead bytes ahead, once per line (as key_scores_avx2_r)
    if (s0 % 64 == 0 && s0 + kPrefetchAhead < S)
      for (int64_t j = 0; j < n; ++j) {
        _mm_prefetch(reinterpret_cast<const char*>(codes + rows[j] * ld + s0 + kPrefetchAhead), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(codes + (rows[j] + half) * ld + s0 + kPrefetchAhead), _MM_HINT_T0);
      }
    __m256 sums[kAcc<RR>], res[kAcc<RR>];
    for (int64_t r = 0; r < R; ++r) sums[r] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const int64_t c = rows[j];
      const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + c * ld + s0))));
      const __m256 hi =
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + (c + half) * ld + s0))));
      for (int64_t r = 0; r < R; ++r)
        sums[r] = _mm256_fmadd_ps(_mm256_set1_ps(qf[r * 2 * n + j]), lo,
                                  _mm256_fmadd_ps(_mm256_set1_ps(qf[r * 2 * n + n + j]), hi, sums[r]));
    }
    const __m256 sg = scales8(scale, s0);
    for (int64_t r = 0; r < R; ++r) res[r] = _mm256_mul_ps(sums[r], sg);
    _mm256_storeu_ps(top + s0, head_peak<RR>(res, f, bias + s0, R));
  }
  partial_top_scalar(qi, f, codes, true, scale, bias, top, R, d, S, ld, 1, rows, glo, ghi, n, full);  // the last S % 8
}

// The rows of a partial ranking of int4 codes in pairs, for partial_top_int4_avx2_r: pairs
// [P] of rows (c, c2) within a run of rows sharing their two scale groups (the last row of an
// odd run paired with itself, its partner's query code 0); each pair's query codes per head as
// 32-bit words of bytes (q_c, q_c2, q_c, q_c2) for the low channels and for the high ones
// (words [P, 2, R]); chunks of at most 8 pairs of one run, with their groups and the 8 x the
// sum of their query codes per head that the unsigned codes add (corr [chunks, 2, R])
struct RowPairs {
  std::vector<int64_t> row, row2;
  std::vector<uint32_t> words;
  std::vector<int64_t> chunk_start, chunk_pairs, chunk_lo, chunk_hi;
  std::vector<int32_t> corr;

  void build(const int8_t* qi, int64_t R, int64_t n, const int64_t* rows, const int64_t* glo, const int64_t* ghi) {
    row.clear(), row2.clear(), words.clear(), chunk_start.clear(), chunk_pairs.clear(), chunk_lo.clear(), chunk_hi.clear();
    corr.clear();
    const auto word = [](int8_t a, int8_t b) {
      const uint32_t pair = static_cast<uint8_t>(a) | (static_cast<uint32_t>(static_cast<uint8_t>(b)) << 8);
      return pair | (pair << 16);
    };
    for (int64_t j = 0; j < n;) {
      const int64_t gl = glo[j], gh = ghi[j];
      int64_t end = j;
      while (end < n && glo[end] == gl && ghi[end] == gh) ++end;
      for (; j < end;) {  // this run's pairs, 8 a chunk
        chunk_start.push_back(static_cast<int64_t>(row.size())), chunk_lo.push_back(gl), chunk_hi.push_back(gh);
        const size_t corr_at = corr.size();
        corr.resize(corr_at + 2 * R, 0);
        int64_t pairs = 0;
        for (; j < end && pairs < 8; j = std::min(j + 2, end), ++pairs) {
          const bool alone = j + 1 >= end;
          row.push_back(rows[j]), row2.push_back(rows[alone ? j : j + 1]);
          for (int64_t h = 0; h < 2; ++h)
            for (int64_t r = 0; r < R; ++r) {
              const int8_t a = qi[r * 2 * n + h * n + j], b = alone ? 0 : qi[r * 2 * n + h * n + j + 1];
              words.push_back(word(a, b));
              corr[corr_at + h * R + r] += 8 * (a + b);
            }
        }
        chunk_pairs.push_back(pairs);
      }
    }
  }
};

// int16 lanes [16] -> floats of the first (high = false) or last 8
__attribute__((target("avx2"))) inline __m256 widen(__m256i x, bool high) {
  const __m128i part = high ? _mm256_extracti128_si256(x, 1) : _mm256_castsi256_si128(x);
  return _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(part));
}

// int4 codes in int16 lanes, 16 slots a block: a pair of rows' bytes interleaved (one unpack
// each way), made unsigned (+8 a nibble) and split into their low and high nibbles, meet the
// pair's query codes in one maddubs each (both rows' products summed for 16 slots; |a pair's
// sum| <= 2 x 127 x 15, so a chunk of 8 pairs fits an int16 lane); each chunk's sums, less the
// +8's (in int16: the true sum fits, and int16 adds wrap), then floats times its scales. The
// same integer sums as the float loops: a third of their instructions a row.
template <int RR>
__attribute__((target("avx2,fma"))) void partial_top_int4_avx2_r(const RowPairs& p, const int8_t* qi, const float* f,
                                                                const uint8_t* codes, const Scales& scale, const float* bias,
                                                                float* top, int64_t R_, int64_t d, int64_t S, int64_t ld,
                                                                int64_t ng, const int64_t* rows, const int64_t* glo,
                                                                const int64_t* ghi, int64_t n) {
  const int64_t R = heads<RR>(R_), full = S / 16 * 16, P = static_cast<int64_t>(p.row.size());
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x88)), low = _mm256_set1_epi8(0x0F);
  for (int64_t s0 = 0; s0 < full; s0 += 16) {
    if (s0 % 64 == 0 && s0 + kPrefetchAhead < S)
      for (int64_t k = 0; k < P; ++k) {
        _mm_prefetch(reinterpret_cast<const char*>(codes + p.row[k] * ld + s0 + kPrefetchAhead), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(codes + p.row2[k] * ld + s0 + kPrefetchAhead), _MM_HINT_T0);
      }
    __m256 res0[kAcc<RR>], res1[kAcc<RR>], sg0[kMaxGroups], sg1[kMaxGroups];
    for (int64_t r = 0; r < R; ++r) res0[r] = res1[r] = _mm256_setzero_ps();
    block_scales(scale, s0, ng, sg0);
    block_scales(scale, s0 + 8, ng, sg1);
    for (size_t ch = 0; ch < p.chunk_start.size(); ++ch) {
      __m256i alo[kAcc<RR>], ahi[kAcc<RR>];
      for (int64_t r = 0; r < R; ++r) alo[r] = ahi[r] = _mm256_setzero_si256();
      const int64_t k0 = p.chunk_start[ch], k1 = k0 + p.chunk_pairs[ch];
      for (int64_t k = k0; k < k1; ++k) {
        const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + p.row[k] * ld + s0));
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + p.row2[k] * ld + s0));
        // 16-bit lanes (a_s, b_s), slots in order; +8 on every nibble
        const __m256i x = _mm256_xor_si256(_mm256_set_m128i(_mm_unpackhi_epi8(a, b), _mm_unpacklo_epi8(a, b)), flip);
        const __m256i lo = _mm256_and_si256(x, low), hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), low);
        const uint32_t* w = p.words.data() + k * 2 * R;
        for (int64_t r = 0; r < R; ++r) {
          alo[r] = _mm256_add_epi16(alo[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(static_cast<int>(w[r]))));
          ahi[r] = _mm256_add_epi16(ahi[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(static_cast<int>(w[R + r]))));
        }
      }
      const int64_t gl = p.chunk_lo[ch], gh = p.chunk_hi[ch];
      const int32_t* corr = p.corr.data() + ch * 2 * R;
      for (int64_t r = 0; r < R; ++r) {
        const __m256i l = _mm256_sub_epi16(alo[r], _mm256_set1_epi16(static_cast<int16_t>(corr[r])));
        const __m256i h = _mm256_sub_epi16(ahi[r], _mm256_set1_epi16(static_cast<int16_t>(corr[R + r])));
        res0[r] = _mm256_fmadd_ps(widen(l, false), sg0[gl], _mm256_fmadd_ps(widen(h, false), sg0[gh], res0[r]));
        res1[r] = _mm256_fmadd_ps(widen(l, true), sg1[gl], _mm256_fmadd_ps(widen(h, true), sg1[gh], res1[r]));
      }
    }
    _mm256_storeu_ps(top + s0, head_peak<RR>(res0, f, bias + s0, R));
    _mm256_storeu_ps(top + s0 + 8, head_peak<RR>(res1, f, bias + s0 + 8, R));
  }
  partial_top_scalar(qi, f, codes, false, scale, bias, top, R, d, S, ld, ng, rows, glo, ghi, n, full);  // the last S % 16
}
#endif

// Per-thread buffers of partial_top
struct PartialScratch {
  std::vector<int8_t> qi;
  std::vector<float> qs, f;
  std::vector<int64_t> groups;
  RowPairs pairs;
};

// top [S] (partial_top_scalar) for the query qm [R, d] in the slots' basis and its n rows (codes' rows ld apart)
inline void partial_top(const float* qm, const void* codes, bool int8_keys, const Scales& scale, const float* bias,
                        float scaling, float* top, int64_t R, int64_t d, int64_t S, int64_t ld, int64_t ng, const int64_t* rows,
                        int64_t n, PartialScratch& w, bool vectorised) {
  const int64_t gs = int8_keys ? d : d / ng, half = d / 2;
  w.groups.resize(2 * n), w.qi.resize(R * 2 * n), w.qs.resize(R), w.f.resize(R);
  for (int64_t j = 0; j < n; ++j) w.groups[j] = rows[j] / gs, w.groups[n + j] = (rows[j] + half) / gs;
  const int64_t *glo = w.groups.data(), *ghi = w.groups.data() + n;
  partial_query(qm, R, d, rows, n, w.qi.data(), w.qs.data());
  for (int64_t r = 0; r < R; ++r) w.f[r] = w.qs[r] * scaling;
#ifdef ARMKV_AVX2
  if (vectorised && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && R <= kMaxRep &&
      (int8_keys || ng <= kMaxGroups)) {
    if (int8_keys)
      ARMKV_BY_HEADS(partial_top_int8_avx2_r, R, w.qi.data(), w.f.data(), static_cast<const int8_t*>(codes), scale, bias, top, R,
                     d, S, ld, rows, glo, ghi, n)
    w.pairs.build(w.qi.data(), R, n, rows, glo, ghi);
    ARMKV_BY_HEADS(partial_top_int4_avx2_r, R, w.pairs, w.qi.data(), w.f.data(), static_cast<const uint8_t*>(codes), scale,
                   bias, top, R, d, S, ld, ng, rows, glo, ghi, n)
  }
#endif
  partial_top_scalar(w.qi.data(), w.f.data(), codes, int8_keys, scale, bias, top, R, d, S, ld, ng, rows, glo, ghi, n);
}

#define ARMKV_BEST_ARGS                                                                                             \
  const DecodeGroup &a, const float *mix, const float *mix_t, bool int8_keys, int64_t R, int64_t d, int64_t L,     \
      int64_t S, int64_t ngk, int64_t ngv, float scaling, const UnitRuns &u, int64_t m, int64_t take, BestScratch &w, \
      int64_t *chosen, UnitEntries *units
#define ARMKV_BEST_CALL a, mix, mix_t, int8_keys, R, d, L, S, ngk, ngv, scaling, u, m, take, w, chosen, units
ARMKV_DISPATCH(best_group, ARMKV_BEST_ARGS, ARMKV_BEST_CALL)

}  // namespace armkv

// ---------------------------------------------------------------- PyTorch bindings
// batched over groups (batch x KV heads), in parallel over them

namespace {

void check(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale) {
  TORCH_CHECK(x.device().is_cpu() && codes.device().is_cpu() && scale.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "float32 queries and weights only");
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8, "uint8 int4 codes only");
  TORCH_CHECK(x.dim() == 3 && codes.dim() == 3 && scale.dim() == 3, "3-d tensors expected");
}

}  // namespace

// query [G, R, d] float32, codes [G, d/2, S] uint8 (channel-major), scale [G, S, ng] -> [G, R, S]
torch::Tensor int4_key_scores(torch::Tensor query, torch::Tensor codes, torch::Tensor scale) {
  check(query, codes, scale);
  auto q = query.contiguous();
  auto k = codes.contiguous();
  auto sc = scale.to(torch::kFloat32).contiguous();
  const int64_t G = q.size(0), R = q.size(1), d = q.size(2), S = k.size(2), ng = sc.size(2);
  TORCH_CHECK(d % 2 == 0 && ng > 0 && d % ng == 0 && k.size(0) == G && k.size(1) == d / 2 && sc.size(0) == G &&
                  sc.size(1) == S,
              "shapes do not match: query [G, R, d], codes [G, d/2, S], scale [G, S, ng]");
  auto out = torch::empty({G, R, S}, q.options());
  const float* Q = q.data_ptr<float>();
  const uint8_t* K = k.data_ptr<uint8_t>();
  const float* SC = sc.data_ptr<float>();
  float* O = out.data_ptr<float>();
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) armkv::key_scores(Q + g * R * d, K + g * (d / 2) * S, SC + g * S * ng, O + g * R * S, R, d, S, ng);
  });
  return out;
}

// query [G, R, d] float32, codes [G, d, S] int8 (channel-major), scale [G, S, 1] -> [G, R, S]
torch::Tensor int8_key_scores(torch::Tensor query, torch::Tensor codes, torch::Tensor scale) {
  TORCH_CHECK(query.device().is_cpu() && codes.device().is_cpu() && scale.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(query.scalar_type() == torch::kFloat32, "float32 queries only");
  TORCH_CHECK(codes.scalar_type() == torch::kInt8, "int8 codes only");
  TORCH_CHECK(query.dim() == 3 && codes.dim() == 3 && scale.dim() == 3, "3-d tensors expected");
  auto q = query.contiguous();
  auto k = codes.contiguous();
  auto sc = scale.to(torch::kFloat32).contiguous();
  const int64_t G = q.size(0), R = q.size(1), d = q.size(2), S = k.size(2);
  TORCH_CHECK(k.size(0) == G && k.size(1) == d && sc.size(0) == G && sc.size(1) == S && sc.size(2) == 1,
              "shapes do not match: query [G, R, d], codes [G, d, S], scale [G, S, 1]");
  auto out = torch::empty({G, R, S}, q.options());
  const float* Q = q.data_ptr<float>();
  const int8_t* K = k.data_ptr<int8_t>();
  const float* SC = sc.data_ptr<float>();
  float* O = out.data_ptr<float>();
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) armkv::int8_key_scores(Q + g * R * d, K + g * d * S, SC + g * S, O + g * R * S, R, d, S);
  });
  return out;
}

// weights [G, R, S] float32, codes [G, S, d/2] uint8, scale [G, S, ng] -> [G, R, d]
torch::Tensor int4_weighted_values(torch::Tensor weights, torch::Tensor codes, torch::Tensor scale) {
  check(weights, codes, scale);
  auto w = weights.contiguous();
  auto v = codes.contiguous();
  auto sc = scale.to(torch::kFloat32).contiguous();
  const int64_t G = w.size(0), R = w.size(1), S = w.size(2), d = 2 * v.size(2), ng = sc.size(2);
  TORCH_CHECK(ng > 0 && d % ng == 0 && v.size(0) == G && v.size(1) == S && sc.size(0) == G && sc.size(1) == S,
              "shapes do not match: weights [G, R, S], codes [G, S, d/2], scale [G, S, ng]");
  auto out = torch::empty({G, R, d}, w.options());
  const float* W = w.data_ptr<float>();
  const uint8_t* V = v.data_ptr<uint8_t>();
  const float* SC = sc.data_ptr<float>();
  float* O = out.data_ptr<float>();
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) armkv::weighted_values(W + g * R * S, V + g * S * (d / 2), SC + g * S * ng, O + g * R * d, R, d, S, ng);
  });
  return out;
}

bool int4_vectorised(int64_t rep, int64_t head_dim, int64_t groups) { return armkv::use_avx2(rep, head_dim, groups); }

// key, value [G, S, d] float32 (value empty for "key"), order [G, S] int64 (bucket order),
// bucket [G, S] int64 (-1: free), width -> (nn_sim [G, S] float32, nn_idx [G, S] int64)
std::vector<torch::Tensor> band_neighbours(torch::Tensor key, torch::Tensor order, torch::Tensor bucket, int64_t width) {
  TORCH_CHECK(key.device().is_cpu() && key.scalar_type() == torch::kFloat32 && key.dim() == 3, "float32 CPU keys [G, S, d]");
  auto k = key.contiguous();
  auto o = order.to(torch::kInt64).contiguous();
  auto b = bucket.to(torch::kInt64).contiguous();
  const int64_t G = k.size(0), S = k.size(1), d = k.size(2);
  TORCH_CHECK(o.size(0) == G && o.size(1) == S && b.size(0) == G && b.size(1) == S, "order and bucket must be [G, S]");
  auto sim = torch::empty({G, S}, k.options());
  auto idx = torch::empty({G, S}, o.options());
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      armkv::band_neighbours_group(k.data_ptr<float>() + g * S * d, o.data_ptr<int64_t>() + g * S, b.data_ptr<int64_t>() + g * S, S, d, width,
                                   sim.data_ptr<float>() + g * S, idx.data_ptr<int64_t>() + g * S);
  });
  return {sim, idx};
}

namespace {

// Slots' codes to float keys and values [G, S, d] (write.unpack's loops): key codes uint8
// [G, d/2, S] (int4) or int8 [G, d, S], both channel-major, key scale [G, S, ngk], value
// codes uint8 [G, S, d/2], value scale [G, S, ngv]; cos and sin [G, S, d/2] un-rotate the
// keys (undefined: left as stored); mixed: multiply the vectors back by Q^T
std::vector<torch::Tensor> unpack_codes(const torch::Tensor& key_codes, const torch::Tensor& key_scale,
                                        const torch::Tensor& value_codes, const torch::Tensor& value_scale,
                                        const torch::Tensor& cos, const torch::Tensor& sin, bool mixed, double scaling) {
  auto kc = key_codes.contiguous();
  auto vc = value_codes.contiguous();
  auto ks = key_scale.to(torch::kFloat32).contiguous();
  auto vs = value_scale.to(torch::kFloat32).contiguous();
  TORCH_CHECK(kc.device().is_cpu() && vc.device().is_cpu(), "CPU codes only");
  const bool int8_keys = kc.scalar_type() == torch::kInt8;
  TORCH_CHECK((int8_keys || kc.scalar_type() == torch::kUInt8) && vc.scalar_type() == torch::kUInt8,
              "int4 (uint8) or int8 key codes and int4 value codes only");
  TORCH_CHECK(kc.dim() == 3 && vc.dim() == 3 && ks.dim() == 3 && vs.dim() == 3, "3-d tensors expected");
  const int64_t G = kc.size(0), S = kc.size(2), half = vc.size(2), d = 2 * half, rows = kc.size(1);
  const int64_t ngk = ks.size(2), ngv = vs.size(2);
  TORCH_CHECK(rows == (int8_keys ? d : half) && vc.size(0) == G && vc.size(1) == S && ks.size(0) == G && ks.size(1) == S &&
                  vs.size(0) == G && vs.size(1) == S && ngk > 0 && ngv > 0 && d % ngk == 0 && d % ngv == 0,
              "shapes do not match: key codes [G, d/2 or d, S], value codes [G, S, d/2], scales [G, S, n]");
  TORCH_CHECK(!mixed || (d & (d - 1)) == 0, "mixed slots need a power-of-two head dim (the Hadamard mixing)");
  torch::Tensor cs, sn;
  if (cos.defined()) {
    cs = cos.to(torch::kFloat32).contiguous();
    sn = sin.to(torch::kFloat32).contiguous();
    TORCH_CHECK(cs.dim() == 3 && cs.size(0) == G && cs.size(1) == S && cs.size(2) == half && sn.sizes() == cs.sizes(),
                "cos and sin must be [G, S, d/2]");
  }
  auto key = torch::empty({G, S, d}, ks.options());
  auto value = torch::empty({G, S, d}, ks.options());
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      armkv::unpack_slots(static_cast<const uint8_t*>(kc.data_ptr()) + g * rows * S, ks.data_ptr<float>() + g * S * ngk,
                          vc.data_ptr<uint8_t>() + g * S * half, vs.data_ptr<float>() + g * S * ngv,
                          cs.defined() ? cs.data_ptr<float>() + g * S * half : nullptr,
                          sn.defined() ? sn.data_ptr<float>() + g * S * half : nullptr, S, d, ngk, ngv, mixed,
                          static_cast<float>(1.0 / scaling), key.data_ptr<float>() + g * S * d,
                          value.data_ptr<float>() + g * S * d, int8_keys);
  });
  return {key, value};
}

}  // namespace

// int4 or int8 key codes, int4 value codes (see unpack_codes), cos and sin [G, S, d/2] ->
// (pre-RoPE keys, values) [G, S, d] float32, unmixed
std::vector<torch::Tensor> int4_unpack_pre_rope(torch::Tensor key_codes, torch::Tensor key_scale, torch::Tensor value_codes,
                                                torch::Tensor value_scale, torch::Tensor cos, torch::Tensor sin, bool mixed,
                                                double scaling) {
  return unpack_codes(key_codes, key_scale, value_codes, value_scale, cos, sin, mixed, scaling);
}

// k4v4 or k8v4 slots to float keys and values as stored (MemoryState.kv); unmix: multiply
// mixed vectors back by Q^T -> (keys, values) [G, S, d] float32
std::vector<torch::Tensor> int4_dequantise(torch::Tensor key_codes, torch::Tensor key_scale, torch::Tensor value_codes,
                                           torch::Tensor value_scale, bool unmix) {
  return unpack_codes(key_codes, key_scale, value_codes, value_scale, torch::Tensor(), torch::Tensor(), unmix, 1.0);
}

// The per-token inputs of a layer's decode read: the query, the new token and the exact
// entries, in the model's layout (query [B, Hq, 1, d], own_k and own_v [B, H, 1, d], own_ok
// [B, T], exact_k and exact_v [B, H, L, d], exact_ok [B, L]) or flat by group (query [G, R, d],
// own_k and own_v [G, d], own_ok [G], exact_k and exact_v [G, L, d], exact_ok [G, L]); group
// g = b H + h. Read where they lie, with no tensor op, where each group's rows are contiguous
// (as the model's are); the others are copied.
struct Tokens {
  torch::Tensor q, kk, vv, ok, ek, ev, eok;  // (the inputs, or their contiguous copies)
  bool model = false;                         // the model's layout: the output in it too
  int64_t B = 0, H = 1, R = 0, L = 0;
  const float *Q = nullptr, *K = nullptr, *V = nullptr, *EK = nullptr, *EV = nullptr;
  const bool *OK = nullptr, *EOK = nullptr;
  int64_t qb = 0, qh = 0, kb = 0, kh = 0, vb = 0, vh = 0, okb = 0, eb = 0, eh = 0, evb = 0, evh = 0, eokb = 0;

  Tokens(const torch::Tensor& query, const torch::Tensor& own_k, const torch::Tensor& own_v, const torch::Tensor& own_ok,
         const torch::Tensor& exact_k, const torch::Tensor& exact_v, const torch::Tensor& exact_ok, int64_t G, int64_t d,
         const char* name)
      : q(query), kk(own_k), vv(own_v), ok(own_ok), ek(exact_k), ev(exact_v), eok(exact_ok), model(query.dim() == 4) {
    const int64_t x = model ? 1 : 0;  // (the model's layout has a head dimension more before the exact entries)
    if (model) {
      TORCH_CHECK(q.size(2) == 1 && kk.dim() == 4 && vv.dim() == 4 && ek.dim() == 4 && ev.dim() == 4 && ok.dim() == 2 &&
                      eok.dim() == 2 && kk.size(1) > 0 && q.size(1) % kk.size(1) == 0 && ok.size(1) >= 1,
                  name, ": query [B, Hq, 1, d], the token's key and value [B, H, 1, d], its valid [B, T], exact [B, H, L, d], "
                  "exact valid [B, L]");
      B = q.size(0), H = kk.size(1), R = q.size(1) / H, L = ek.size(2);
      TORCH_CHECK(kk.size(0) == B && kk.size(2) == 1 && vv.sizes() == kk.sizes() && ok.size(0) == B && ek.size(0) == B &&
                      ek.size(1) == H && ev.sizes() == ek.sizes() && eok.size(0) == B && eok.size(1) == L,
                  name, ": the token's inputs do not match (see the comment above arm_decode_read)");
    } else {
      TORCH_CHECK(q.dim() == 3 && kk.dim() == 2 && vv.dim() == 2 && ok.dim() == 1 && ek.dim() == 3 && ev.dim() == 3 &&
                      eok.dim() == 2,
                  name, ": query [G, R, d], own_k and own_v [G, d], own_ok [G], exact [G, L, d], exact valid [G, L]");
      B = q.size(0), R = q.size(1), L = ek.size(1);
      TORCH_CHECK(kk.size(0) == B && vv.sizes() == kk.sizes() && ok.size(0) == B && ek.size(0) == B && ev.sizes() == ek.sizes() &&
                      eok.size(0) == B && eok.size(1) == L,
                  name, ": the token's inputs do not match (see the comment above arm_decode_read)");
    }
    TORCH_CHECK(q.scalar_type() == torch::kFloat32 && kk.scalar_type() == torch::kFloat32 && vv.scalar_type() == torch::kFloat32 &&
                    ek.scalar_type() == torch::kFloat32 && ev.scalar_type() == torch::kFloat32,
                name, ": float32 queries, keys and values only");
    TORCH_CHECK(B * H == G && q.size(-1) == d && kk.size(-1) == d && ek.size(-1) == d, name,
                ": shapes do not match (see the comment above arm_decode_read)");
    TORCH_CHECK(R <= armkv::kMaxRep, name, ": at most 16 query heads a KV head");
    // a group's rows contiguous (its R query heads, its L exact entries), else a copy
    const auto rows = [](torch::Tensor& t, int64_t row_dim, int64_t n) {
      if (t.stride(-1) != 1 || (n > 1 && t.stride(row_dim) != t.size(-1))) t = t.contiguous();
    };
    rows(q, 1, R), rows(kk, -1, 1), rows(vv, -1, 1), rows(ek, 1 + x, L), rows(ev, 1 + x, L);
    if (ok.scalar_type() != torch::kBool) ok = ok.to(torch::kBool);
    if (eok.scalar_type() != torch::kBool) eok = eok.to(torch::kBool);
    if (L > 1 && eok.stride(1) != 1) eok = eok.contiguous();
    Q = q.data_ptr<float>(), K = kk.data_ptr<float>(), V = vv.data_ptr<float>(), EK = ek.data_ptr<float>(),
    EV = ev.data_ptr<float>(), OK = ok.data_ptr<bool>(), EOK = eok.data_ptr<bool>();
    qb = q.stride(0), qh = model ? R * q.stride(1) : 0, kb = kk.stride(0), kh = model ? kk.stride(1) : 0;
    vb = vv.stride(0), vh = model ? vv.stride(1) : 0, okb = ok.stride(0), eb = ek.stride(0), eh = model ? ek.stride(1) : 0;
    evb = ev.stride(0), evh = model ? ev.stride(1) : 0, eokb = eok.stride(0);
  }

  // the read's output: [G, R, d], or in the model's layout [B, 1, Hq, d] (the same memory)
  torch::Tensor empty_out(int64_t d) const {
    const auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
    return model ? torch::empty({B, 1, H * R, d}, f32) : torch::empty({B, R, d}, f32);
  }
};

// The slots' inputs of a layer's decode read, checked and converted once: a decode step's
// bound call (DecodeCall) keeps them from one write to the next.
struct DecodeInputs {
  torch::Tensor kc, ks, vc, vs, b, mx, mxt;
  bool int8_keys;
  int64_t G, d, S, ngk, ngv;
  const float* MX;
  const float* MXT;

  DecodeInputs(const torch::Tensor& key_codes, const torch::Tensor& key_scale, const torch::Tensor& value_codes,
               const torch::Tensor& value_scale, const torch::Tensor& bias, const torch::Tensor& mix, const char* name) {
    TORCH_CHECK(key_codes.dim() == 3 && value_codes.dim() == 3 && key_scale.dim() == 3 && value_scale.dim() == 3 &&
                    (bias.dim() == 2 || bias.dim() == 3),
                name, ": key codes, value codes and scales [G, ., .], bias [G, S] or [B, H, S]");
    kc = rows_apart(key_codes, 0), vc = rows_apart(value_codes, value_codes.size(-1));
    ks = rows_apart(as_stored(key_scale), key_scale.size(-1)), vs = rows_apart(as_stored(value_scale), value_scale.size(-1));
    b = (bias.dim() == 3 ? bias.reshape({bias.size(0) * bias.size(1), bias.size(2)}) : bias).to(torch::kFloat32).contiguous();
    mx = mix.numel() ? mix.to(torch::kFloat32).contiguous() : mix;
    TORCH_CHECK(vc.scalar_type() == torch::kUInt8, name, ": int4 value codes only");
    int8_keys = kc.scalar_type() == torch::kInt8;
    TORCH_CHECK(int8_keys || kc.scalar_type() == torch::kUInt8, name, ": int4 (uint8) or int8 key codes only");
    G = kc.size(0), d = 2 * vc.size(2), S = b.size(1), ngk = ks.size(2), ngv = vs.size(2);
    TORCH_CHECK(d > 0 && ngk > 0 && ngv > 0 && kc.size(1) == (int8_keys ? d : d / 2) && kc.size(2) == S && ks.size(0) == G &&
                    ks.size(1) == S && vc.size(0) == G && vc.size(1) == S && vs.size(0) == G && vs.size(1) == S &&
                    b.size(0) == G && d % ngk == 0 && d % ngv == 0 && (!int8_keys || ngk == 1) &&
                    (!mx.numel() || (mx.size(0) == d && mx.size(1) == d)),
                name, ": shapes do not match (see the comment above arm_decode_read)");
    mxt = mx.numel() ? mx.t().contiguous() : mx;
    MX = mx.numel() ? mx.data_ptr<float>() : nullptr;
    MXT = mx.numel() ? mxt.data_ptr<float>() : nullptr;
  }

  // read_summaries (read.unit_summaries): each unit's entry, keys and values [G, U, d] float32 in
  // the slots' basis and log weights [G, U], U the units of the read's index (nb); all three or none
  torch::Tensor uk, uv, ulw;
  int64_t U = 0;

  void set_units(const c10::optional<torch::Tensor>& keys, const c10::optional<torch::Tensor>& values,
                 const c10::optional<torch::Tensor>& log_weight, int64_t nb, const char* name) {
    TORCH_CHECK(keys.has_value() == values.has_value() && keys.has_value() == log_weight.has_value(), name,
                ": unit_keys, unit_values and unit_log_weight come together");
    if (!keys.has_value()) return;
    uk = keys->to(torch::kFloat32).contiguous(), uv = values->to(torch::kFloat32).contiguous();
    ulw = log_weight->to(torch::kFloat32).contiguous();
    TORCH_CHECK(uk.dim() == 3 && uk.size(0) == G && uk.size(1) == nb && uk.size(2) == d && uv.sizes() == uk.sizes() &&
                    ulw.dim() == 2 && ulw.size(0) == G && ulw.size(1) == nb,
                name, ": unit_keys and unit_values [G, U, d], unit_log_weight [G, U], U the index's units");
    U = nb;
  }

  // group g's unit entries (empty where there are none), w its [R, U] scratch; skip and qm are the caller's
  armkv::UnitEntries units(int64_t g, int64_t R, std::vector<float>& w) const {
    armkv::UnitEntries e;
    if (!U) return e;
    w.resize(R * U);
    e.k = uk.data_ptr<float>() + g * U * d, e.v = uv.data_ptr<float>() + g * U * d, e.lw = ulw.data_ptr<float>() + g * U;
    e.w = w.data(), e.U = U;
    return e;
  }

  // scales float32 or bfloat16 as they are (each read converts the rows it reads), others float32
  static torch::Tensor as_stored(const torch::Tensor& x) {
    const auto t = x.scalar_type();
    return t == torch::kFloat32 || t == torch::kBFloat16 ? x : x.to(torch::kFloat32);
  }

  // x [G, rows, cols] as it lies where its last dimension is contiguous and, unless row is 0,
  // its rows are `row` elements apart, else a contiguous copy: a pool's first S slots (a view
  // of a larger pool, SlotPool.readable) are read in place, not copied at every read
  static torch::Tensor rows_apart(const torch::Tensor& x, int64_t row) {
    const bool fits = x.dim() == 3 && x.stride(2) == 1 && x.stride(1) >= x.size(2) && (row == 0 || x.stride(1) == row);
    return fits ? x : x.contiguous();
  }

  // group g's [S, ng] table of scales
  static armkv::Scales scales(const torch::Tensor& x, int64_t g, int64_t ng) {
    armkv::Scales out;
    out.ng = ng;
    if (x.scalar_type() == torch::kFloat32)
      out.f32 = x.data_ptr<float>() + g * x.stride(0);
    else
      out.bf16 = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) + g * x.stride(0);
    return out;
  }

  // group g's inputs: its query, token and exact entries (t), and its pool
  armkv::DecodeGroup group(const Tokens& t, int64_t g, float* out) const {
    const int64_t i = g / t.H, h = g % t.H;  // (batch row, KV head)
    return armkv::DecodeGroup{
        t.Q + i * t.qb + h * t.qh, t.K + i * t.kb + h * t.kh, t.V + i * t.vb + h * t.vh, t.OK[i * t.okb],
        t.EK + i * t.eb + h * t.eh, t.EV + i * t.evb + h * t.evh, t.EOK + i * t.eokb,
        int8_keys ? static_cast<const void*>(kc.data_ptr<int8_t>() + g * kc.stride(0))
                  : static_cast<const void*>(kc.data_ptr<uint8_t>() + g * kc.stride(0)),
        kc.stride(1), scales(ks, g, ngk), vc.data_ptr<uint8_t>() + g * vc.stride(0), scales(vs, g, ngv),
        b.data_ptr<float>() + g * S, out};
  }
};

// Per-thread buffers of sparse_group and the partial ranking
struct SparseScratch {
  std::vector<float> qm, exact_w, tmp, slot_w, energy, top, best, uw;
  std::vector<int64_t> run_start, run_len, rows, idx;
  std::vector<char> skip;
  armkv::PartialScratch partial;
};

// One group of a sparse read: the slots of the first `count` of `chosen` buckets, read run by
// run where they lie in the pool (armkv::runs_group), as the dense read reads a pool
void sparse_group(const DecodeInputs& in, const Tokens& t, int64_t g, float* out, const armkv::UnitRuns& u,
                  const int64_t* chosen, int64_t count, double scaling, bool vectorised, SparseScratch& w) {
  const int64_t R = t.R, d = in.d, L = t.L;
  const int64_t W = armkv::chosen_runs(u, chosen, count, w.run_start, w.run_len);
  w.slot_w.resize(R * std::max<int64_t>(W, 1));
  w.qm.resize(R * d), w.exact_w.resize(R * (L + 1)), w.tmp.resize(R * d);
  armkv::UnitEntries units = in.units(g, R, w.uw);  // (read_summaries: the units left out, one entry each)
  if (in.U) units.skip = armkv::skipped(units.U, chosen, count, w.skip);
  armkv::load_runs(in.group(t, g, nullptr), in.int8_keys, d, w.run_start, w.run_len);
  armkv::runs_group(in.group(t, g, out), in.MX, in.MXT, in.int8_keys, R, d, L, in.ngk, in.ngv, static_cast<float>(scaling),
                    w.run_start, w.run_len, W, w.qm.data(), w.slot_w.data(), w.exact_w.data(), w.tmp.data(),
                    in.U ? &units : nullptr, vectorised);
}

// A layer's fused decode read with what stays between writes bound: the slots, their bias and
// the mixing, and for the sparse reads the index (order, start, size), M, take, the chosen
// buckets (kind "sparse") or the partial ranking's rows (n), and the units' entries. Checked
// and converted once, with each group's units' runs (armkv::UnitRuns) built from the index
// and kept, unless a group has more than max_runs of them (>= 0; then each call builds them
// again: the bytes a cache keeps for them are bounded); a call then takes the step's token
// inputs (Tokens) and makes no tensor op on the rest. A decode step of the model calls the one bound at the last write
// (ARMLayer._held). kind: "dense" (arm_decode_read), "sparse" (arm_sparse_decode_read),
// "best" (arm_best_decode_read), "partial" (arm_partial_decode_read); a call returns what
// those return.
class DecodeCall {
 public:
  enum Kind { kDense, kSparse, kBest, kPartial };

  DecodeCall(const std::string& kind, const torch::Tensor& key_codes, const torch::Tensor& key_scale,
             const torch::Tensor& value_codes, const torch::Tensor& value_scale, const torch::Tensor& bias,
             const torch::Tensor& mix, const c10::optional<torch::Tensor>& order, const c10::optional<torch::Tensor>& start,
             const c10::optional<torch::Tensor>& size, const c10::optional<torch::Tensor>& buckets,
             const c10::optional<torch::Tensor>& take, int64_t m, int64_t n, const c10::optional<torch::Tensor>& unit_keys,
             const c10::optional<torch::Tensor>& unit_values, const c10::optional<torch::Tensor>& unit_log_weight,
             bool vectorised, int64_t max_runs)
      : kind_(parse(kind)),
        name_(kind_ == kDense    ? "arm_decode_read"
              : kind_ == kSparse ? "arm_sparse_decode_read"
              : kind_ == kBest   ? "arm_best_decode_read"
                                 : "arm_partial_decode_read"),
        in_(key_codes, key_scale, value_codes, value_scale, bias, mix, name_),
        m_(m),
        n_(n),
        vectorised_(vectorised) {
    const int64_t G = in_.G, S = in_.S;
    if (kind_ == kDense) {
      TORCH_CHECK(!order && !start && !size && !buckets && !take && !unit_keys, name_, ": the dense read takes no index");
      return;
    }
    TORCH_CHECK(order && start && size && take, name_, ": order, start, size and take are needed");
    ord_ = order->to(torch::kInt32).contiguous(), st_ = start->to(torch::kInt32).contiguous();
    sz_ = size->to(torch::kInt32).contiguous(), tk_ = take->to(torch::kInt64).contiguous();
    TORCH_CHECK(ord_.dim() == 2 && ord_.size(0) == G && ord_.size(1) <= S && st_.dim() == 2 && st_.size(0) == G &&
                    sz_.sizes() == st_.sizes() && tk_.dim() == 1 && tk_.size(0) == G,
                name_, ": order [G, <= S], start and size [G, N_b], take [G]");
    nb_ = st_.size(1);
    runs_.resize(G);  // each group's units' runs, kept for every call unless a group has more than max_runs
    at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g) build(g, runs_[g]);
    });
    for (auto& u : runs_) kept_ = kept_ && (max_runs < 0 || u.runs() <= max_runs);
    for (auto& u : runs_) {
      if (!kept_) u = armkv::UnitRuns();  // (then built at each call)
      u.pos.shrink_to_fit(), u.slot.shrink_to_fit();
    }
    if (kind_ == kSparse) {
      TORCH_CHECK(buckets.has_value(), name_, ": buckets are needed");
      bk_ = buckets->to(torch::kInt64).contiguous();
      TORCH_CHECK(bk_.dim() == 2 && bk_.size(0) == G, name_, ": buckets [G, M]");
      m_ = bk_.size(1);
    } else {
      TORCH_CHECK(m >= 1 && m <= nb_, name_, ": 1 <= m <= N_b");
      TORCH_CHECK(kind_ != kPartial || (n >= 1 && n <= in_.d / 2), name_, ": 1 <= n <= d / 2");
    }
    in_.set_units(unit_keys, unit_values, unit_log_weight, nb_, name_);
  }

  // a step's token inputs, as Tokens takes them, for this call's slots
  Tokens tokens(const torch::Tensor& query, const torch::Tensor& own_k, const torch::Tensor& own_v,
                const torch::Tensor& own_ok, const torch::Tensor& exact_k, const torch::Tensor& exact_v,
                const torch::Tensor& exact_ok) const {
    return Tokens(query, own_k, own_v, own_ok, exact_k, exact_v, exact_ok, in_.G, in_.d, name_);
  }

  // the read of one step: the token inputs as Tokens takes them; scaling the logits' factor
  py::object call(const torch::Tensor& query, const torch::Tensor& own_k, const torch::Tensor& own_v,
                  const torch::Tensor& own_ok, const torch::Tensor& exact_k, const torch::Tensor& exact_v,
                  const torch::Tensor& exact_ok, double scaling) const {
    const Tokens t = tokens(query, own_k, own_v, own_ok, exact_k, exact_v, exact_ok);
    if (kind_ == kDense) return py::cast(dense(t, scaling));
    if (kind_ == kSparse) return py::cast(sparse(t, scaling));
    auto res = ranked(t, scaling);
    return py::make_tuple(res[0], res[1]);
  }

  // bytes kept beside the index from call to call: the units' runs
  int64_t nbytes() const {
    int64_t total = 0;
    for (const auto& u : runs_) total += u.nbytes();
    return total;
  }

  torch::Tensor dense(const Tokens& t, double scaling) const {
    const int64_t G = in_.G, R = t.R, d = in_.d, L = t.L, S = in_.S;
    auto out = t.empty_out(d);
    float* O = out.data_ptr<float>();
    at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
      thread_local std::vector<float> qm, slot_w, exact_w, tmp;  // (kept from call to call: no allocation a read)
      qm.resize(R * d), slot_w.resize(R * std::max<int64_t>(S, 1)), exact_w.resize(R * (L + 1)), tmp.resize(R * d);
      const std::vector<int64_t> start(S ? 1 : 0, 0), len(S ? 1 : 0, S);  // every slot: one run
      for (int64_t g = g0; g < g1; ++g)
        armkv::runs_group(in_.group(t, g, O + g * R * d), in_.MX, in_.MXT, in_.int8_keys, R, d, L, in_.ngk, in_.ngv,
                          static_cast<float>(scaling), start, len, S, qm.data(), slot_w.data(), exact_w.data(), tmp.data(),
                          nullptr, vectorised_);
    });
    return out;
  }

  torch::Tensor sparse(const Tokens& t, double scaling) const {
    const int64_t G = in_.G, R = t.R, d = in_.d;
    auto out = t.empty_out(d);
    float* O = out.data_ptr<float>();
    const int64_t *BK = bk_.data_ptr<int64_t>(), *TK = tk_.data_ptr<int64_t>();
    at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
      thread_local SparseScratch w;  // (kept from call to call: no allocation a read)
      thread_local armkv::UnitRuns own;
      for (int64_t g = g0; g < g1; ++g)
        sparse_group(in_, t, g, O + g * R * d, runs(g, own), BK + g * m_, std::min(TK[g], m_), scaling, vectorised_, w);
    });
    return out;
  }

  // best and partial: (out, the m buckets [G, m], best first)
  std::vector<torch::Tensor> ranked(const Tokens& t, double scaling) const {
    const int64_t G = in_.G, R = t.R, d = in_.d, L = t.L, S = in_.S, m = m_, nb = nb_;
    auto out = t.empty_out(d);
    auto buckets = torch::empty({G, m}, torch::TensorOptions().dtype(torch::kInt64));
    float* O = out.data_ptr<float>();
    int64_t* BK = buckets.data_ptr<int64_t>();
    const int64_t* TK = tk_.data_ptr<int64_t>();
    const float* B = in_.b.data_ptr<float>();
    if (kind_ == kBest) {
      at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
        thread_local armkv::BestScratch w;  // (kept from call to call: no allocation a read)
        thread_local armkv::UnitRuns own;
        w.qm.resize(R * d), w.sw.resize(R * std::max<int64_t>(S, 1)), w.top.resize(std::max<int64_t>(S, 1)), w.best.resize(nb);
        w.exact_w.resize(R * (L + 1)), w.tmp.resize(R * d);
        for (int64_t g = g0; g < g1; ++g) {
          armkv::UnitEntries units = in_.units(g, R, w.uw);  // (read_summaries: the units left out, one entry each)
          armkv::best_group(in_.group(t, g, O + g * R * d), in_.MX, in_.MXT, in_.int8_keys, R, d, L, S, in_.ngk, in_.ngv,
                            static_cast<float>(scaling), runs(g, own), m, TK[g], w,
                            BK + g * m, in_.U ? &units : nullptr, vectorised_);
        }
      });
      return {out, buckets};
    }
    at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
      thread_local SparseScratch w;  // (kept from call to call: no allocation a read)
      thread_local armkv::UnitRuns own;
      w.qm.resize(R * d), w.top.resize(std::max<int64_t>(S, 1)), w.best.resize(nb);
      for (int64_t g = g0; g < g1; ++g) {
        const armkv::UnitRuns& u = runs(g, own);
        const armkv::DecodeGroup a = in_.group(t, g, nullptr);
        armkv::mix_query(a.q, in_.MX, R, d, w.qm.data());
        armkv::partial_rows(w.qm.data(), R, d, n_, w.energy, w.rows);
        float* top = w.top.data();
        armkv::partial_top(w.qm.data(), a.key_codes, in_.int8_keys, a.key_scale, B + g * S, static_cast<float>(scaling), top, R,
                           d, S, a.ld, in_.ngk, w.rows.data(), n_, w.partial, vectorised_);
        armkv::unit_maxima(top, u, w.best.data(), vectorised_);
        armkv::top_buckets(w.best.data(), nb, m, w.idx);
        int64_t* chosen = BK + g * m;
        std::copy(w.idx.begin(), w.idx.begin() + m, chosen);
        sparse_group(in_, t, g, O + g * R * d, u, chosen, std::min(TK[g], m), scaling, vectorised_, w);
      }
    });
    return {out, buckets};
  }

 private:
  // group g's units' runs from the index, into u
  void build(int64_t g, armkv::UnitRuns& u) const {
    const int64_t listed = ord_.size(1);
    u.build(ord_.data_ptr<int32_t>() + g * listed, listed, st_.data_ptr<int32_t>() + g * nb_, sz_.data_ptr<int32_t>() + g * nb_,
            nb_, in_.S, name_);
  }

  // group g's units' runs: kept since the call was bound, or built now into `own`
  const armkv::UnitRuns& runs(int64_t g, armkv::UnitRuns& own) const {
    if (kept_) return runs_[g];
    build(g, own);
    return own;
  }

  static Kind parse(const std::string& kind) {
    if (kind == "dense") return kDense;
    if (kind == "sparse") return kSparse;
    if (kind == "best") return kBest;
    TORCH_CHECK(kind == "partial", "DecodeCall: kind is dense, sparse, best or partial, not ", kind);
    return kPartial;
  }

  Kind kind_;
  const char* name_;
  DecodeInputs in_;
  torch::Tensor ord_, st_, sz_, bk_, tk_;
  std::vector<armkv::UnitRuns> runs_;
  bool kept_ = true;
  int64_t nb_ = 0, m_ = 0, n_ = 0;
  bool vectorised_;
};

// The decode step's read of one layer (ARMLayer._decode_read): query [G, R, d] float32;
// own_k, own_v [G, d] and own_ok [G] (the new token); exact_k, exact_v [G, L, d] and
// exact_ok [G, L]; the slots' key codes (uint8 [G, d/2, S] int4 or int8 [G, d, S]) and
// scales [G, S, ngk], value codes uint8 [G, S, d/2] and scales [G, S, ngv]; bias [G, S]
// (-inf: free); mix [d, d] (empty: unmixed slots); vectorised=false: the portable loops
// (tests) -> [G, R, d]. Codes and scales may be views whose rows lie further apart (a pool's
// first S slots: SlotPool.readable): they are read where they lie, not copied. The per-token
// inputs may come in the model's layout instead (query [B, Hq, 1, d], own_k and own_v
// [B, H, 1, d], own_ok [B, T], exact_k and exact_v [B, H, L, d], exact_ok [B, L], bias
// [B, H, S]): then the output is [B, 1, Hq, d] (Tokens reads them where they lie).
torch::Tensor arm_decode_read(torch::Tensor query, torch::Tensor own_k, torch::Tensor own_v, torch::Tensor own_ok,
                              torch::Tensor exact_k, torch::Tensor exact_v, torch::Tensor exact_ok, torch::Tensor key_codes,
                              torch::Tensor key_scale, torch::Tensor value_codes, torch::Tensor value_scale,
                              torch::Tensor bias, torch::Tensor mix, double scaling, bool vectorised) {
  const DecodeCall call("dense", key_codes, key_scale, value_codes, value_scale, bias, mix, {}, {}, {}, {}, {}, 0, 0, {}, {}, {},
                        vectorised, -1);
  return call.dense(call.tokens(query, own_k, own_v, own_ok, exact_k, exact_v, exact_ok), scaling);
}

// The sparse decode read (ARMLayer._sparse_read, one query): arm_decode_read over only the
// slots filed under each group's chosen buckets, copied out of the pool where they lie
// instead of gathered slot by slot by index. order [G, S] int32 lists the occupied slots
// bucket by bucket; bucket b's are order[start[b] : start[b] + size[b]] (start, size
// [G, N_b] int32: read.BucketIndex; an order of width 0 lists slot p at p, a pool laid
// bucket by bucket); buckets [G, M] the group's buckets, best first, and take [G] how many
// of them it reads. A pool laid bucket by bucket (read.sort_by_bucket)
// makes each bucket one run of consecutive slots: the copy is then a memcpy per run and
// channel row, and costs a fraction of reading those bytes. The other inputs and the
// result as arm_decode_read's.
torch::Tensor arm_sparse_decode_read(torch::Tensor query, torch::Tensor own_k, torch::Tensor own_v, torch::Tensor own_ok,
                                     torch::Tensor exact_k, torch::Tensor exact_v, torch::Tensor exact_ok,
                                     torch::Tensor key_codes, torch::Tensor key_scale, torch::Tensor value_codes,
                                     torch::Tensor value_scale, torch::Tensor bias, torch::Tensor mix, double scaling,
                                     torch::Tensor order, torch::Tensor start, torch::Tensor size, torch::Tensor buckets,
                                     torch::Tensor take, const c10::optional<torch::Tensor>& unit_keys,
                                     const c10::optional<torch::Tensor>& unit_values,
                                     const c10::optional<torch::Tensor>& unit_log_weight, bool vectorised) {
  const DecodeCall call("sparse", key_codes, key_scale, value_codes, value_scale, bias, mix, order, start, size, buckets, take, 0,
                        0, unit_keys, unit_values, unit_log_weight, vectorised, -1);
  return call.sparse(call.tokens(query, own_k, own_v, own_ok, exact_k, exact_v, exact_ok), scaling);
}

// The decode read of read_rank="partial" (ARMLayer._sparse_read, one query): each group's
// buckets ranked by their best partial logit, q.k over the n key-code rows where the query
// (in the slots' basis) is largest (armkv::partial_rows), times the scaling plus the bias,
// the largest over the slots a bucket lists and the R heads; the first take [G] of the m best
// buckets then read as arm_sparse_decode_read reads them (every key of theirs scored whole).
// Arguments as arm_sparse_decode_read's, m and n for its buckets -> (out [G, R, d], buckets
// [G, m] best first, ties to the lower id)
std::vector<torch::Tensor> arm_partial_decode_read(torch::Tensor query, torch::Tensor own_k, torch::Tensor own_v,
                                                   torch::Tensor own_ok, torch::Tensor exact_k, torch::Tensor exact_v,
                                                   torch::Tensor exact_ok, torch::Tensor key_codes, torch::Tensor key_scale,
                                                   torch::Tensor value_codes, torch::Tensor value_scale, torch::Tensor bias,
                                                   torch::Tensor mix, double scaling, torch::Tensor order, torch::Tensor start,
                                                   torch::Tensor size, int64_t m, torch::Tensor take, int64_t n,
                                                   const c10::optional<torch::Tensor>& unit_keys,
                                                   const c10::optional<torch::Tensor>& unit_values,
                                                   const c10::optional<torch::Tensor>& unit_log_weight, bool vectorised) {
  const DecodeCall call("partial", key_codes, key_scale, value_codes, value_scale, bias, mix, order, start, size, {}, take, m, n,
                        unit_keys, unit_values, unit_log_weight, vectorised, -1);
  return call.ranked(call.tokens(query, own_k, own_v, own_ok, exact_k, exact_v, exact_ok), scaling);
}

// The m best buckets of each group of R query heads that share a KV head, for one decoded
// token (Router.group_topm_buckets, its exhaustive search over a small tree): the queries
// post-RoPE [G, R, d] float32, G = B * H row-major, are un-rotated at their row's position
// pos [B] (Rotary.unrotate: inv_freq [d/2], attention scaling rope_scaling); each KV head's
// routers weight [H, K * C, d] and read_bias [H, K * C] give logits x . w * read_scale + bias,
// a log-softmax over each node's C children, a leaf the sum of its path's D entries (paths
// [D, N_b] flat indices: Router._leaf_paths), and a bucket the log of the mean over the R
// heads of their path probabilities -> (buckets [G, m] int64, scores [G, m] float32), best first
std::vector<torch::Tensor> group_leaf_topm(torch::Tensor query, torch::Tensor pos, torch::Tensor inv_freq, double rope_scaling,
                                           torch::Tensor weight, torch::Tensor read_bias, double read_scale, torch::Tensor paths,
                                           int64_t C, int64_t m) {
  auto q = query.contiguous(), p = pos.to(torch::kFloat32).contiguous(), f = inv_freq.to(torch::kFloat32).contiguous();
  auto w = weight.contiguous(), rb = read_bias.contiguous(), path = paths.to(torch::kInt64).contiguous();
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kFloat32 && rb.scalar_type() == torch::kFloat32,
              "group_leaf_topm: float32 queries and routers only");
  const int64_t G = q.size(0), R = q.size(1), d = q.size(2), H = w.size(0), KC = w.size(1), D = path.size(0), nb = path.size(1);
  TORCH_CHECK(q.dim() == 3 && d % 2 == 0 && w.dim() == 3 && w.size(2) == d && rb.dim() == 2 && rb.size(0) == H &&
                  rb.size(1) == KC && KC % C == 0 && G % H == 0 && p.dim() == 1 && p.size(0) == G / H && f.size(0) == d / 2 &&
                  m >= 1 && m <= nb && path.dim() == 2,
              "group_leaf_topm: query [G, R, d], pos [G / H], inv_freq [d / 2], weight [H, K * C, d], read_bias [H, K * C]");
  const int64_t half = d / 2;
  const float inv_scale = static_cast<float>(1.0 / rope_scaling), rs = static_cast<float>(read_scale);
  const float log_r = std::log(static_cast<float>(R));
#ifdef ARMKV_AVX2
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  auto buckets = torch::empty({G, m}, q.options().dtype(torch::kInt64));
  auto scores = torch::empty({G, m}, q.options());
  const float *Q = q.data_ptr<float>(), *P = p.data_ptr<float>(), *F = f.data_ptr<float>();
  const float *W = w.data_ptr<float>(), *RB = rb.data_ptr<float>();
  const int64_t* PATH = path.data_ptr<int64_t>();
  int64_t* BO = buckets.data_ptr<int64_t>();
  float* SO = scores.data_ptr<float>();
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    std::vector<float> x(d), cs(half), sn(half), logp(KC), leaf(R * nb), group(nb);
    std::vector<int64_t> idx(nb);
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t h = g % H;
      for (int64_t c = 0; c < half; ++c) {
        const float t = P[g / H] * F[c];
        cs[c] = std::cos(t), sn[c] = std::sin(t);
      }
      for (int64_t r = 0; r < R; ++r) {
        const float* qr = Q + (g * R + r) * d;
        for (int64_t c = 0; c < half; ++c) {  // R(-theta) / s: x cos - rotate_half(x) sin
          x[c] = (qr[c] * cs[c] + qr[c + half] * sn[c]) * inv_scale;
          x[c + half] = (qr[c + half] * cs[c] - qr[c] * sn[c]) * inv_scale;
        }
        for (int64_t j = 0; j < KC; ++j) {
          const float* wj = W + (h * KC + j) * d;
          float acc = 0.0f;
#ifdef ARMKV_AVX2
          if (avx2)
            acc = armkv::dot_avx2(x.data(), wj, d);
          else
#endif
            for (int64_t c = 0; c < d; ++c) acc += x[c] * wj[c];
          logp[j] = acc * rs + RB[h * KC + j];
        }
        for (int64_t k0 = 0; k0 < KC; k0 += C) {  // log-softmax over each node's children
          float peak = logp[k0], total = 0.0f;
          for (int64_t c = 1; c < C; ++c) peak = std::max(peak, logp[k0 + c]);
          for (int64_t c = 0; c < C; ++c) total += std::exp(logp[k0 + c] - peak);
          const float lse = peak + std::log(total);
          for (int64_t c = 0; c < C; ++c) logp[k0 + c] -= lse;
        }
        for (int64_t b = 0; b < nb; ++b) {
          float total = 0.0f;
          for (int64_t l = 0; l < D; ++l) total += logp[PATH[l * nb + b]];
          leaf[r * nb + b] = total;
        }
      }
      for (int64_t b = 0; b < nb; ++b) {  // log of the mean path probability over the R heads
        float peak = leaf[b], total = 0.0f;
        for (int64_t r = 1; r < R; ++r) peak = std::max(peak, leaf[r * nb + b]);
        for (int64_t r = 0; r < R; ++r) total += std::exp(leaf[r * nb + b] - peak);
        group[b] = peak + std::log(total) - log_r;
      }
      for (int64_t b = 0; b < nb; ++b) idx[b] = b;
      std::partial_sort(idx.begin(), idx.begin() + m, idx.end(),
                        [&](int64_t a, int64_t b) { return group[a] > group[b] || (group[a] == group[b] && a < b); });
      for (int64_t j = 0; j < m; ++j) BO[g * m + j] = idx[j], SO[g * m + j] = group[idx[j]];
    }
  });
  return {buckets, scores};
}

// The decode read of read_rank="best" in one call (ARMLayer._sparse_read, one query): every
// slot of each group scored once, each bucket ranked by its best logit (read.bucket_best of
// the logits), and the first take[g] of the m best buckets read with the logits already
// computed (arm_sparse_decode_read scores its buckets' slots again). The inputs as
// arm_sparse_decode_read's, with m (1 <= m <= N_b) for buckets -> (out [G, R, d], the m
// buckets [G, m] int64, best first)
std::vector<torch::Tensor> arm_best_decode_read(torch::Tensor query, torch::Tensor own_k, torch::Tensor own_v,
                                                torch::Tensor own_ok, torch::Tensor exact_k, torch::Tensor exact_v,
                                                torch::Tensor exact_ok, torch::Tensor key_codes, torch::Tensor key_scale,
                                                torch::Tensor value_codes, torch::Tensor value_scale, torch::Tensor bias,
                                                torch::Tensor mix, double scaling, torch::Tensor order, torch::Tensor start,
                                                torch::Tensor size, int64_t m, torch::Tensor take,
                                                const c10::optional<torch::Tensor>& unit_keys,
                                                const c10::optional<torch::Tensor>& unit_values,
                                                const c10::optional<torch::Tensor>& unit_log_weight, bool vectorised) {
  const DecodeCall call("best", key_codes, key_scale, value_codes, value_scale, bias, mix, order, start, size, {}, take, m, 0,
                        unit_keys, unit_values, unit_log_weight, vectorised, -1);
  return call.ranked(call.tokens(query, own_k, own_v, own_ok, exact_k, exact_v, exact_ok), scaling);
}

// read.unit_summaries from the codes, unit by unit of an index (the units a read at M < N_b
// ranks: buckets, or their pages): key codes (uint8 [G, d/2, S] int4 or int8 [G, d, S]) and
// scales [G, S, ngk], value codes uint8 [G, S, d/2] and scales [G, S, ngv], read where they lie
// (as arm_decode_read reads them); bias [G, S] (-inf: free); the units' order [G, listed]
// (listed 0: a pool laid unit by unit), start and size [G, U] -> (keys [G, U, d] and values
// [G, U, d] float32: the means of the unit's slots weighted by exp(bias), zero for an empty
// unit; log_weight [G, U] float32: the log of their total weight, -inf for an empty unit).
// todo [G, U] bool: only those units (the others zero, -inf: their entries are the caller's).
std::vector<torch::Tensor> unit_summaries(torch::Tensor key_codes, torch::Tensor key_scale, torch::Tensor value_codes,
                                          torch::Tensor value_scale, torch::Tensor bias, torch::Tensor order, torch::Tensor start,
                                          torch::Tensor size, bool vectorised, const c10::optional<torch::Tensor>& todo) {
  auto kc = DecodeInputs::rows_apart(key_codes, 0), vc = DecodeInputs::rows_apart(value_codes, value_codes.size(-1));
  auto ks = DecodeInputs::rows_apart(DecodeInputs::as_stored(key_scale), key_scale.size(-1));
  auto vs = DecodeInputs::rows_apart(DecodeInputs::as_stored(value_scale), value_scale.size(-1));
  auto b = bias.to(torch::kFloat32).contiguous();
  auto ord = order.to(torch::kInt32).contiguous(), st = start.to(torch::kInt32).contiguous();
  auto sz = size.to(torch::kInt32).contiguous();
  const bool int8_keys = kc.scalar_type() == torch::kInt8;
  TORCH_CHECK(vc.scalar_type() == torch::kUInt8 && (int8_keys || kc.scalar_type() == torch::kUInt8) && b.dim() == 2 &&
                  kc.dim() == 3 && vc.dim() == 3 && b.device().is_cpu(),
              "unit_summaries: int4 (uint8) or int8 key codes, int4 value codes, bias [G, S], on the CPU");
  const int64_t G = b.size(0), S = b.size(1), d = vc.size(2) * 2, ngk = ks.size(2), ngv = vs.size(2);
  TORCH_CHECK(kc.size(0) == G && kc.size(1) == (int8_keys ? d : d / 2) && kc.size(2) == S && ks.size(0) == G && ks.size(1) == S &&
                  vc.size(0) == G && vc.size(1) == S && vs.size(0) == G && vs.size(1) == S && d % ngk == 0 && d % ngv == 0 &&
                  (!int8_keys || ngk == 1) && ord.dim() == 2 && ord.size(0) == G && ord.size(1) <= S && st.dim() == 2 &&
                  st.size(0) == G && sz.sizes() == st.sizes(),
              "unit_summaries: shapes do not match (codes and scales as arm_decode_read takes them, bias [G, S], order [G, <= S], "
              "start and size [G, U])");
  const int64_t U = st.size(1), listed = ord.size(1);
  torch::Tensor only;
  if (todo.has_value()) {
    only = todo->to(torch::kBool).contiguous();
    TORCH_CHECK(only.dim() == 2 && only.size(0) == G && only.size(1) == U, "unit_summaries: todo [G, U]");
  }
  const bool* TODO = only.defined() ? only.data_ptr<bool>() : nullptr;
  const auto *ORD = ord.data_ptr<int32_t>(), *ST = st.data_ptr<int32_t>(), *SZ = sz.data_ptr<int32_t>();
  const float* B = b.data_ptr<float>();
  auto keys = torch::zeros({G, U, d}, b.options()), values = torch::zeros({G, U, d}, b.options());
  auto log_weight = torch::empty({G, U}, b.options());
  float *K = keys.data_ptr<float>(), *V = values.data_ptr<float>(), *LW = log_weight.data_ptr<float>();
  std::vector<armkv::UnitRuns> runs(G);
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      runs[g].build(ORD + g * listed, listed, ST + g * U, SZ + g * U, U, S, "unit_summaries");
  });
  at::parallel_for(0, G * U, 1, [&](int64_t i0, int64_t i1) {
    thread_local std::vector<int64_t> run_start, run_len;
    thread_local std::vector<float> w;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t g = i / U, unit = i % U;
      if (TODO && !TODO[i]) {
        LW[i] = -std::numeric_limits<float>::infinity();
        continue;
      }
      const int64_t W = armkv::chosen_runs(runs[g], &unit, 1, run_start, run_len);
      w.resize(std::max<int64_t>(W, 1));
      float total = 0.0f;
      for (size_t k = 0, at = 0; k < run_start.size(); at += run_len[k], ++k)
        for (int64_t j = 0; j < run_len[k]; ++j) total += (w[at + j] = std::exp(B[g * S + run_start[k] + j]));
      if (!(total > 0.0f)) {  // an empty unit: zero mean, no weight
        LW[i] = -std::numeric_limits<float>::infinity();
        continue;
      }
      const void* kcg = int8_keys ? static_cast<const void*>(kc.data_ptr<int8_t>() + g * kc.stride(0))
                                  : static_cast<const void*>(kc.data_ptr<uint8_t>() + g * kc.stride(0));
      armkv::unit_sums(w.data(), kcg, int8_keys, DecodeInputs::scales(ks, g, ngk), vc.data_ptr<uint8_t>() + g * vc.stride(0),
                       DecodeInputs::scales(vs, g, ngv), d, kc.stride(1), ngk, ngv, W, run_start, run_len, K + i * d, V + i * d,
                       vectorised);
      const float inv = 1.0f / total;
      for (int64_t c = 0; c < d; ++c) K[i * d + c] *= inv, V[i * d + c] *= inv;
      LW[i] = std::log(total);
    }
  });
  return {keys, values, log_weight};
}

// A chunk's read of the slots of each query's top units (read.ranked_chunk_read), from the
// logits the chunk computed for every slot: logits [G, R, T, S] float32 (q.k * scaling, not
// biased), bias [G, S] (-inf: free), values [G, S, d] float32, the units' index (order [G,
// listed], listed 0: a pool laid unit by unit; start, size [G, N_u]), m [G]: units each group's
// queries read -> (acc [G, R, T, d], peak [G, R, T], den [G, R, T]): the unnormalised softmax
// over each query's slots (ranked_query), to be joined with the rest of its softmax. With
// read_summaries, unit_logits [G, R, T, N_u] (q.k * scaling + log weight, -inf: an empty unit)
// and unit_values [G, N_u, d] float32: each unit a query skips joins that softmax as one entry.
std::vector<torch::Tensor> ranked_slot_read(torch::Tensor logits, torch::Tensor bias, torch::Tensor values,
                                            torch::Tensor order, torch::Tensor start, torch::Tensor size, torch::Tensor m,
                                            bool vectorised, const c10::optional<torch::Tensor>& unit_logits,
                                            const c10::optional<torch::Tensor>& unit_values) {
  TORCH_CHECK(logits.scalar_type() == torch::kFloat32 && bias.scalar_type() == torch::kFloat32 &&
                  values.scalar_type() == torch::kFloat32 && logits.device().is_cpu(),
              "ranked_slot_read: float32 logits, bias and values on the CPU");
  auto lg = logits.contiguous(), bs = bias.contiguous(), vs = values.contiguous();
  auto ord = order.to(torch::kInt32).contiguous(), st = start.to(torch::kInt32).contiguous();
  auto sz = size.to(torch::kInt32).contiguous(), mm = m.to(torch::kInt64).contiguous();
  TORCH_CHECK(lg.dim() == 4 && bs.dim() == 2 && vs.dim() == 3, "ranked_slot_read: logits [G, R, T, S], bias [G, S], values [G, S, d]");
  const int64_t G = lg.size(0), R = lg.size(1), T = lg.size(2), S = lg.size(3), d = vs.size(2);
  TORCH_CHECK(bs.size(0) == G && bs.size(1) == S && vs.size(0) == G && vs.size(1) == S && ord.dim() == 2 && ord.size(0) == G &&
                  ord.size(1) <= S && st.dim() == 2 && st.size(0) == G && sz.sizes() == st.sizes() && mm.dim() == 1 &&
                  mm.size(0) == G,
              "ranked_slot_read: bias [G, S], values [G, S, d], order [G, <= S], start and size [G, N_u], m [G]");
  const int64_t nb = st.size(1), listed = ord.size(1);
  TORCH_CHECK(unit_logits.has_value() == unit_values.has_value(), "ranked_slot_read: unit_logits and unit_values come together");
  torch::Tensor ul, uv;
  if (unit_logits.has_value()) {
    ul = unit_logits->to(torch::kFloat32).contiguous(), uv = unit_values->to(torch::kFloat32).contiguous();
    TORCH_CHECK(ul.dim() == 4 && ul.size(0) == G && ul.size(1) == R && ul.size(2) == T && ul.size(3) == nb && uv.dim() == 3 &&
                    uv.size(0) == G && uv.size(1) == nb && uv.size(2) == d,
                "ranked_slot_read: unit_logits [G, R, T, N_u], unit_values [G, N_u, d]");
  }
  const int64_t U = ul.defined() ? nb : 0;
  const float* UL = U ? ul.data_ptr<float>() : nullptr;
  const float* UV = U ? uv.data_ptr<float>() : nullptr;
  const auto *ORD = ord.data_ptr<int32_t>(), *ST = st.data_ptr<int32_t>(), *SZ = sz.data_ptr<int32_t>();
  const int64_t* M = mm.data_ptr<int64_t>();
  const float *LG = lg.data_ptr<float>(), *BS = bs.data_ptr<float>(), *VS = vs.data_ptr<float>();
  auto acc = torch::empty({G, R, T, d}, lg.options());
  auto peak = torch::empty({G, R, T}, lg.options()), den = torch::empty({G, R, T}, lg.options());
  float *ACC = acc.data_ptr<float>(), *PK = peak.data_ptr<float>(), *DN = den.data_ptr<float>();
  std::vector<armkv::UnitRuns> runs(G);  // (each group's, for its T queries)
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      runs[g].build(ORD + g * listed, listed, ST + g * nb, SZ + g * nb, nb, S, "ranked_slot_read");
  });
  at::parallel_for(0, G * T, 1, [&](int64_t i0, int64_t i1) {
    thread_local armkv::BestScratch w;  // (kept from call to call; ranked_query uses top, best, cw and the runs)
    w.top.resize(std::max<int64_t>(S, 1)), w.best.resize(std::max<int64_t>(nb, 1));
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t g = i / T, t = i % T, head0 = g * R * T + t;
      const int64_t take = std::max<int64_t>(0, std::min<int64_t>(M[g], nb));
      armkv::ranked_query(LG + head0 * S, T * S, BS + g * S, VS + g * S * d, S, R, d, runs[g], take, w, ACC + head0 * d, T * d,
                          PK + head0, DN + head0, T,
                          U ? UL + head0 * U : nullptr, T * U, U ? UV + g * U * d : nullptr, U, vectorised);
    }
  });
  return {acc, peak, den};
}

// The occupied slots of each group listed bucket by bucket (read.bucket_index, a counting
// sort): slot_bucket [G, S], occupied [G, S] bool -> (order [G, S] int32: slot ids by bucket,
// in slot order within one, free slots last; start, size [G, nb] int32; breaks [G] int64:
// where the next listed occupied slot is not the next slot of the pool, read.run_breaks)
std::vector<torch::Tensor> bucket_lists(torch::Tensor slot_bucket, torch::Tensor occupied, int64_t nb) {
  auto bk = slot_bucket.to(torch::kInt64).contiguous(), oc = occupied.to(torch::kBool).contiguous();
  TORCH_CHECK(bk.dim() == 2 && oc.sizes() == bk.sizes() && bk.device().is_cpu() && nb >= 1,
              "bucket_lists: slot_bucket and occupied [G, S] on the CPU, nb >= 1");
  const int64_t G = bk.size(0), S = bk.size(1);
  auto i32 = torch::TensorOptions().dtype(torch::kInt32);
  auto order = torch::empty({G, S}, i32), start = torch::empty({G, nb}, i32), size = torch::zeros({G, nb}, i32);
  auto breaks = torch::zeros({G}, torch::TensorOptions().dtype(torch::kInt64));
  const int64_t* B = bk.data_ptr<int64_t>();
  const bool* O = oc.data_ptr<bool>();
  int32_t *ORD = order.data_ptr<int32_t>(), *ST = start.data_ptr<int32_t>(), *SZ = size.data_ptr<int32_t>();
  int64_t* BR = breaks.data_ptr<int64_t>();
  bool bad = false;
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t* b = B + g * S;
      const bool* o = O + g * S;
      int32_t *ord = ORD + g * S, *st = ST + g * nb, *sz = SZ + g * nb;
      int64_t listed = 0;
      for (int64_t s = 0; s < S; ++s) {
        if (!o[s]) continue;
        if (b[s] < 0 || b[s] >= nb) { bad = true; continue; }
        ++sz[b[s]], ++listed;
      }
      int64_t at = 0;
      for (int64_t k = 0; k < nb; ++k) st[k] = static_cast<int32_t>(at), at += sz[k];
      std::vector<int64_t> next(st, st + nb);
      int64_t free_at = at;
      for (int64_t s = 0; s < S; ++s) {
        if (o[s] && b[s] >= 0 && b[s] < nb) ord[next[b[s]]++] = static_cast<int32_t>(s);
        else if (!o[s]) ord[free_at++] = static_cast<int32_t>(s);
      }
      int64_t n = 0;
      for (int64_t j = 0; j + 1 < listed; ++j) n += ord[j + 1] - ord[j] != 1;
      BR[g] = n;
    }
  });
  TORCH_CHECK(!bad, "bucket_lists: an occupied slot's bucket outside [0, nb)");
  return {order, start, size, breaks};
}

// cos [G, N, S] float32 (token-slot cosines), slot_bucket [G, S] (-1 or any negative: free),
// token_bucket [G, N] -> (same [G, N], same_idx [G, N], any [G, N], any_idx [G, N]): each token's
// best occupied slot of its own bucket and of any bucket (-inf, index 0 where none);
// vectorised=false: the portable loops (tests)
std::vector<torch::Tensor> best_slots(torch::Tensor cos, torch::Tensor slot_bucket, torch::Tensor token_bucket,
                                      bool vectorised) {
  TORCH_CHECK(cos.device().is_cpu() && cos.scalar_type() == torch::kFloat32 && cos.dim() == 3, "float32 CPU cosines [G, N, S]");
  auto c = cos.contiguous();
  const int64_t G = c.size(0), N = c.size(1), S = c.size(2);
  auto eb = slot_bucket.to(torch::kInt32).clamp_min(-1).contiguous();
  auto tb = token_bucket.to(torch::kInt32).contiguous();
  TORCH_CHECK(eb.dim() == 2 && eb.size(0) == G && eb.size(1) == S, "slot_bucket must be [G, S]");
  TORCH_CHECK(tb.dim() == 2 && tb.size(0) == G && tb.size(1) == N, "token_bucket must be [G, N]");
  auto same = torch::empty({G, N}, c.options()), any = torch::empty({G, N}, c.options());
  auto same_idx = torch::empty({G, N}, c.options().dtype(torch::kInt64)), any_idx = torch::empty_like(same_idx);
  const float* C = c.data_ptr<float>();
  const int32_t *E = eb.data_ptr<int32_t>(), *T = tb.data_ptr<int32_t>();
  float *SM = same.data_ptr<float>(), *AN = any.data_ptr<float>();
  int64_t *SI = same_idx.data_ptr<int64_t>(), *AI = any_idx.data_ptr<int64_t>();
  at::parallel_for(0, G * N, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t g = r / N;
      armkv::best_slots_row(C + r * S, E + g * S, T[r] < 0 ? -2 : T[r], S, SM + r, SI + r, AN + r, AI + r, vectorised);
    }
  });
  return {same, same_idx, any, any_idx};
}

// tokens [G, N, d] and slots [G, S, d] float32, slot_bucket [G, S] (negative: free),
// token_bucket [G, N] -> (best [G, N] float32, idx [G, N] int64): each token's most similar
// occupied slot of its own bucket (-inf, 0 where none); vectorised=false: the portable loop
std::vector<torch::Tensor> bucket_best_slots(torch::Tensor tokens, torch::Tensor slots, torch::Tensor slot_bucket,
                                             torch::Tensor token_bucket, bool vectorised) {
  TORCH_CHECK(tokens.device().is_cpu() && tokens.scalar_type() == torch::kFloat32 && tokens.dim() == 3, "float32 CPU tokens [G, N, d]");
  TORCH_CHECK(slots.device().is_cpu() && slots.scalar_type() == torch::kFloat32 && slots.dim() == 3, "float32 CPU slots [G, S, d]");
  auto x = tokens.contiguous(), k = slots.contiguous();
  const int64_t G = x.size(0), N = x.size(1), d = x.size(2), S = k.size(1);
  TORCH_CHECK(k.size(0) == G && k.size(2) == d, "slots must be [G, S, d] with the tokens' G and d");
  auto sb = slot_bucket.to(torch::kInt32).contiguous(), tb = token_bucket.to(torch::kInt32).contiguous();
  TORCH_CHECK(sb.dim() == 2 && sb.size(0) == G && sb.size(1) == S, "slot_bucket must be [G, S]");
  TORCH_CHECK(tb.dim() == 2 && tb.size(0) == G && tb.size(1) == N, "token_bucket must be [G, N]");
  auto best = torch::empty({G, N}, x.options());
  auto idx = torch::empty({G, N}, x.options().dtype(torch::kInt64));
  bool avx = false;
#ifdef ARMKV_AVX2
  avx = vectorised && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      auto call = [&](auto fn) {
        fn(x.data_ptr<float>() + g * N * d, k.data_ptr<float>() + g * S * d, sb.data_ptr<int32_t>() + g * S,
           tb.data_ptr<int32_t>() + g * N, N, S, d, best.data_ptr<float>() + g * N, idx.data_ptr<int64_t>() + g * N);
      };
      if (avx) call(armkv::bucket_best_group<true>);
      else call(armkv::bucket_best_group<false>);
    }
  });
  return {best, idx};
}

// The decode step's push of one token a row into the ring window (ExactBuffer._push_one, its
// window part; the PyTorch form there is the reference): win_k, win_v [B, H, W, d] (any strides
// but a contiguous last dimension: views into the buffer), win_valid, win_pos [B, W], head [B]
// int64 (each row's oldest entry); key, value [B, H, 1, d], valid [B] bool, pos [B] int64. Each
// valid row's oldest entry leaves and the token takes its place; an invalid row changes nothing.
// Returns (key, value [B, H, 1, d]: the entries that left, zero where none did; leaves [B, 1];
// their positions [B, 1]). Rows are copied as bytes, so any dtype serves. In PyTorch this is
// some twenty small ops per layer and step.
std::vector<torch::Tensor> ring_push(torch::Tensor win_k, torch::Tensor win_v, torch::Tensor win_valid, torch::Tensor win_pos,
                                     torch::Tensor head, torch::Tensor key, torch::Tensor value, torch::Tensor valid,
                                     torch::Tensor pos) {
  TORCH_CHECK(win_k.device().is_cpu() && win_k.dim() == 4 && win_v.sizes() == win_k.sizes() && win_k.stride(3) == 1 &&
                  win_v.stride(3) == 1 && win_v.scalar_type() == win_k.scalar_type(),
              "ring_push: CPU windows [B, H, W, d] with contiguous rows");
  const int64_t B = win_k.size(0), H = win_k.size(1), W = win_k.size(2), d = win_k.size(3);
  TORCH_CHECK(W > 0 && win_valid.scalar_type() == torch::kBool && win_valid.dim() == 2 && win_valid.size(0) == B &&
                  win_valid.size(1) == W && win_pos.scalar_type() == torch::kInt64 && win_pos.sizes() == win_valid.sizes() &&
                  head.scalar_type() == torch::kInt64 && head.dim() == 1 && head.size(0) == B && head.is_contiguous(),
              "ring_push: win_valid [B, W] bool, win_pos [B, W] int64, head [B] contiguous int64");
  auto k = key.contiguous(), v = value.contiguous();
  auto ok = valid.to(torch::kBool).contiguous(), p = pos.to(torch::kInt64).contiguous();
  TORCH_CHECK(k.scalar_type() == win_k.scalar_type() && v.scalar_type() == win_k.scalar_type() && k.dim() == 4 &&
                  k.size(0) == B && k.size(1) == H && k.size(2) == 1 && k.size(3) == d && v.sizes() == k.sizes() &&
                  ok.numel() == B && p.numel() == B,
              "ring_push: key, value [B, H, 1, d] of the window's dtype, valid [B], pos [B]");
  auto old_k = torch::zeros_like(k), old_v = torch::zeros_like(v);
  auto leaves = torch::empty({B, 1}, ok.options()), old_pos = torch::empty({B, 1}, p.options());
  const int64_t row = d * static_cast<int64_t>(win_k.element_size());
  char *WK = static_cast<char*>(win_k.data_ptr()), *WV = static_cast<char*>(win_v.data_ptr());
  const char *K = static_cast<const char*>(k.data_ptr()), *V = static_cast<const char*>(v.data_ptr());
  char *OK_ = static_cast<char*>(old_k.data_ptr()), *OV = static_cast<char*>(old_v.data_ptr());
  const int64_t esz = win_k.element_size();
  bool* WVAL = win_valid.data_ptr<bool>();
  int64_t* WPOS = win_pos.data_ptr<int64_t>();
  int64_t* HEAD = head.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t at = HEAD[b];
    TORCH_CHECK(at >= 0 && at < W, "ring_push: head out of the window");
    bool& slot_valid = WVAL[b * win_valid.stride(0) + at * win_valid.stride(1)];
    int64_t& slot_pos = WPOS[b * win_pos.stride(0) + at * win_pos.stride(1)];
    const bool in = ok.data_ptr<bool>()[b], out = slot_valid && in;
    leaves.data_ptr<bool>()[b] = out;
    old_pos.data_ptr<int64_t>()[b] = slot_pos;
    for (int64_t h = 0; h < H; ++h) {
      char* wk = WK + (b * win_k.stride(0) + h * win_k.stride(1) + at * win_k.stride(2)) * esz;
      char* wv = WV + (b * win_v.stride(0) + h * win_v.stride(1) + at * win_v.stride(2)) * esz;
      if (out) {
        std::memcpy(OK_ + (b * H + h) * row, wk, row);
        std::memcpy(OV + (b * H + h) * row, wv, row);
      }
      if (in) {
        std::memcpy(wk, K + (b * H + h) * row, row);
        std::memcpy(wv, V + (b * H + h) * row, row);
      }
    }
    if (in) {
      slot_valid = true;
      slot_pos = p.data_ptr<int64_t>()[b];
      HEAD[b] = (at + 1) % W;
    }
  }
  return {old_k, old_v, leaves, old_pos};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_key_scores", &int4_key_scores, "query . int4 slot keys (channel-major codes), each group's scale applied");
  m.def("int8_key_scores", &int8_key_scores, "query . int8 slot keys (channel-major codes), each slot's scale applied");
  m.def("int4_weighted_values", &int4_weighted_values, "weights @ int4 slot values, each group's scale applied");
  m.def("int4_vectorised", &int4_vectorised, "whether the AVX2 loops serve these sizes on this CPU");
  m.def("int4_dequantise", &int4_dequantise, "k4v4 slots to float keys and values as stored, optionally unmixed");
  m.def("best_slots", &best_slots, "each token's best occupied slot of its bucket and of any bucket, from the cosines",
        py::arg("cos"), py::arg("slot_bucket"), py::arg("token_bucket"), py::arg("vectorised") = true);
  m.def("bucket_best_slots", &bucket_best_slots, "each token's most similar occupied slot of its own bucket (cosine)",
        py::arg("tokens"), py::arg("slots"), py::arg("slot_bucket"), py::arg("token_bucket"), py::arg("vectorised") = true);
  m.def("band_neighbours", &band_neighbours, "each slot's nearest same-bucket slot within a band in bucket order");
  m.def("arm_decode_read", &arm_decode_read, "the decode step's read of one layer: slots, exact entries and the token, one softmax",
        py::arg("query"), py::arg("own_k"), py::arg("own_v"), py::arg("own_ok"), py::arg("exact_k"), py::arg("exact_v"),
        py::arg("exact_ok"), py::arg("key_codes"), py::arg("key_scale"), py::arg("value_codes"), py::arg("value_scale"),
        py::arg("bias"), py::arg("mix"), py::arg("scaling"), py::arg("vectorised") = true);
  m.def("arm_sparse_decode_read", &arm_sparse_decode_read,
        "the decode read of the slots of each group's chosen buckets, copied out of the pool run by run",
        py::arg("query"), py::arg("own_k"), py::arg("own_v"), py::arg("own_ok"), py::arg("exact_k"), py::arg("exact_v"),
        py::arg("exact_ok"), py::arg("key_codes"), py::arg("key_scale"), py::arg("value_codes"), py::arg("value_scale"),
        py::arg("bias"), py::arg("mix"), py::arg("scaling"), py::arg("order"), py::arg("start"), py::arg("size"),
        py::arg("buckets"), py::arg("take"), py::arg("unit_keys") = py::none(), py::arg("unit_values") = py::none(),
        py::arg("unit_log_weight") = py::none(), py::arg("vectorised") = true);
  m.def("arm_best_decode_read", &arm_best_decode_read,
        "the decode read of read_rank=best: every slot scored once, the m best buckets by their best logit read",
        py::arg("query"), py::arg("own_k"), py::arg("own_v"), py::arg("own_ok"), py::arg("exact_k"), py::arg("exact_v"),
        py::arg("exact_ok"), py::arg("key_codes"), py::arg("key_scale"), py::arg("value_codes"), py::arg("value_scale"),
        py::arg("bias"), py::arg("mix"), py::arg("scaling"), py::arg("order"), py::arg("start"), py::arg("size"),
        py::arg("m"), py::arg("take"), py::arg("unit_keys") = py::none(), py::arg("unit_values") = py::none(),
        py::arg("unit_log_weight") = py::none(), py::arg("vectorised") = true);
  m.def("arm_partial_decode_read", &arm_partial_decode_read,
        "the decode read of read_rank=partial: the m best buckets by their best logit over the query's n largest key-code rows read",
        py::arg("query"), py::arg("own_k"), py::arg("own_v"), py::arg("own_ok"), py::arg("exact_k"), py::arg("exact_v"),
        py::arg("exact_ok"), py::arg("key_codes"), py::arg("key_scale"), py::arg("value_codes"), py::arg("value_scale"),
        py::arg("bias"), py::arg("mix"), py::arg("scaling"), py::arg("order"), py::arg("start"), py::arg("size"),
        py::arg("m"), py::arg("take"), py::arg("n"), py::arg("unit_keys") = py::none(), py::arg("unit_values") = py::none(),
        py::arg("unit_log_weight") = py::none(), py::arg("vectorised") = true);
  py::class_<DecodeCall>(m, "DecodeCall",
                         "a layer's fused decode read with the slots, the index and the entries bound, called with a step's token")
      .def(py::init<const std::string&, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                    const torch::Tensor&, const torch::Tensor&, const c10::optional<torch::Tensor>&,
                    const c10::optional<torch::Tensor>&, const c10::optional<torch::Tensor>&,
                    const c10::optional<torch::Tensor>&, const c10::optional<torch::Tensor>&, int64_t, int64_t,
                    const c10::optional<torch::Tensor>&, const c10::optional<torch::Tensor>&,
                    const c10::optional<torch::Tensor>&, bool, int64_t>(),
           py::arg("kind"), py::arg("key_codes"), py::arg("key_scale"), py::arg("value_codes"), py::arg("value_scale"),
           py::arg("bias"), py::arg("mix"), py::arg("order") = py::none(), py::arg("start") = py::none(),
           py::arg("size") = py::none(), py::arg("buckets") = py::none(), py::arg("take") = py::none(), py::arg("m") = 0,
           py::arg("n") = 0, py::arg("unit_keys") = py::none(), py::arg("unit_values") = py::none(),
           py::arg("unit_log_weight") = py::none(), py::arg("vectorised") = true, py::arg("max_runs") = -1)
      .def("__call__", &DecodeCall::call, "query, own_k, own_v, own_ok, exact_k, exact_v, exact_ok, scaling")
      .def("nbytes", &DecodeCall::nbytes, "bytes it keeps beside the index: each unit's runs of slots (none past max_runs)");
  m.def("ranked_slot_read", &ranked_slot_read,
        "a chunk's read of the slots of each query's m best units, from its logits of every slot: the softmax's unnormalised part",
        py::arg("logits"), py::arg("bias"), py::arg("values"), py::arg("order"), py::arg("start"), py::arg("size"), py::arg("m"),
        py::arg("vectorised") = true, py::arg("unit_logits") = py::none(), py::arg("unit_values") = py::none());
  m.def("unit_summaries", &unit_summaries, "each unit's count-weighted mean key and value and log total weight, from the codes",
        py::arg("key_codes"), py::arg("key_scale"), py::arg("value_codes"), py::arg("value_scale"), py::arg("bias"),
        py::arg("order"), py::arg("start"), py::arg("size"), py::arg("vectorised") = true, py::arg("todo") = py::none());
  m.def("bucket_lists", &bucket_lists, "the occupied slots of each group listed bucket by bucket (a counting sort), and the runs' breaks",
        py::arg("slot_bucket"), py::arg("occupied"), py::arg("nb"));
  m.def("group_leaf_topm", &group_leaf_topm, "the top-m buckets of each KV head's query group for one decoded token",
        py::arg("query"), py::arg("pos"), py::arg("inv_freq"), py::arg("rope_scaling"), py::arg("weight"), py::arg("read_bias"),
        py::arg("read_scale"), py::arg("paths"), py::arg("branching"), py::arg("m"));
  m.def("int4_unpack_pre_rope", &int4_unpack_pre_rope, "int4 slots to pre-RoPE float keys and float values");
  m.def("ring_push", &ring_push, "the decode step's push of one token a row into the ring window");
}
