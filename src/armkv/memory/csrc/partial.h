#pragma once

#include "runs.h"

namespace armkv {

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
