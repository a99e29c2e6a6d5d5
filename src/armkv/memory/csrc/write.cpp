// The write's passes over the pool, the slots unpacked to floats, and the window's ring push.

#include "bindings.h"
#include "write.h"

// key, value [G, S, d] float32 (value empty for "key"), order [G, S] int64 (bucket order),
// bucket [G, S] int64 (-1: free), width -> (nn_sim [G, S] float32, nn_idx [G, S] int64)
std::vector<torch::Tensor> band_neighbours(torch::Tensor key, torch::Tensor order, torch::Tensor bucket, int64_t width) {
  TORCH_CHECK(key.device().is_cpu() && key.scalar_type() == torch::kFloat32 && key.dim() == 3, "float32 CPU keys [G, S, d]");
  auto k = key.contiguous();
  auto o = order.to(torch::kInt64).contiguous();
  auto b = bucket.to(torch::kInt64).contiguous();
  const int64_t G = k.size(0), S = k.size(1), d = k.size(2);
  TORCH_CHECK(o.size(0) == G && o.size(1) == S && b.size(0) == G && b.size(1) == S, "order and bucket must be [G, S]");
  auto sim = torch::empty({G, S}, k.options());
  auto idx = torch::empty({G, S}, o.options());
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      armkv::band_neighbours_group(k.data_ptr<float>() + g * S * d, o.data_ptr<int64_t>() + g * S, b.data_ptr<int64_t>() + g * S, S, d, width,
                                   sim.data_ptr<float>() + g * S, idx.data_ptr<int64_t>() + g * S);
  });
  return {sim, idx};
}

namespace {

// Slots' codes to float keys and values [G, S, d] (write.unpack's loops): key codes uint8
// [G, d/2, S] (int4) or int8 [G, d, S], both channel-major, key scale [G, S, ngk], value
// codes uint8 [G, S, d/2], value scale [G, S, ngv]; cos and sin [G, S, d/2] un-rotate the
// keys (undefined: left as stored); mixed: multiply the vectors back by Q^T
std::vector<torch::Tensor> unpack_codes(const torch::Tensor& key_codes, const torch::Tensor& key_scale,
                                        const torch::Tensor& value_codes, const torch::Tensor& value_scale,
                                        const torch::Tensor& cos, const torch::Tensor& sin, bool mixed, double scaling) {
  auto kc = key_codes.contiguous();
  auto vc = value_codes.contiguous();
  auto ks = key_scale.to(torch::kFloat32).contiguous();
  auto vs = value_scale.to(torch::kFloat32).contiguous();
  TORCH_CHECK(kc.device().is_cpu() && vc.device().is_cpu(), "CPU codes only");
  const bool int8_keys = kc.scalar_type() == torch::kInt8;
  TORCH_CHECK((int8_keys || kc.scalar_type() == torch::kUInt8) && vc.scalar_type() == torch::kUInt8,
              "int4 (uint8) or int8 key codes and int4 value codes only");
  TORCH_CHECK(kc.dim() == 3 && vc.dim() == 3 && ks.dim() == 3 && vs.dim() == 3, "3-d tensors expected");
  const int64_t G = kc.size(0), S = kc.size(2), half = vc.size(2), d = 2 * half, rows = kc.size(1);
  const int64_t ngk = ks.size(2), ngv = vs.size(2);
  TORCH_CHECK(rows == (int8_keys ? d : half) && vc.size(0) == G && vc.size(1) == S && ks.size(0) == G && ks.size(1) == S &&
                  vs.size(0) == G && vs.size(1) == S && ngk > 0 && ngv > 0 && d % ngk == 0 && d % ngv == 0,
              "shapes do not match: key codes [G, d/2 or d, S], value codes [G, S, d/2], scales [G, S, n]");
  TORCH_CHECK(!mixed || (d & (d - 1)) == 0, "mixed slots need a power-of-two head dim (the Hadamard mixing)");
  torch::Tensor cs, sn;
  if (cos.defined()) {
    cs = cos.to(torch::kFloat32).contiguous();
    sn = sin.to(torch::kFloat32).contiguous();
    TORCH_CHECK(cs.dim() == 3 && cs.size(0) == G && cs.size(1) == S && cs.size(2) == half && sn.sizes() == cs.sizes(),
                "cos and sin must be [G, S, d/2]");
  }
  auto key = torch::empty({G, S, d}, ks.options());
  auto value = torch::empty({G, S, d}, ks.options());
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      armkv::unpack_slots(static_cast<const uint8_t*>(kc.data_ptr()) + g * rows * S, ks.data_ptr<float>() + g * S * ngk,
                          vc.data_ptr<uint8_t>() + g * S * half, vs.data_ptr<float>() + g * S * ngv,
                          cs.defined() ? cs.data_ptr<float>() + g * S * half : nullptr,
                          sn.defined() ? sn.data_ptr<float>() + g * S * half : nullptr, S, d, ngk, ngv, mixed,
                          static_cast<float>(1.0 / scaling), key.data_ptr<float>() + g * S * d,
                          value.data_ptr<float>() + g * S * d, int8_keys);
  });
  return {key, value};
}

}  // namespace

