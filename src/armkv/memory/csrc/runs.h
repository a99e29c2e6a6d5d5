#pragma once

#include "decode.h"

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

}  // namespace armkv
