// Query . slot keys and weights @ slot values from the codes (the decode read's parts, for tests and the PyTorch reference).

#include "bindings.h"
#include "scores.h"

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

void bind_ops(pybind11::module_& m) {
  m.def("int4_key_scores", &int4_key_scores, "query . int4 slot keys (channel-major codes), each group's scale applied");
  m.def("int8_key_scores", &int8_key_scores, "query . int8 slot keys (channel-major codes), each slot's scale applied");
  m.def("int4_weighted_values", &int4_weighted_values, "weights @ int4 slot values, each group's scale applied");
  m.def("int4_vectorised", &int4_vectorised, "whether the AVX2 loops serve these sizes on this CPU");
}