// int4 or int8 key codes, int4 value codes (see unpack_codes), cos and sin [G, S, d/2] ->
// (pre-RoPE keys, values) [G, S, d] float32, unmixed
std::vector<torch::Tensor> int4_unpack_pre_rope(torch::Tensor key_codes, torch::Tensor key_scale, torch::Tensor value_codes,
                                                torch::Tensor value_scale, torch::Tensor cos, torch::Tensor sin, bool mixed,
                                                double scaling) {
  return unpack_codes(key_codes, key_scale, value_codes, value_scale, cos, sin, mixed, scaling);
}

// k4v4 or k8v4 slots to float keys and values as stored (MemoryState.kv); unmix: multiply
// mixed vectors back by Q^T -> (keys, values) [G, S, d] float32
std::vector<torch::Tensor> int4_dequantise(torch::Tensor key_codes, torch::Tensor key_scale, torch::Tensor value_codes,
                                           torch::Tensor value_scale, bool unmix) {
  return unpack_codes(key_codes, key_scale, value_codes, value_scale, torch::Tensor(), torch::Tensor(), unmix, 1.0);
}

// cos [G, N, S] float32 (token-slot cosines), slot_bucket [G, S] (-1 or any negative: free),
// token_bucket [G, N] -> (same [G, N], same_idx [G, N], any [G, N], any_idx [G, N]): each token's
// best occupied slot of its own bucket and of any bucket (-inf, index 0 where none);
// vectorised=false: the portable loops (tests)
std::vector<torch::Tensor> best_slots(torch::Tensor cos, torch::Tensor slot_bucket, torch::Tensor token_bucket,
                                      bool vectorised) {
  TORCH_CHECK(cos.device().is_cpu() && cos.scalar_type() == torch::kFloat32 && cos.dim() == 3, "float32 CPU cosines [G, N, S]");
  auto c = cos.contiguous();
  const int64_t G = c.size(0), N = c.size(1), S = c.size(2);
  auto eb = slot_bucket.to(torch::kInt32).clamp_min(-1).contiguous();
  auto tb = token_bucket.to(torch::kInt32).contiguous();
  TORCH_CHECK(eb.dim() == 2 && eb.size(0) == G && eb.size(1) == S, "slot_bucket must be [G, S]");
  TORCH_CHECK(tb.dim() == 2 && tb.size(0) == G && tb.size(1) == N, "token_bucket must be [G, N]");
  auto same = torch::empty({G, N}, c.options()), any = torch::empty({G, N}, c.options());
  auto same_idx = torch::empty({G, N}, c.options().dtype(torch::kInt64)), any_idx = torch::empty_like(same_idx);
  const float* C = c.data_ptr<float>();
  const int32_t *E = eb.data_ptr<int32_t>(), *T = tb.data_ptr<int32_t>();
  float *SM = same.data_ptr<float>(), *AN = any.data_ptr<float>();
  int64_t *SI = same_idx.data_ptr<int64_t>(), *AI = any_idx.data_ptr<int64_t>();
  at::parallel_for(0, G * N, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t g = r / N;
      armkv::best_slots_row(C + r * S, E + g * S, T[r] < 0 ? -2 : T[r], S, SM + r, SI + r, AN + r, AI + r, vectorised);
    }
  });
  return {same, same_idx, any, any_idx};
}

