#pragma once

#include "decode.h"

namespace armkv {

// ---------------------------------------------------------------- the write's passes over the pool
// A write (SlotPool.write) needs every slot as pre-RoPE floats and, when the pool is full,
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
__attribute__((target("avx2,fma"))) inline void best_slots_row_avx2(const float* cos, const int32_t* eligible, int32_t bucket,
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
__attribute__((target("avx2,fma"))) inline void unpack_slots_avx2(ARMKV_UNPACK_ARGS) { unpack_slots_body(ARMKV_UNPACK_CALL); }
#endif
inline void unpack_slots_baseline(ARMKV_UNPACK_ARGS) { unpack_slots_body(ARMKV_UNPACK_CALL); }
inline void unpack_slots(ARMKV_UNPACK_ARGS) {
#ifdef ARMKV_AVX2
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return unpack_slots_avx2(ARMKV_UNPACK_CALL);
#endif
  unpack_slots_baseline(ARMKV_UNPACK_CALL);
}

}  // namespace armkv
