#pragma once

#include "runs.h"

// The per-token inputs of a layer's decode read: the query, the new token and the exact
// entries, in the model's layout (query [B, Hq, 1, d], own_k and own_v [B, H, 1, d], own_ok
// [B, T], exact_k and exact_v [B, H, L, d], exact_ok [B, L]) or flat by group (query [G, R, d],
// own_k and own_v [G, d], own_ok [G], exact_k and exact_v [G, L, d], exact_ok [G, L]); group
// g = b H + h. Read where they lie, with no tensor op, where each group's rows are contiguous
// (as the model's are); the others are copied.
struct Tokens {
  torch::Tensor q, kk, vv, ok, ek, ev, eok;  // (the inputs, or their contiguous copies)
  bool model = false;                         // the model's layout: the output in it too
  int64_t B = 0, H = 1, R = 0, L = 0;
  const float *Q = nullptr, *K = nullptr, *V = nullptr, *EK = nullptr, *EV = nullptr;
  const bool *OK = nullptr, *EOK = nullptr;
  int64_t qb = 0, qh = 0, kb = 0, kh = 0, vb = 0, vh = 0, okb = 0, eb = 0, eh = 0, evb = 0, evh = 0, eokb = 0;

  Tokens(const torch::Tensor& query, const torch::Tensor& own_k, const torch::Tensor& own_v, const torch::Tensor& own_ok,
         const torch::Tensor& exact_k, const torch::Tensor& exact_v, const torch::Tensor& exact_ok, int64_t G, int64_t d,
         const char* name)
      : q(query), kk(own_k), vv(own_v), ok(own_ok), ek(exact_k), ev(exact_v), eok(exact_ok), model(query.dim() == 4) {
    const int64_t x = model ? 1 : 0;  // (the model's layout has a head dimension more before the exact entries)
    if (model) {
      TORCH_CHECK(q.size(2) == 1 && kk.dim() == 4 && vv.dim() == 4 && ek.dim() == 4 && ev.dim() == 4 && ok.dim() == 2 &&
                      eok.dim() == 2 && kk.size(1) > 0 && q.size(1) % kk.size(1) == 0 && ok.size(1) >= 1,
                  name, ": query [B, Hq, 1, d], the token's key and value [B, H, 1, d], its valid [B, T], exact [B, H, L, d], "
                  "exact valid [B, L]");
      B = q.size(0), H = kk.size(1), R = q.size(1) / H, L = ek.size(2);
      TORCH_CHECK(kk.size(0) == B && kk.size(2) == 1 && vv.sizes() == kk.sizes() && ok.size(0) == B && ek.size(0) == B &&
                      ek.size(1) == H && ev.sizes() == ek.sizes() && eok.size(0) == B && eok.size(1) == L,
                  name, ": the token's inputs do not match (see the comment above arm_decode_read)");
    } else {
      TORCH_CHECK(q.dim() == 3 && kk.dim() == 2 && vv.dim() == 2 && ok.dim() == 1 && ek.dim() == 3 && ev.dim() == 3 &&
                      eok.dim() == 2,
                  name, ": query [G, R, d], own_k and own_v [G, d], own_ok [G], exact [G, L, d], exact valid [G, L]");
      B = q.size(0), R = q.size(1), L = ek.size(1);
      TORCH_CHECK(kk.size(0) == B && vv.sizes() == kk.sizes() && ok.size(0) == B && ek.size(0) == B && ev.sizes() == ek.sizes() &&
                      eok.size(0) == B && eok.size(1) == L,
                  name, ": the token's inputs do not match (see the comment above arm_decode_read)");
    }
    TORCH_CHECK(q.scalar_type() == torch::kFloat32 && kk.scalar_type() == torch::kFloat32 && vv.scalar_type() == torch::kFloat32 &&
                    ek.scalar_type() == torch::kFloat32 && ev.scalar_type() == torch::kFloat32,
                name, ": float32 queries, keys and values only");
    TORCH_CHECK(B * H == G && q.size(-1) == d && kk.size(-1) == d && ek.size(-1) == d, name,
                ": shapes do not match (see the comment above arm_decode_read)");
    TORCH_CHECK(R <= armkv::kMaxRep, name, ": at most 16 query heads a KV head");
    // a group's rows contiguous (its R query heads, its L exact entries), else a copy
    const auto rows = [](torch::Tensor& t, int64_t row_dim, int64_t n) {
      if (t.stride(-1) != 1 || (n > 1 && t.stride(row_dim) != t.size(-1))) t = t.contiguous();
    };
    rows(q, 1, R), rows(kk, -1, 1), rows(vv, -1, 1), rows(ek, 1 + x, L), rows(ev, 1 + x, L);
    if (ok.scalar_type() != torch::kBool) ok = ok.to(torch::kBool);
    if (eok.scalar_type() != torch::kBool) eok = eok.to(torch::kBool);
    if (L > 1 && eok.stride(1) != 1) eok = eok.contiguous();
    Q = q.data_ptr<float>(), K = kk.data_ptr<float>(), V = vv.data_ptr<float>(), EK = ek.data_ptr<float>(),
    EV = ev.data_ptr<float>(), OK = ok.data_ptr<bool>(), EOK = eok.data_ptr<bool>();
    qb = q.stride(0), qh = model ? R * q.stride(1) : 0, kb = kk.stride(0), kh = model ? kk.stride(1) : 0;
    vb = vv.stride(0), vh = model ? vv.stride(1) : 0, okb = ok.stride(0), eb = ek.stride(0), eh = model ? ek.stride(1) : 0;
    evb = ev.stride(0), evh = model ? ev.stride(1) : 0, eokb = eok.stride(0);
  }

