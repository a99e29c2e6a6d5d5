// A chunk's ranked read of the slots of each query's best units.

#include "bindings.h"
#include "chunk.h"

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

void bind_chunk(pybind11::module_& m) {
  m.def("ranked_slot_read", &ranked_slot_read,
        "a chunk's read of the slots of each query's m best units, from its logits of every slot: the softmax's unnormalised part",
        py::arg("logits"), py::arg("bias"), py::arg("values"), py::arg("order"), py::arg("start"), py::arg("size"), py::arg("m"),
        py::arg("vectorised") = true, py::arg("unit_logits") = py::none(), py::arg("unit_values") = py::none());
}
