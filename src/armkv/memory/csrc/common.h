#pragma once

// Fused CPU kernels of armkv (built on first use by armkv.memory.kernels with
// torch.utils.cpp_extension, every .cpp of this folder as one extension, named by the hash of
// the whole folder). The loops live in headers by concern, each included where it is used:
//   common.h   the includes, the AVX2 dispatch and the int4 nibbles
//   scores.h   int4 / int8 key scores and int4 weighted values (portable and AVX2 loops)
//   decode.h   one group's decode read: the softmax over slots, exact entries and the token
//   runs.h     the slots of chosen units read run by run; the ranking of units by best logit
//   chunk.h    a chunk's ranked read of each query's best units
//   partial.h  read_rank="partial": the ranking from a few key-code rows
//   write.h    the write's passes over the pool (neighbours, best slots, unpacking)
//   inputs.h   a decode read's inputs as tensors (Tokens, DecodeInputs)
// and the PyTorch functions in sources by concern: ops.cpp (key scores, weighted values),
// decode.cpp (the decode reads and their bound DecodeCall, the tree's routing of a token),
// chunk.cpp (ranked_slot_read), index.cpp (bucket lists, unit summaries), write.cpp (the
// write's passes, unpacking, the window's ring push), module.cpp (the Python module).
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
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define ARMKV_AVX2 1
#endif

namespace armkv {

constexpr int kMaxRep = 16;  // query heads per KV head handled by the kernels
// how far ahead in a channel row the key loops prefetch (bytes = slots): measured on the
// decode read of cold slots, 256 and 512 alike, 1,024 no better than none
constexpr int64_t kPrefetchAhead = 256;

// name(ARGS, vectorised): name##_body<true> compiled for AVX2 and FMA where the CPU has them and
// `vectorised` (false: the portable loops, for tests), else name##_body<false>
#ifdef ARMKV_AVX2
#define ARMKV_DISPATCH(name, ARGS, CALL)                                                              \
  __attribute__((target("avx2,fma"))) inline void name##_avx2(ARGS) { name##_body<true>(CALL); }    \
  inline void name##_baseline(ARGS) { name##_body<false>(CALL); }                                   \
  inline void name(ARGS, bool vectorised) {                                                         \
    if (vectorised && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return name##_avx2(CALL); \
    name##_baseline(CALL);                                                                          \
  }
#else
#define ARMKV_DISPATCH(name, ARGS, CALL)                                                              \
  inline void name##_baseline(ARGS) { name##_body<false>(CALL); }                                   \
  inline void name(ARGS, bool) { name##_baseline(CALL); }
#endif

inline float low_nibble(uint8_t b) { int v = static_cast<int8_t>(b); return static_cast<float>(((v - ((v >> 4) << 4)) ^ 8) - 8); }
inline float high_nibble(uint8_t b) { return static_cast<float>(static_cast<int8_t>(b) >> 4); }

#ifdef ARMKV_AVX2
// the sum of the eight lanes (the write's dots and the runs' maxima)
__attribute__((target("avx2,fma"))) inline float hsum_avx2(__m256 acc) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  h = _mm_hadd_ps(h, h);
  h = _mm_hadd_ps(h, h);
  return _mm_cvtss_f32(h);
}
#endif

}  // namespace armkv
