// An index's units: the bucket lists (a counting sort) and each unit's summary entry.

#include "bindings.h"
#include "inputs.h"

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

void bind_index(pybind11::module_& m) {
  m.def("unit_summaries", &unit_summaries, "each unit's count-weighted mean key and value and log total weight, from the codes",
        py::arg("key_codes"), py::arg("key_scale"), py::arg("value_codes"), py::arg("value_scale"), py::arg("bias"),
        py::arg("order"), py::arg("start"), py::arg("size"), py::arg("vectorised") = true, py::arg("todo") = py::none());
  m.def("bucket_lists", &bucket_lists, "the occupied slots of each group listed bucket by bucket (a counting sort), and the runs' breaks",
        py::arg("slot_bucket"), py::arg("occupied"), py::arg("nb"));
}
