// Counter-based random numbers for sampling: the plain C++ launcher API (no torch types).
//
//   random_uniform   rows of numbers in (0, 1), or Gumbel(0, 1) noise made from them, element i
//                    of row r a function of (keys[r], i) alone
//
// One launch draws every sampled row of a step, each from its own key, so a seeded request
// draws the same numbers whatever rows are beside it (a generator per row would cost a
// launch per row). For element i of row r (unsigned 64-bit arithmetic, wrapping):
//   x = mix(keys[r] + (i + 1) * 0x9E3779B97F4A7C15)   (a Weyl sequence through splitmix64's
//   mix(z): z ^= z >> 30; z *= 0xBF58476D1CE4E5B9;      output function: distinct keys give
//           z ^= z >> 27; z *= 0x94D049BB133111EB;      streams that do not overlap in practice)
//           z ^= z >> 31
//   u = ((x >> 41) + 0.5) * 2^-23                      (fp32, exact: 24 bits, never 0 or 1)
//   out = u, or with gumbel: -log(-log(u))             (fp32 logf)
// The Python reference with exactly these semantics is dflash_trt.ops.random_uniform_reference
// (the uniforms bit for bit; the noise to logf's last place).

#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace dflash {

struct RandomUniformParams {
  const int64_t* keys = nullptr;  // [rows] (their bits read as unsigned)
  int64_t rows = 0;
  int64_t cols = 0;
  bool gumbel = false;
  float* out = nullptr;           // [rows, cols] contiguous
};

// Non-null when the parameters are unsupported (the message says why).
const char* random_uniform_check(const RandomUniformParams& p);
cudaError_t random_uniform_launch(const RandomUniformParams& p, cudaStream_t stream);

}  // namespace dflash