  // the read's output: [G, R, d], or in the model's layout [B, 1, Hq, d] (the same memory)
  torch::Tensor empty_out(int64_t d) const {
    const auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
    return model ? torch::empty({B, 1, H * R, d}, f32) : torch::empty({B, R, d}, f32);
  }
};

// The slots' inputs of a layer's decode read, checked and converted once: a decode step's
// bound call (DecodeCall) keeps them from one write to the next.
struct DecodeInputs {
  torch::Tensor kc, ks, vc, vs, b, mx, mxt;
  bool int8_keys;
  int64_t G, d, S, ngk, ngv;
  const float* MX;
  const float* MXT;

  DecodeInputs(const torch::Tensor& key_codes, const torch::Tensor& key_scale, const torch::Tensor& value_codes,
               const torch::Tensor& value_scale, const torch::Tensor& bias, const torch::Tensor& mix, const char* name) {
    TORCH_CHECK(key_codes.dim() == 3 && value_codes.dim() == 3 && key_scale.dim() == 3 && value_scale.dim() == 3 &&
                    (bias.dim() == 2 || bias.dim() == 3),
                name, ": key codes, value codes and scales [G, ., .], bias [G, S] or [B, H, S]");
    kc = rows_apart(key_codes, 0), vc = rows_apart(value_codes, value_codes.size(-1));
    ks = rows_apart(as_stored(key_scale), key_scale.size(-1)), vs = rows_apart(as_stored(value_scale), value_scale.size(-1));
    b = (bias.dim() == 3 ? bias.reshape({bias.size(0) * bias.size(1), bias.size(2)}) : bias).to(torch::kFloat32).contiguous();
    mx = mix.numel() ? mix.to(torch::kFloat32).contiguous() : mix;
    TORCH_CHECK(vc.scalar_type() == torch::kUInt8, name, ": int4 value codes only");
    int8_keys = kc.scalar_type() == torch::kInt8;
    TORCH_CHECK(int8_keys || kc.scalar_type() == torch::kUInt8, name, ": int4 (uint8) or int8 key codes only");
    G = kc.size(0), d = 2 * vc.size(2), S = b.size(1), ngk = ks.size(2), ngv = vs.size(2);
    TORCH_CHECK(d > 0 && ngk > 0 && ngv > 0 && kc.size(1) == (int8_keys ? d : d / 2) && kc.size(2) == S && ks.size(0) == G &&
                    ks.size(1) == S && vc.size(0) == G && vc.size(1) == S && vs.size(0) == G && vs.size(1) == S &&
                    b.size(0) == G && d % ngk == 0 && d % ngv == 0 && (!int8_keys || ngk == 1) &&
                    (!mx.numel() || (mx.size(0) == d && mx.size(1) == d)),
                name, ": shapes do not match (see the comment above arm_decode_read)");
    mxt = mx.numel() ? mx.t().contiguous() : mx;
    MX = mx.numel() ? mx.data_ptr<float>() : nullptr;
    MXT = mx.numel() ? mxt.data_ptr<float>() : nullptr;
  }

