// random_uniform (random.h): a grid-stride loop, one element per thread per turn.

#include <algorithm>

#include "random.h"

namespace dflash {
namespace {

constexpr int kRandomThreads = 256;
constexpr int kRandomMaxBlocks = 8192;

__device__ __forceinline__ uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

__global__ void __launch_bounds__(kRandomThreads) random_uniform_kernel(RandomUniformParams p) {
  const int64_t total = p.rows * p.cols;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = e / p.cols, i = e % p.cols;
    const uint64_t x = mix(static_cast<uint64_t>(p.keys[r]) + static_cast<uint64_t>(i + 1) * 0x9E3779B97F4A7C15ull);
    const float u = (static_cast<float>(x >> 41) + 0.5f) * 0x1p-23f;
    p.out[e] = p.gumbel ? -logf(-logf(u)) : u;
  }
}

}  // namespace

const char* random_uniform_check(const RandomUniformParams& p) {
  if (p.rows < 0 || p.cols < 0) return "negative rows or cols";
  if (p.rows > 0 && p.cols > 0 && (!p.keys || !p.out)) return "null pointer";
  return nullptr;
}

cudaError_t random_uniform_launch(const RandomUniformParams& p, cudaStream_t stream) {
  if (random_uniform_check(p) != nullptr) return cudaErrorInvalidValue;
  if (p.rows == 0 || p.cols == 0) return cudaSuccess;
  const int64_t total = p.rows * p.cols;
  const int blocks = static_cast<int>(std::min<int64_t>((total + kRandomThreads - 1) / kRandomThreads, kRandomMaxBlocks));
  random_uniform_kernel<<<blocks, kRandomThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace dflash
