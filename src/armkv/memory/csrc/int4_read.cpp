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
#include <cstdint>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define ARMKV_AVX2 1
#endif

namespace armkv {

constexpr int kMaxRep = 16;  // query heads per KV head handled by the kernels

inline float low_nibble(uint8_t b) { int v = static_cast<int8_t>(b); return static_cast<float>(((v - ((v >> 4) << 4)) ^ 8) - 8); }
inline float high_nibble(uint8_t b) { return static_cast<float>(static_cast<int8_t>(b) >> 4); }

// ---------------------------------------------------------------- portable reference loops
// scores [R, S] = per group sum of q . codes, times the group's scale (codes [d/2, S] channel-major);
// slots from `first` on
inline void key_scores_scalar(const float* q, const uint8_t* codes, const float* scale, float* out, int64_t R,
                              int64_t d, int64_t S, int64_t ng, int64_t first = 0) {
  const int64_t half = d / 2, gs = d / ng;
  for (int64_t s = first; s < S; ++s) {
    for (int64_t r = 0; r < R; ++r) {
      float total = 0.0f;
      for (int64_t g = 0; g < ng; ++g) {
        float part = 0.0f;
        for (int64_t ch = g * gs; ch < (g + 1) * gs; ++ch) {
          const uint8_t b = codes[(ch % half) * S + s];
          part += q[r * d + ch] * (ch < half ? low_nibble(b) : high_nibble(b));
        }
        total += part * scale[s * ng + g];
      }
      out[r * S + s] = total;
    }
  }
}

// out [R, d] = sum_s w[r, s] * scale[s, group] * code[s, ch] (codes [S, d/2])
inline void weighted_values_scalar(const float* w, const uint8_t* codes, const float* scale, float* out, int64_t R,
                                   int64_t d, int64_t S, int64_t ng) {
  const int64_t half = d / 2, gs = d / ng;
  std::fill(out, out + R * d, 0.0f);
  for (int64_t s = 0; s < S; ++s)
    for (int64_t r = 0; r < R; ++r) {
      const float wr = w[r * S + s];
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
  const __m256i h = _mm256_srai_epi32(v, 4);
  const __m256i l = _mm256_sub_epi32(_mm256_xor_si256(_mm256_sub_epi32(v, _mm256_slli_epi32(h, 4)), _mm256_set1_epi32(8)),
                                     _mm256_set1_epi32(8));
  hi = _mm256_cvtepi32_ps(h);
  lo = _mm256_cvtepi32_ps(l);
}

// key scores for slots [s0, s0 + 8) (all present), groups that do not straddle the halves
__attribute__((target("avx2,fma"))) inline void key_scores_block8(const float* q, const uint8_t* codes, const float* scale,
                                                                  float* out, int64_t R, int64_t d, int64_t S, int64_t ng,
                                                                  int64_t s0) {
  const int64_t half = d / 2, gs = d / ng, seg = std::min(gs, half);
  __m256 res[kMaxRep];
  for (int64_t r = 0; r < R; ++r) res[r] = _mm256_setzero_ps();
  for (int64_t c0 = 0; c0 < half; c0 += seg) {
    __m256 alo[kMaxRep], ahi[kMaxRep];
    for (int64_t r = 0; r < R; ++r) alo[r] = ahi[r] = _mm256_setzero_ps();
    for (int64_t c = c0; c < c0 + seg; ++c) {
      __m256 lo, hi;
      decode8(codes + c * S + s0, lo, hi);
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
  for (int64_t r = 0; r < R; ++r) _mm256_storeu_ps(out + r * S + s0, res[r]);
}

__attribute__((target("avx2,fma"))) inline void key_scores_avx2(const float* q, const uint8_t* codes, const float* scale,
                                                                float* out, int64_t R, int64_t d, int64_t S, int64_t ng) {
  const int64_t full = S / 8 * 8;
  for (int64_t s0 = 0; s0 < full; s0 += 8) key_scores_block8(q, codes, scale, out, R, d, S, ng, s0);
  key_scores_scalar(q, codes, scale, out, R, d, S, ng, full);  // the last S % 8 slots
}

// weighted values, channels in blocks of 8 bytes (16 channels), accumulators in registers
__attribute__((target("avx2,fma"))) inline void weighted_values_avx2(const float* w, const uint8_t* codes, const float* scale,
                                                                     float* out, int64_t R, int64_t d, int64_t S, int64_t ng) {
  const int64_t half = d / 2, gs = d / ng;
  for (int64_t c0 = 0; c0 < half; c0 += 8) {
    __m256 alo[kMaxRep], ahi[kMaxRep];
    for (int64_t r = 0; r < R; ++r) alo[r] = ahi[r] = _mm256_setzero_ps();
    const int64_t glo = c0 / gs, ghi = (c0 + half) / gs;
    for (int64_t s = 0; s < S; ++s) {
      __m256 lo, hi;
      decode8(codes + s * half + c0, lo, hi);
      const float sl = scale[s * ng + glo], sh = scale[s * ng + ghi];
      for (int64_t r = 0; r < R; ++r) {
        const float wr = w[r * S + s];
        alo[r] = _mm256_fmadd_ps(_mm256_set1_ps(wr * sl), lo, alo[r]);
        ahi[r] = _mm256_fmadd_ps(_mm256_set1_ps(wr * sh), hi, ahi[r]);
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      _mm256_storeu_ps(out + r * d + c0, alo[r]);
      _mm256_storeu_ps(out + r * d + half + c0, ahi[r]);
    }
  }
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

inline void key_scores(const float* q, const uint8_t* codes, const float* scale, float* out, int64_t R, int64_t d,
                       int64_t S, int64_t ng) {
#ifdef ARMKV_AVX2
  if (use_avx2(R, d, ng)) return key_scores_avx2(q, codes, scale, out, R, d, S, ng);
#endif
  key_scores_scalar(q, codes, scale, out, R, d, S, ng);
}

inline void weighted_values(const float* w, const uint8_t* codes, const float* scale, float* out, int64_t R, int64_t d,
                            int64_t S, int64_t ng) {
#ifdef ARMKV_AVX2
  if (use_avx2(R, d, ng)) return weighted_values_avx2(w, codes, scale, out, R, d, S, ng);
#endif
  weighted_values_scalar(w, codes, scale, out, R, d, S, ng);
}

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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_key_scores", &int4_key_scores, "query . int4 slot keys (channel-major codes), each group's scale applied");
  m.def("int4_weighted_values", &int4_weighted_values, "weights @ int4 slot values, each group's scale applied");
  m.def("int4_vectorised", &int4_vectorised, "whether the AVX2 loops serve these sizes on this CPU");
}