  // read_summaries (read.unit_summaries): each unit's entry, keys and values [G, U, d] float32 in
  // the slots' basis and log weights [G, U], U the units of the read's index (nb); all three or none
  torch::Tensor uk, uv, ulw;
  int64_t U = 0;

  void set_units(const c10::optional<torch::Tensor>& keys, const c10::optional<torch::Tensor>& values,
                 const c10::optional<torch::Tensor>& log_weight, int64_t nb, const char* name) {
    TORCH_CHECK(keys.has_value() == values.has_value() && keys.has_value() == log_weight.has_value(), name,
                ": unit_keys, unit_values and unit_log_weight come together");
    if (!keys.has_value()) return;
    uk = keys->to(torch::kFloat32).contiguous(), uv = values->to(torch::kFloat32).contiguous();
    ulw = log_weight->to(torch::kFloat32).contiguous();
    TORCH_CHECK(uk.dim() == 3 && uk.size(0) == G && uk.size(1) == nb && uk.size(2) == d && uv.sizes() == uk.sizes() &&
                    ulw.dim() == 2 && ulw.size(0) == G && ulw.size(1) == nb,
                name, ": unit_keys and unit_values [G, U, d], unit_log_weight [G, U], U the index's units");
    U = nb;
  }

  // group g's unit entries (empty where there are none), w its [R, U] scratch; skip and qm are the caller's
  armkv::UnitEntries units(int64_t g, int64_t R, std::vector<float>& w) const {
    armkv::UnitEntries e;
    if (!U) return e;
    w.resize(R * U);
    e.k = uk.data_ptr<float>() + g * U * d, e.v = uv.data_ptr<float>() + g * U * d, e.lw = ulw.data_ptr<float>() + g * U;
    e.w = w.data(), e.U = U;
    return e;
  }

  // scales float32 or bfloat16 as they are (each read converts the rows it reads), others float32
  static torch::Tensor as_stored(const torch::Tensor& x) {
    const auto t = x.scalar_type();
    return t == torch::kFloat32 || t == torch::kBFloat16 ? x : x.to(torch::kFloat32);
  }

  // x [G, rows, cols] as it lies where its last dimension is contiguous and, unless row is 0,
  // its rows are `row` elements apart, else a contiguous copy: a pool's first S slots (a view
  // of a larger pool, SlotPool.readable) are read in place, not copied at every read
  static torch::Tensor rows_apart(const torch::Tensor& x, int64_t row) {
    const bool fits = x.dim() == 3 && x.stride(2) == 1 && x.stride(1) >= x.size(2) && (row == 0 || x.stride(1) == row);
    return fits ? x : x.contiguous();
  }

  // group g's [S, ng] table of scales
  static armkv::Scales scales(const torch::Tensor& x, int64_t g, int64_t ng) {
    armkv::Scales out;
    out.ng = ng;
    if (x.scalar_type() == torch::kFloat32)
      out.f32 = x.data_ptr<float>() + g * x.stride(0);
    else
      out.bf16 = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) + g * x.stride(0);
    return out;
  }

  // group g's inputs: its query, token and exact entries (t), and its pool
  armkv::DecodeGroup group(const Tokens& t, int64_t g, float* out) const {
    const int64_t i = g / t.H, h = g % t.H;  // (batch row, KV head)
    return armkv::DecodeGroup{
        t.Q + i * t.qb + h * t.qh, t.K + i * t.kb + h * t.kh, t.V + i * t.vb + h * t.vh, t.OK[i * t.okb],
        t.EK + i * t.eb + h * t.eh, t.EV + i * t.evb + h * t.evh, t.EOK + i * t.eokb,
        int8_keys ? static_cast<const void*>(kc.data_ptr<int8_t>() + g * kc.stride(0))
                  : static_cast<const void*>(kc.data_ptr<uint8_t>() + g * kc.stride(0)),
        kc.stride(1), scales(ks, g, ngk), vc.data_ptr<uint8_t>() + g * vc.stride(0), scales(vs, g, ngv),
        b.data_ptr<float>() + g * S, out};
  }
};
