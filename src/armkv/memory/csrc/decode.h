#pragma once

#include "scores.h"

namespace armkv {

// ---------------------------------------------------------------- the whole decode-step read
// One new token of one KV head group (Reader.dense): its R query heads over the
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

}  // namespace armkv