// tokens [G, N, d] and slots [G, S, d] float32, slot_bucket [G, S] (negative: free),
// token_bucket [G, N] -> (best [G, N] float32, idx [G, N] int64): each token's most similar
// occupied slot of its own bucket (-inf, 0 where none); vectorised=false: the portable loop
std::vector<torch::Tensor> bucket_best_slots(torch::Tensor tokens, torch::Tensor slots, torch::Tensor slot_bucket,
                                             torch::Tensor token_bucket, bool vectorised) {
  TORCH_CHECK(tokens.device().is_cpu() && tokens.scalar_type() == torch::kFloat32 && tokens.dim() == 3, "float32 CPU tokens [G, N, d]");
  TORCH_CHECK(slots.device().is_cpu() && slots.scalar_type() == torch::kFloat32 && slots.dim() == 3, "float32 CPU slots [G, S, d]");
  auto x = tokens.contiguous(), k = slots.contiguous();
  const int64_t G = x.size(0), N = x.size(1), d = x.size(2), S = k.size(1);
  TORCH_CHECK(k.size(0) == G && k.size(2) == d, "slots must be [G, S, d] with the tokens' G and d");
  auto sb = slot_bucket.to(torch::kInt32).contiguous(), tb = token_bucket.to(torch::kInt32).contiguous();
  TORCH_CHECK(sb.dim() == 2 && sb.size(0) == G && sb.size(1) == S, "slot_bucket must be [G, S]");
  TORCH_CHECK(tb.dim() == 2 && tb.size(0) == G && tb.size(1) == N, "token_bucket must be [G, N]");
  auto best = torch::empty({G, N}, x.options());
  auto idx = torch::empty({G, N}, x.options().dtype(torch::kInt64));
  bool avx = false;
#ifdef ARMKV_AVX2
  avx = vectorised && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      auto call = [&](auto fn) {
        fn(x.data_ptr<float>() + g * N * d, k.data_ptr<float>() + g * S * d, sb.data_ptr<int32_t>() + g * S,
           tb.data_ptr<int32_t>() + g * N, N, S, d, best.data_ptr<float>() + g * N, idx.data_ptr<int64_t>() + g * N);
      };
      if (avx) call(armkv::bucket_best_group<true>);
      else call(armkv::bucket_best_group<false>);
    }
  });
  return {best, idx};
}

