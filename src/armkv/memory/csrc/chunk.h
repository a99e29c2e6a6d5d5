#pragma once

#include "runs.h"

namespace armkv {

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

}  // namespace armkv
