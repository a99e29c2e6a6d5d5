// The decode reads of one layer (dense, sparse, best, partial) and their bound DecodeCall; the tree's routing of one token.

#include "bindings.h"
#include "inputs.h"
#include "partial.h"

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
// (Reader: the ReadView keeps it). kind: "dense" (arm_decode_read), "sparse" (arm_sparse_decode_read),
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

// The decode step's read of one layer (Reader.dense): query [G, R, d] float32;
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

// The sparse decode read (Reader.sparse, one query): arm_decode_read over only the
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

// The decode read of read_rank="partial" (Reader.sparse, one query): each group's
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

// The decode read of read_rank="best" in one call (Reader.sparse, one query): every
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

void bind_decode(pybind11::module_& m) {
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
  m.def("group_leaf_topm", &group_leaf_topm, "the top-m buckets of each KV head's query group for one decoded token",
        py::arg("query"), py::arg("pos"), py::arg("inv_freq"), py::arg("rope_scaling"), py::arg("weight"), py::arg("read_bias"),
        py::arg("read_scale"), py::arg("paths"), py::arg("branching"), py::arg("m"));
}