// The decode step's push of one token a row into the ring window (ExactBuffer._push_one, its
// window part; the PyTorch form there is the reference): win_k, win_v [B, H, W, d] (any strides
// but a contiguous last dimension: views into the buffer), win_valid, win_pos [B, W], head [B]
// int64 (each row's oldest entry); key, value [B, H, 1, d], valid [B] bool, pos [B] int64. Each
// valid row's oldest entry leaves and the token takes its place; an invalid row changes nothing.
// Returns (key, value [B, H, 1, d]: the entries that left, zero where none did; leaves [B, 1];
// their positions [B, 1]). Rows are copied as bytes, so any dtype serves. In PyTorch this is
// some twenty small ops per layer and step.
std::vector<torch::Tensor> ring_push(torch::Tensor win_k, torch::Tensor win_v, torch::Tensor win_valid, torch::Tensor win_pos,
                                     torch::Tensor head, torch::Tensor key, torch::Tensor value, torch::Tensor valid,
                                     torch::Tensor pos) {
  TORCH_CHECK(win_k.device().is_cpu() && win_k.dim() == 4 && win_v.sizes() == win_k.sizes() && win_k.stride(3) == 1 &&
                  win_v.stride(3) == 1 && win_v.scalar_type() == win_k.scalar_type(),
              "ring_push: CPU windows [B, H, W, d] with contiguous rows");
  const int64_t B = win_k.size(0), H = win_k.size(1), W = win_k.size(2), d = win_k.size(3);
  TORCH_CHECK(W > 0 && win_valid.scalar_type() == torch::kBool && win_valid.dim() == 2 && win_valid.size(0) == B &&
                  win_valid.size(1) == W && win_pos.scalar_type() == torch::kInt64 && win_pos.sizes() == win_valid.sizes() &&
                  head.scalar_type() == torch::kInt64 && head.dim() == 1 && head.size(0) == B && head.is_contiguous(),
              "ring_push: win_valid [B, W] bool, win_pos [B, W] int64, head [B] contiguous int64");
  auto k = key.contiguous(), v = value.contiguous();
  auto ok = valid.to(torch::kBool).contiguous(), p = pos.to(torch::kInt64).contiguous();
  TORCH_CHECK(k.scalar_type() == win_k.scalar_type() && v.scalar_type() == win_k.scalar_type() && k.dim() == 4 &&
                  k.size(0) == B && k.size(1) == H && k.size(2) == 1 && k.size(3) == d && v.sizes() == k.sizes() &&
                  ok.numel() == B && p.numel() == B,
              "ring_push: key, value [B, H, 1, d] of the window's dtype, valid [B], pos [B]");
  auto old_k = torch::zeros_like(k), old_v = torch::zeros_like(v);
  auto leaves = torch::empty({B, 1}, ok.options()), old_pos = torch::empty({B, 1}, p.options());
  const int64_t row = d * static_cast<int64_t>(win_k.element_size());
  char *WK = static_cast<char*>(win_k.data_ptr()), *WV = static_cast<char*>(win_v.data_ptr());
  const char *K = static_cast<const char*>(k.data_ptr()), *V = static_cast<const char*>(v.data_ptr());
  char *OK_ = static_cast<char*>(old_k.data_ptr()), *OV = static_cast<char*>(old_v.data_ptr());
  const int64_t esz = win_k.element_size();
  bool* WVAL = win_valid.data_ptr<bool>();
  int64_t* WPOS = win_pos.data_ptr<int64_t>();
  int64_t* HEAD = head.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t at = HEAD[b];
    TORCH_CHECK(at >= 0 && at < W, "ring_push: head out of the window");
    bool& slot_valid = WVAL[b * win_valid.stride(0) + at * win_valid.stride(1)];
    int64_t& slot_pos = WPOS[b * win_pos.stride(0) + at * win_pos.stride(1)];
    const bool in = ok.data_ptr<bool>()[b], out = slot_valid && in;
    leaves.data_ptr<bool>()[b] = out;
    old_pos.data_ptr<int64_t>()[b] = slot_pos;
    for (int64_t h = 0; h < H; ++h) {
      char* wk = WK + (b * win_k.stride(0) + h * win_k.stride(1) + at * win_k.stride(2)) * esz;
      char* wv = WV + (b * win_v.stride(0) + h * win_v.stride(1) + at * win_v.stride(2)) * esz;
      if (out) {
        std::memcpy(OK_ + (b * H + h) * row, wk, row);
        std::memcpy(OV + (b * H + h) * row, wv, row);
      }
      if (in) {
        std::memcpy(wk, K + (b * H + h) * row, row);
        std::memcpy(wv, V + (b * H + h) * row, row);
      }
    }
    if (in) {
      slot_valid = true;
      slot_pos = p.data_ptr<int64_t>()[b];
      HEAD[b] = (at + 1) % W;
    }
  }
  return {old_k, old_v, leaves, old_pos};
}

void bind_write(pybind11::module_& m) {
  m.def("int4_dequantise", &int4_dequantise, "k4v4 slots to float keys and values as stored, optionally unmixed");
  m.def("best_slots", &best_slots, "each token's best occupied slot of its bucket and of any bucket, from the cosines",
        py::arg("cos"), py::arg("slot_bucket"), py::arg("token_bucket"), py::arg("vectorised") = true);
  m.def("bucket_best_slots", &bucket_best_slots, "each token's most similar occupied slot of its own bucket (cosine)",
        py::arg("tokens"), py::arg("slots"), py::arg("slot_bucket"), py::arg("token_bucket"), py::arg("vectorised") = true);
  m.def("band_neighbours", &band_neighbours, "each slot's nearest same-bucket slot within a band in bucket order");
  m.def("int4_unpack_pre_rope", &int4_unpack_pre_rope, "int4 slots to pre-RoPE float keys and float values");
  m.def("ring_push", &ring_push, "the decode step's push of one token a row into the ring window");
}
