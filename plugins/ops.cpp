// Torch registration of the plugins: thin wrappers that check their tensors, fill the plain
// launcher structs and launch on the current stream. The Python references these must match
// live in dflash_trt/ops.py (see README.md here).

#include <optional>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "block_attention.h"

namespace {

void fill_strides3(int64_t (&dst)[3], const at::Tensor& t) {
  for (int i = 0; i < 3; ++i) dst[i] = t.stride(i);
}

void check_kv(const at::Tensor& t, const char* name, const at::Tensor& q) {
  TORCH_CHECK(t.is_cuda() && t.device() == q.device(), name, " must be on q's CUDA device");
  TORCH_CHECK(t.scalar_type() == q.scalar_type(), name, " must have q's dtype");
  TORCH_CHECK(t.dim() == 4 && t.stride(3) == 1, name, " must be 4-D with a contiguous last dim");
}

void check_index(const at::Tensor& t, const char* name, const at::Tensor& q) {
  TORCH_CHECK(t.is_cuda() && t.device() == q.device(), name, " must be on q's CUDA device");
  TORCH_CHECK(t.scalar_type() == at::kInt, name, " must be int32");
  TORCH_CHECK(t.dim() == 1 && t.size(0) == q.size(0) && t.is_contiguous(), name, " must be a contiguous [bs] tensor");
}

// q [bs, T, Hq, d]; k_cache/v_cache [num_slots, capacity, Hkv, d]; slots/ctx_len/q_start [bs]
// int32; k_blk/v_blk [bs, T, Hkv, d] or None. Returns [bs, T, Hq, d].
at::Tensor block_attention_cuda(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& slots, const at::Tensor& ctx_len, const at::Tensor& q_start,
                                const std::optional<at::Tensor>& k_blk, const std::optional<at::Tensor>& v_blk,
                                bool causal, int64_t window, double scale, int64_t max_keys, int64_t num_splits) {
  TORCH_CHECK(q.is_cuda(), "q must be a CUDA tensor");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf, "q must be bf16 or fp16");
  TORCH_CHECK(q.dim() == 4 && q.stride(3) == 1, "q must be [bs, T, Hq, d] with a contiguous last dim");
  check_kv(k_cache, "k_cache", q);
  check_kv(v_cache, "v_cache", q);
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache shapes differ");
  const int64_t bs = q.size(0), T = q.size(1), Hq = q.size(2), d = q.size(3), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d, "cache head_dim ", k_cache.size(3), " != q head_dim ", d);
  check_index(slots, "slots", q);
  check_index(ctx_len, "ctx_len", q);
  check_index(q_start, "q_start", q);
  TORCH_CHECK(k_blk.has_value() == v_blk.has_value(), "k_blk and v_blk must be given together");
  if (k_blk) {
    check_kv(*k_blk, "k_blk", q);
    check_kv(*v_blk, "v_blk", q);
    for (const at::Tensor* t : {&*k_blk, &*v_blk})
      TORCH_CHECK(t->size(0) == bs && t->size(1) == T && t->size(2) == Hkv && t->size(3) == d,
                  "block K/V must be [bs, T, Hkv, d], got ", t->sizes());
  }

  const c10::cuda::CUDAGuard guard(q.device());
  auto out = at::empty({bs, T, Hq, d}, q.options());

  dflash::BlockAttentionParams p;
  p.dtype = q.scalar_type() == at::kBFloat16 ? dflash::DType::kBFloat16 : dflash::DType::kFloat16;
  p.batch = static_cast<int>(bs);
  p.num_tokens = static_cast<int>(T);
  p.num_q_heads = static_cast<int>(Hq);
  p.num_kv_heads = static_cast<int>(Hkv);
  p.head_dim = static_cast<int>(d);
  p.q = q.data_ptr();
  fill_strides3(p.q_stride, q);
  p.k_cache = k_cache.data_ptr();
  fill_strides3(p.k_cache_stride, k_cache);
  p.v_cache = v_cache.data_ptr();
  fill_strides3(p.v_cache_stride, v_cache);
  p.slots = slots.data_ptr<int32_t>();
  p.ctx_len = ctx_len.data_ptr<int32_t>();
  p.q_start = q_start.data_ptr<int32_t>();
  if (k_blk) {
    p.k_blk = k_blk->data_ptr();
    fill_strides3(p.k_blk_stride, *k_blk);
    p.v_blk = v_blk->data_ptr();
    fill_strides3(p.v_blk_stride, *v_blk);
  }
  p.out = out.data_ptr();
  p.causal = causal;
  p.window = static_cast<int>(window);
  p.scale = static_cast<float>(scale);
  // Default hint: the cache's capacity (plus the block), the most any row can have.
  p.max_keys = static_cast<int>(max_keys > 0 ? max_keys : k_cache.size(1) + (k_blk ? T : 0));
  if (const char* why = dflash::block_attention_check(p)) TORCH_CHECK(false, "block_attention: ", why);
  if (bs == 0 || T == 0) return out;

  const int splits = num_splits > 0 ? static_cast<int>(num_splits) : dflash::block_attention_num_splits(p, 0);
  const size_t ws_bytes = dflash::block_attention_workspace_bytes(p, splits);
  at::Tensor workspace;  // from the caching allocator, so graph capture works
  if (ws_bytes > 0) workspace = at::empty({static_cast<int64_t>(ws_bytes)}, q.options().dtype(at::kByte));
  const cudaError_t err = dflash::block_attention_launch(p, splits, ws_bytes ? workspace.data_ptr() : nullptr,
                                                         ws_bytes, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "block_attention launch failed: ", cudaGetErrorString(err));
  return out;
}

// Shape-only version for tracing (torch.compile, fake tensors).
at::Tensor block_attention_meta(const at::Tensor& q, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                const std::optional<at::Tensor>&, bool, int64_t, double, int64_t, int64_t) {
  return at::empty(q.sizes(), q.options());
}

}  // namespace

TORCH_LIBRARY(dflash, m) {
  m.def(
      "block_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor ctx_len, Tensor q_start, "
      "Tensor? k_blk, Tensor? v_blk, bool causal, int window, float scale, int max_keys=0, int num_splits=0) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(dflash, CUDA, m) { m.impl("block_attention", &block_attention_cuda); }

TORCH_LIBRARY_IMPL(dflash, Meta, m) { m.impl("block_attention", &block_attention_meta); }
