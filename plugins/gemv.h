// Skinny matmul for decode: y = x W^T (+ bias) with few rows of x, the plain C++ launcher API
// (no torch types), so a torch op (ops.cpp) and a TensorRT IPluginV3 can both wrap it.
//
// At batch 1 an AR step is every weight matrix streamed from memory once, and so is a verify
// or draft pass of one block: the matmuls are the pass, and what decides it is how close they
// read at the copy bandwidth. The kernel keeps eight 16-byte weight loads in flight per lane,
// reads x through L1, and sums in fp32 (CUDA cores for one row, tensor cores for 2 to 16).
//
// The Python reference with these semantics is dflash_trt.ops.gemv_reference:
//   y[m, n] = round(sum_k float(x[m, k]) * float(W[n, k]) (+ float(bias[n])))   (fp32 sum)
// The order of the fp32 sum differs from cuBLAS's (as cuBLAS's own kernels differ by shape).

#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "block_attention.h"  // dflash::DType

namespace dflash {

constexpr int kGemvMaxRows = 16;  // rows of x (M) the kernel takes; more go to a GEMM
constexpr int kGemvNormMaxFeatures = 8192;  // N of a GEMV with the add + norm after it

// The residual add + RMSNorm that follows a one-row matmul (a layer's o_proj or down_proj, then
// the next norm), run by the GEMV's last CTA instead of a kernel of its own: sum = residual +
// y in fp32, out = its RMSNorm, with add_rms_norm's semantics and bits (layer_ops.h,
// RmsNormParams). One row (rows == 1), N a multiple of 8, every pointer 16-byte aligned.
struct GemvNorm {
  const float* residual = nullptr;  // [N] fp32
  const void* weight = nullptr;     // [N] in the GEMV's dtype
  float eps = 1e-6f;
  bool zero_centered = false;
  float* sum = nullptr;             // [N] fp32
  void* out = nullptr;              // [N] in the dtype
  // One int the launch counts its finished CTAs in: zero before the launch, and the launch
  // leaves it zero. Launches running at the same time need their own.
  int* ticket = nullptr;
};

struct GemvParams {
  DType dtype = DType::kBFloat16;  // of x, W, bias and y (bf16 or fp16)
  int rows = 0;                    // M, 1 .. kGemvMaxRows
  int64_t out_features = 0;        // N
  int64_t in_features = 0;         // K, a multiple of 8
  const void* x = nullptr;         // [M, K] contiguous, 16-byte aligned
  const void* weight = nullptr;    // [N, K] contiguous, 16-byte aligned
  const void* bias = nullptr;      // [N] or null
  void* y = nullptr;               // [M, N] contiguous
};

// nullptr when the launch would be valid, else why not.
// norm: the add + RMSNorm after the matmul, or null.
const char* gemv_check(const GemvParams& p, const GemvNorm* norm = nullptr);
cudaError_t gemv_launch(const GemvParams& p, cudaStream_t stream, const GemvNorm* norm = nullptr);

}  // namespace dflash
