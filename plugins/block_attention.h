// Block attention over a KV cache: the plain C++ launcher API (no torch types), so a torch
// op (ops.cpp) and a TensorRT IPluginV3 can both wrap it.
//
// Row b of the batch has T queries at positions q_start[b] .. q_start[b] + T - 1. Its keys are
//   - cache rows [0, ctx_len[b]) of slot slots[b] (cache row p holds position p), then
//   - if k_blk/v_blk are given, the block's own T rows at positions q_start[b] + j.
// Query at position qp sees a key at position kp iff
//   (!causal || kp <= qp) && (window <= 0 || kp > qp - window).
// A query that sees no key outputs zeros. Scores are scaled by `scale`; softmax and the
// accumulation run in fp32. Query head h reads KV head h / (Hq / Hkv) (GQA).
//
// The Python reference with exactly these semantics is
// dflash_trt.ops.paged_block_attention_reference.

#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

namespace dflash {

enum class DType : int { kFloat16 = 0, kBFloat16 = 1, kFloat32 = 2 };

// The dtypes and head sizes block_attention runs: bf16/fp16 on tensor cores with head_dim 64,
// 128 or 256, fp32 on CUDA cores with any head_dim that is a multiple of 8 up to 256.
// dflash_trt.ops.block_attention_kernel_supports mirrors this (tests/test_ops.py checks it).
constexpr bool block_attention_supports(DType dtype, int head_dim) {
  switch (dtype) {
    case DType::kFloat16:
    case DType::kBFloat16:
      return head_dim == 64 || head_dim == 128 || head_dim == 256;
    case DType::kFloat32:
      return head_dim >= 8 && head_dim <= 256 && head_dim % 8 == 0;
  }
  return false;
}

struct BlockAttentionParams {
  DType dtype = DType::kBFloat16;  // of q, caches, block K/V and out
  int batch = 0;                   // bs
  int num_tokens = 0;              // T: queries per row
  int num_q_heads = 0;             // Hq, a multiple of Hkv
  int num_kv_heads = 0;            // Hkv
  int head_dim = 0;                // see block_attention_supports

  // All strides are in elements; the last (head_dim) dimension is contiguous everywhere.
  // Pointers and strides of the caches and block K/V must keep every row 16-byte aligned
  // (strides multiples of 8 elements, 4 for fp32): the kernels load them with 16-byte copies.
  const void* q = nullptr;         // [bs, T, Hq, d]
  int64_t q_stride[3] = {};        //   batch, token, head (even: 4-byte loads; fp32: 16-byte
                                   //   aligned rows, strides multiples of 4)
  const void* k_cache = nullptr;   // [num_slots, capacity, Hkv, d], e.g. one layer of a 5-D cache
  int64_t k_cache_stride[3] = {};  //   slot, row, head
  const void* v_cache = nullptr;
  int64_t v_cache_stride[3] = {};
  const int32_t* slots = nullptr;    // [bs] device
  const int32_t* ctx_len = nullptr;  // [bs] device: cache rows visible as context
  const int32_t* q_start = nullptr;  // [bs] device: position of query 0
  const void* k_blk = nullptr;       // [bs, T, Hkv, d] or null (block already in the cache)
  int64_t k_blk_stride[3] = {};      //   batch, token, head
  const void* v_blk = nullptr;
  int64_t v_blk_stride[3] = {};
  void* out = nullptr;               // [bs, T, Hq, d], contiguous, 8-byte aligned (fp32: 16)

  bool causal = false;
  int window = 0;                  // <= 0: no window
  float scale = 1.0f;
  // Host-side upper bound on ctx_len[b] + (block ? T : 0). Only the split count depends on
  // it (the device data stays on the device, so the launch never syncs and can be graph-
  // captured); results are correct for any value. <= 0 means unknown: no split.
  int max_keys = 0;
};

// How many CTAs share one row's keys (flash-decoding), from the shapes and max_keys only
// (no pointers needed). Uses the current device's occupancy; num_sms <= 0 asks it too.
int block_attention_num_splits(const BlockAttentionParams& p, int num_sms);

// Scratch for the split partials (0 when num_splits == 1).
size_t block_attention_workspace_bytes(const BlockAttentionParams& p, int num_splits);

// Non-null when the parameters are unsupported (the message says why).
const char* block_attention_check(const BlockAttentionParams& p);

// Launches the attention kernel (and, with num_splits > 1, the combine kernel) on `stream`.
// Returns cudaErrorInvalidValue for unsupported parameters or too small a workspace.
cudaError_t block_attention_launch(const BlockAttentionParams& p, int num_splits, void* workspace,
                                   size_t workspace_bytes, cudaStream_t stream);

}  // namespace dflash
