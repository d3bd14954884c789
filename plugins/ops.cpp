// Torch registration of the plugins: thin wrappers that check their tensors, fill the plain
// launcher structs and launch on the current stream. The Python references these must match
// live in dflash_trt/ops.py (see README.md here).

#include <optional>
#include <string>
#include <tuple>
#include <type_traits>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "block_attention.h"
#include "gated_delta.h"
#include "gemv.h"
#include "layer_ops.h"
#include "moe.h"
#include "moe_route.h"
#include "random.h"

namespace {

// The checks' messages, made from strings here: on the GPU machine (torch 2.11+cu130) a failed
// TORCH_CHECK whose message streamed a number or a size list into c10::str crashed the process
// (a segfault) instead of raising, while string-only messages raised; so numbers are formatted
// by std::to_string, never by an ostream (tests/test_op_errors.py).
std::string message_part(const char* s) { return s; }
std::string message_part(const std::string& s) { return s; }
std::string message_part(at::ScalarType t) { return c10::toString(t); }
std::string message_part(at::IntArrayRef v) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + std::to_string(v[i]);
  return out + "]";
}
template <typename I, typename = std::enable_if_t<std::is_integral_v<I>>>
std::string message_part(I v) {
  return std::to_string(v);
}

template <typename... Parts>
std::string message(const Parts&... parts) {
  std::string out;
  ((out += message_part(parts)), ...);
  return out;
}

// TORCH_CHECK with the message made by message(): raises c10::Error (a RuntimeError in Python).
#define DFLASH_CHECK(cond, ...)                            \
  do {                                                     \
    if (!(cond)) TORCH_CHECK(false, message(__VA_ARGS__)); \
  } while (0)

void fill_strides3(int64_t (&dst)[3], const at::Tensor& t) {
  for (int i = 0; i < 3; ++i) dst[i] = t.stride(i);
}

void check_kv(const at::Tensor& t, const char* name, const at::Tensor& q) {
  DFLASH_CHECK(t.is_cuda() && t.device() == q.device(), name, " must be on q's CUDA device");
  DFLASH_CHECK(t.scalar_type() == q.scalar_type(), name, " must have q's dtype");
  DFLASH_CHECK(t.dim() == 4 && t.stride(3) == 1, name, " must be 4-D with a contiguous last dim");
}

void check_index(const at::Tensor& t, const char* name, const at::Tensor& q) {
  DFLASH_CHECK(t.is_cuda() && t.device() == q.device(), name, " must be on q's CUDA device");
  DFLASH_CHECK(t.scalar_type() == at::kInt, name, " must be int32");
  DFLASH_CHECK(t.dim() == 1 && t.size(0) == q.size(0) && t.is_contiguous(), name, " must be a contiguous [bs] tensor");
}

// The dtypes block_attention takes; dflash::block_attention_supports (block_attention.h) says
// which head sizes each runs. dflash_trt.ops.block_attention_kernel_supports mirrors both
// (tests/test_ops.py reads this switch).
std::optional<dflash::DType> attention_dtype(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16: return dflash::DType::kBFloat16;
    case at::kHalf: return dflash::DType::kFloat16;
    case at::kFloat: return dflash::DType::kFloat32;
    default: return std::nullopt;
  }
}

// q [bs, T, Hq, d]; k_cache/v_cache [num_slots, capacity, Hkv, d]; slots/ctx_len/q_start [bs]
// int32; k_blk/v_blk [bs, T, Hkv, d] or None. Returns [bs, T, Hq, d].
at::Tensor block_attention_cuda(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& slots, const at::Tensor& ctx_len, const at::Tensor& q_start,
                                const std::optional<at::Tensor>& k_blk, const std::optional<at::Tensor>& v_blk,
                                bool causal, int64_t window, double scale, int64_t max_keys, int64_t num_splits) {
  DFLASH_CHECK(q.is_cuda(), "q must be a CUDA tensor");
  const std::optional<dflash::DType> dtype = attention_dtype(q.scalar_type());
  DFLASH_CHECK(dtype.has_value(), "q must be bf16, fp16 or fp32, got ", q.scalar_type());
  DFLASH_CHECK(q.dim() == 4 && q.stride(3) == 1, "q must be [bs, T, Hq, d] with a contiguous last dim");
  check_kv(k_cache, "k_cache", q);
  check_kv(v_cache, "v_cache", q);
  DFLASH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache shapes differ");
  const int64_t bs = q.size(0), T = q.size(1), Hq = q.size(2), d = q.size(3), Hkv = k_cache.size(2);
  DFLASH_CHECK(k_cache.size(3) == d, "cache head_dim ", k_cache.size(3), " != q head_dim ", d);
  check_index(slots, "slots", q);
  check_index(ctx_len, "ctx_len", q);
  check_index(q_start, "q_start", q);
  DFLASH_CHECK(k_blk.has_value() == v_blk.has_value(), "k_blk and v_blk must be given together");
  if (k_blk) {
    check_kv(*k_blk, "k_blk", q);
    check_kv(*v_blk, "v_blk", q);
    for (const at::Tensor* t : {&*k_blk, &*v_blk})
      DFLASH_CHECK(t->size(0) == bs && t->size(1) == T && t->size(2) == Hkv && t->size(3) == d,
                   "block K/V must be [bs, T, Hkv, d], got ", t->sizes());
  }

  const c10::cuda::CUDAGuard guard(q.device());
  auto out = at::empty({bs, T, Hq, d}, q.options());

  dflash::BlockAttentionParams p;
  p.dtype = *dtype;
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
  if (const char* why = dflash::block_attention_check(p)) DFLASH_CHECK(false, "block_attention: ", why);
  if (bs == 0 || T == 0) return out;

  const int splits = num_splits > 0 ? static_cast<int>(num_splits) : dflash::block_attention_num_splits(p, 0);
  const size_t ws_bytes = dflash::block_attention_workspace_bytes(p, splits);
  at::Tensor workspace;  // from the caching allocator, so graph capture works
  if (ws_bytes > 0) workspace = at::empty({static_cast<int64_t>(ws_bytes)}, q.options().dtype(at::kByte));
  const cudaError_t err = dflash::block_attention_launch(p, splits, ws_bytes ? workspace.data_ptr() : nullptr,
                                                         ws_bytes, c10::cuda::getCurrentCUDAStream().stream());
  DFLASH_CHECK(err == cudaSuccess, "block_attention launch failed: ", cudaGetErrorString(err));
  return out;
}

// Shape-only version for tracing (torch.compile, fake tensors).
at::Tensor block_attention_meta(const at::Tensor& q, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                const std::optional<at::Tensor>&, bool, int64_t, double, int64_t, int64_t) {
  return at::empty(q.sizes(), q.options());
}

// ---------------------------------------------------------------------------------------------
// Layer ops (layer_ops.h). Outputs are new contiguous tensors from the caching allocator.

dflash::DType model_dtype(const at::Tensor& t, const char* name) {
  DFLASH_CHECK(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf, name, " must be bf16 or fp16");
  return t.scalar_type() == at::kBFloat16 ? dflash::DType::kBFloat16 : dflash::DType::kFloat16;
}

void check_launch(cudaError_t err, const char* op) {
  DFLASH_CHECK(err == cudaSuccess, op, " launch failed: ", cudaGetErrorString(err));
}

// x [..., H] fp32 or weight's dtype, contiguous; weight [H]; delta (add_rms_norm) like x in
// weight's dtype. Returns (sum, y); sum is undefined without delta.
std::tuple<at::Tensor, at::Tensor> rms_norm_common(const at::Tensor& x, const at::Tensor* delta,
                                                   const at::Tensor& weight, double eps, bool zero_centered,
                                                   const at::Tensor* gate = nullptr) {
  DFLASH_CHECK(weight.is_cuda() && weight.dim() == 1 && weight.size(0) > 0 && weight.is_contiguous(),
               "weight must be a contiguous non-empty [H] CUDA tensor");
  const dflash::DType dtype = model_dtype(weight, "weight");
  DFLASH_CHECK(x.is_cuda() && x.device() == weight.device(), "x must be on weight's CUDA device");
  DFLASH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == weight.scalar_type(),
               "x must be fp32 or weight's dtype");
  DFLASH_CHECK(x.dim() >= 1 && x.size(-1) == weight.size(0) && x.is_contiguous(),
               "x must be a contiguous [..., H] tensor, H = ", weight.size(0), ", got ", x.sizes());
  if (delta) {
    DFLASH_CHECK(delta->is_cuda() && delta->device() == x.device(), "delta must be on x's CUDA device");
    DFLASH_CHECK(delta->scalar_type() == weight.scalar_type(), "delta must have weight's dtype");
    DFLASH_CHECK(delta->sizes() == x.sizes() && delta->is_contiguous(), "delta must be contiguous with x's shape");
  }
  if (gate) {
    DFLASH_CHECK(gate->is_cuda() && gate->device() == x.device(), "gate must be on x's CUDA device");
    DFLASH_CHECK(gate->scalar_type() == weight.scalar_type(), "gate must have weight's dtype");
    DFLASH_CHECK(gate->sizes() == x.sizes(), "gate must have x's shape");
  }
  // A gate that is a slice of a packed projection's output is read in place: its rows come in
  // groups of G back to back (its innermost dims with contiguous rows' strides), the groups
  // gate_group_stride apart (its other dims collapse into one stride); ops._grouped_rows.
  int64_t gate_group = 0, gate_group_stride = 0;
  if (gate && !gate->is_contiguous()) {
    const int64_t H = weight.size(0);
    DFLASH_CHECK(gate->stride(-1) == 1, "gate's rows must be contiguous, got strides ", gate->strides());
    int64_t i = gate->dim() - 2, g = 1;
    for (; i >= 0 && (gate->size(i) == 1 || gate->stride(i) == g * H); --i) g *= gate->size(i);
    gate_group = g, gate_group_stride = g * H;
    for (int64_t step = 0; i >= 0; --i) {
      if (gate->size(i) == 1) continue;
      DFLASH_CHECK(step == 0 || gate->stride(i) == step, "gate's row groups must be one stride apart, got strides ",
                   gate->strides());
      if (step == 0) gate_group_stride = gate->stride(i);
      step = gate->stride(i) * gate->size(i);
    }
  }

  const c10::cuda::CUDAGuard guard(x.device());
  auto y = at::empty(x.sizes(), weight.options());
  at::Tensor sum;
  if (delta) sum = at::empty(x.sizes(), x.options().dtype(at::kFloat));
  if (x.numel() == 0) return {sum, y};

  dflash::RmsNormParams p;
  p.dtype = dtype;
  p.x_fp32 = x.scalar_type() == at::kFloat;
  p.zero_centered = zero_centered;
  p.gate = gate ? gate->data_ptr() : nullptr;
  p.gate_group = gate_group;
  p.gate_group_stride = gate_group_stride;
  p.hidden = static_cast<int>(weight.size(0));
  p.rows = x.numel() / p.hidden;
  p.x = x.data_ptr();
  p.delta = delta ? delta->data_ptr() : nullptr;
  p.weight = weight.data_ptr();
  p.eps = static_cast<float>(eps);
  p.sum = delta ? sum.data_ptr<float>() : nullptr;
  p.out = y.data_ptr();
  if (const char* why = dflash::rms_norm_check(p)) DFLASH_CHECK(false, "rms_norm: ", why);
  check_launch(dflash::rms_norm_launch(p, c10::cuda::getCurrentCUDAStream().stream()), "rms_norm");
  return {sum, y};
}

at::Tensor rms_norm_cuda(const at::Tensor& x, const at::Tensor& weight, double eps, bool zero_centered) {
  return std::get<1>(rms_norm_common(x, nullptr, weight, eps, zero_centered));
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_cuda(const at::Tensor& x, const at::Tensor& delta,
                                                     const at::Tensor& weight, double eps, bool zero_centered) {
  return rms_norm_common(x, &delta, weight, eps, zero_centered);
}

at::Tensor gated_rms_norm_cuda(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& weight, double eps) {
  return std::get<1>(rms_norm_common(x, nullptr, weight, eps, false, &gate));
}

void check_rows(const at::Tensor& t, const char* name, const at::Tensor& qkv, int64_t width) {
  DFLASH_CHECK(t.is_cuda() && t.device() == qkv.device(), name, " must be on qkv's CUDA device");
  DFLASH_CHECK(t.scalar_type() == qkv.scalar_type(), name, " must have qkv's dtype");
  DFLASH_CHECK(t.dim() == 2 && t.size(0) == qkv.size(0) && t.size(1) == width && t.stride(1) == 1, name,
               " must be [N, ", width, "] with a contiguous last dim, got ", t.sizes());
}

void check_weight(const at::Tensor& t, const char* name, const at::Tensor& qkv, int64_t d) {
  DFLASH_CHECK(t.is_cuda() && t.device() == qkv.device(), name, " must be on qkv's CUDA device");
  DFLASH_CHECK(t.scalar_type() == qkv.scalar_type(), name, " must have qkv's dtype");
  DFLASH_CHECK(t.dim() == 1 && t.size(0) == d && t.is_contiguous(), name, " must be a contiguous [", d, "] tensor");
}

// qkv [N, (Hq + 2 Hkv) d] (q_gate: [N, (2 Hq + 2 Hkv) d], each query head followed by its
// gate); cos/sin [N, R] (R = rotary_dim, 0: d); caches [num_slots, capacity, Hkv, d] with slots
// and positions [N] int32, or none. Returns (q [N, Hq, d], k, v [N, Hkv, d]); k and v are
// empty ([0, Hkv, d]) when they went to the cache.
std::tuple<at::Tensor, at::Tensor, at::Tensor> qk_norm_rope_cuda(
    const at::Tensor& qkv, int64_t num_q_heads, int64_t num_kv_heads, const std::optional<at::Tensor>& q_weight,
    const at::Tensor& k_weight, double eps, const at::Tensor& cos, const at::Tensor& sin,
    const std::optional<at::Tensor>& k_cache, const std::optional<at::Tensor>& v_cache,
    const std::optional<at::Tensor>& slots, const std::optional<at::Tensor>& positions, bool zero_centered,
    int64_t rotary_dim, bool q_gate) {
  DFLASH_CHECK(qkv.is_cuda(), "qkv must be a CUDA tensor");
  const dflash::DType dtype = model_dtype(qkv, "qkv");
  DFLASH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "qkv must be [N, (Hq + 2 Hkv) d] with a contiguous last dim");
  DFLASH_CHECK(num_q_heads >= 0 && num_kv_heads >= 1, "need num_q_heads >= 0 and num_kv_heads >= 1");
  DFLASH_CHECK(k_weight.dim() == 1, "k_weight must be [d]");
  const int64_t N = qkv.size(0), d = k_weight.size(0), Hq = num_q_heads, Hkv = num_kv_heads;
  const int64_t q_heads = q_gate ? 2 * Hq : Hq, R = rotary_dim == 0 ? d : rotary_dim;
  DFLASH_CHECK(qkv.size(1) == (q_heads + 2 * Hkv) * d, "qkv width ", qkv.size(1), " != (", q_gate ? "2 " : "",
               "Hq + 2 Hkv) d = ", (q_heads + 2 * Hkv) * d);
  check_rows(cos, "cos", qkv, R);
  check_rows(sin, "sin", qkv, R);
  check_weight(k_weight, "k_weight", qkv, d);
  DFLASH_CHECK(q_weight.has_value() == (Hq > 0), "q_weight must be given exactly when num_q_heads > 0");
  if (q_weight) check_weight(*q_weight, "q_weight", qkv, d);
  const bool to_cache = k_cache.has_value();
  DFLASH_CHECK(v_cache.has_value() == to_cache && slots.has_value() == to_cache && positions.has_value() == to_cache,
               "k_cache, v_cache, slots and positions must be given together");
  if (to_cache) {
    for (const auto* c : {&*k_cache, &*v_cache}) {
      DFLASH_CHECK(c->is_cuda() && c->device() == qkv.device(), "caches must be on qkv's CUDA device");
      DFLASH_CHECK(c->scalar_type() == qkv.scalar_type(), "caches must have qkv's dtype");
      DFLASH_CHECK(c->dim() == 4 && c->size(2) == Hkv && c->size(3) == d && c->stride(3) == 1,
                   "caches must be [num_slots, capacity, Hkv, d] with a contiguous last dim, got ", c->sizes());
    }
    for (const auto* t : {&*slots, &*positions}) {
      DFLASH_CHECK(t->is_cuda() && t->device() == qkv.device(), "slots and positions must be on qkv's CUDA device");
      DFLASH_CHECK(t->scalar_type() == at::kInt && t->dim() == 1 && t->size(0) == N && t->is_contiguous(),
                   "slots and positions must be contiguous [N] int32 tensors");
    }
  }

  const c10::cuda::CUDAGuard guard(qkv.device());
  auto q = at::empty({N, Hq, d}, qkv.options());
  auto k = at::empty({to_cache ? 0 : N, Hkv, d}, qkv.options());
  auto v = at::empty({to_cache ? 0 : N, Hkv, d}, qkv.options());
  if (N == 0) return {q, k, v};

  dflash::QkNormRopeParams p;
  p.dtype = dtype;
  p.rows = N;
  p.num_q_heads = static_cast<int>(Hq);
  p.num_kv_heads = static_cast<int>(Hkv);
  p.head_dim = static_cast<int>(d);
  p.rotary_dim = static_cast<int>(rotary_dim);
  p.zero_centered = zero_centered;
  p.q_gate = q_gate;
  p.eps = static_cast<float>(eps);
  p.qkv = qkv.data_ptr();
  p.qkv_stride = qkv.stride(0);
  p.q_weight = q_weight ? q_weight->data_ptr() : nullptr;
  p.k_weight = k_weight.data_ptr();
  p.cos = cos.data_ptr();
  p.cos_stride = cos.stride(0);
  p.sin = sin.data_ptr();
  p.sin_stride = sin.stride(0);
  p.q_out = Hq > 0 ? q.data_ptr() : nullptr;
  if (to_cache) {
    p.k_cache = k_cache->data_ptr();
    fill_strides3(p.k_cache_stride, *k_cache);
    p.v_cache = v_cache->data_ptr();
    fill_strides3(p.v_cache_stride, *v_cache);
    p.slots = slots->data_ptr<int32_t>();
    p.positions = positions->data_ptr<int32_t>();
  } else {
    p.k_out = k.data_ptr();
    p.v_out = v.data_ptr();
  }
  if (const char* why = dflash::qk_norm_rope_check(p)) DFLASH_CHECK(false, "qk_norm_rope: ", why);
  check_launch(dflash::qk_norm_rope_launch(p, c10::cuda::getCurrentCUDAStream().stream()), "qk_norm_rope");
  return {q, k, v};
}

// gate_up [..., 2I] contiguous -> silu(gate) * up [..., I].
at::Tensor silu_mul_cuda(const at::Tensor& gate_up) {
  DFLASH_CHECK(gate_up.is_cuda(), "gate_up must be a CUDA tensor");
  const dflash::DType dtype = model_dtype(gate_up, "gate_up");
  DFLASH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0 && gate_up.is_contiguous(),
               "gate_up must be a contiguous [..., 2I] tensor, got ", gate_up.sizes());
  auto sizes = gate_up.sizes().vec();
  sizes.back() /= 2;
  const c10::cuda::CUDAGuard guard(gate_up.device());
  auto out = at::empty(sizes, gate_up.options());
  if (out.numel() == 0) return out;
  dflash::SiluMulParams p;
  p.dtype = dtype;
  p.inter = sizes.back();
  p.rows = out.numel() / p.inter;
  p.gate_up = gate_up.data_ptr();
  p.out = out.data_ptr();
  if (const char* why = dflash::silu_mul_check(p)) DFLASH_CHECK(false, "silu_mul: ", why);
  check_launch(dflash::silu_mul_launch(p, c10::cuda::getCurrentCUDAStream().stream()), "silu_mul");
  return out;
}

// keys [R] int64 contiguous -> [R, cols] fp32: uniforms in (0, 1), or Gumbel noise (random.h).
at::Tensor random_uniform_cuda(const at::Tensor& keys, int64_t cols, bool gumbel) {
  DFLASH_CHECK(keys.is_cuda(), "keys must be a CUDA tensor");
  DFLASH_CHECK(keys.scalar_type() == at::kLong && keys.dim() == 1 && keys.is_contiguous(),
               "keys must be a contiguous int64 [R] tensor, got ", keys.scalar_type(), " ", keys.sizes());
  DFLASH_CHECK(cols >= 0, "cols must be >= 0, got ", cols);
  const c10::cuda::CUDAGuard guard(keys.device());
  auto out = at::empty({keys.size(0), cols}, keys.options().dtype(at::kFloat));
  dflash::RandomUniformParams p;
  p.keys = keys.data_ptr<int64_t>();
  p.rows = keys.size(0);
  p.cols = cols;
  p.gumbel = gumbel;
  p.out = out.data_ptr<float>();
  check_launch(dflash::random_uniform_launch(p, c10::cuda::getCurrentCUDAStream().stream()), "random_uniform");
  return out;
}

// x [R, H, D] contiguous, gate [R, H, D] in x's dtype with a contiguous last dim (a view of the
// q projection's output) -> x * sigmoid(gate) [R, H, D].
at::Tensor sigmoid_gate_cuda(const at::Tensor& x, const at::Tensor& gate) {
  DFLASH_CHECK(x.is_cuda() && gate.device() == x.device(), "x and gate must be on one GPU");
  const dflash::DType dtype = model_dtype(x, "x");
  DFLASH_CHECK(x.dim() == 3 && x.is_contiguous(), "x must be a contiguous [R, H, D] tensor, got ", x.sizes());
  DFLASH_CHECK(gate.scalar_type() == x.scalar_type() && gate.sizes() == x.sizes() && gate.stride(2) == 1,
               "gate must be x's shape ", x.sizes(), " and dtype with a contiguous last dim, got ", gate.sizes(),
               " strides ", gate.strides());
  const c10::cuda::CUDAGuard guard(x.device());
  auto out = at::empty(x.sizes(), x.options());
  if (out.numel() == 0) return out;
  dflash::SigmoidGateParams p;
  p.dtype = dtype;
  p.rows = x.size(0);
  p.heads = x.size(1);
  p.head_dim = x.size(2);
  p.x = x.data_ptr();
  p.gate = gate.data_ptr();
  p.gate_row_stride = gate.stride(0);
  p.gate_head_stride = gate.stride(1);
  p.out = out.data_ptr();
  if (const char* why = dflash::sigmoid_gate_check(p)) DFLASH_CHECK(false, "sigmoid_gate: ", why);
  check_launch(dflash::sigmoid_gate_launch(p, c10::cuda::getCurrentCUDAStream().stream()), "sigmoid_gate");
  return out;
}

// x [M, K] (M <= 16), weight [N, K], bias [N] or None, all one dtype, contiguous.
void check_gemv_args(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  DFLASH_CHECK(x.is_cuda() && weight.is_cuda() && weight.device() == x.device(), "x and weight must be on one GPU");
  model_dtype(x, "x");
  DFLASH_CHECK(weight.scalar_type() == x.scalar_type(), "weight must have x's dtype");
  DFLASH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.dim() == 2 && weight.is_contiguous() &&
                   weight.size(1) == x.size(1),
               "x must be a contiguous [M, K] and weight a contiguous [N, K] tensor, got ", x.sizes(), " and ",
               weight.sizes());
  if (bias.has_value()) {
    DFLASH_CHECK(bias->device() == x.device() && bias->scalar_type() == x.scalar_type() && bias->dim() == 1 &&
                     bias->size(0) == weight.size(0) && bias->is_contiguous(),
                 "bias must be a contiguous [N] tensor of x's dtype on x's device");
  }
}

// The launch of y [M, N] = x W^T (+ bias), the arguments checked by check_gemv_args.
dflash::GemvParams gemv_params(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                               at::Tensor& y) {
  dflash::GemvParams p;
  p.dtype = model_dtype(x, "x");
  p.rows = static_cast<int>(x.size(0));
  p.out_features = weight.size(0);
  p.in_features = x.size(1);
  p.x = x.data_ptr();
  p.weight = weight.data_ptr();
  p.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  p.y = y.data_ptr();
  return p;
}

void gemv_run(const dflash::GemvParams& p, const char* op, const dflash::GemvNorm* norm = nullptr) {
  if (const char* why = dflash::gemv_check(p, norm)) DFLASH_CHECK(false, op, ": ", why);
  check_launch(dflash::gemv_launch(p, c10::cuda::getCurrentCUDAStream().stream(), norm), op);
}

at::Tensor gemv_cuda(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  check_gemv_args(x, weight, bias);
  const c10::cuda::CUDAGuard guard(x.device());
  auto y = at::empty({x.size(0), weight.size(0)}, x.options());
  if (y.numel() > 0) gemv_run(gemv_params(x, weight, bias, y), "gemv");
  return y;
}

// The residual add + norm that a launch runs after its own output (GemvNorm: one row of N
// features in x's dtype): the arguments checked, sum and out allocated in residual's shape.
struct RowNorm {
  at::Tensor sum, out;
  dflash::GemvNorm params;
  RowNorm(const at::Tensor& x, int64_t N, const at::Tensor& residual, const at::Tensor& norm_weight, double eps,
          bool zero_centered, const at::Tensor& ticket, const char* op) {
    DFLASH_CHECK(residual.device() == x.device() && residual.scalar_type() == at::kFloat && residual.is_contiguous() &&
                     residual.dim() >= 1 && residual.size(-1) == N && residual.numel() == N,
                 op, ": residual must be a contiguous fp32 [..., N] tensor of one row on x's device, N = ", N, ", got ",
                 residual.sizes(), " ", residual.scalar_type());
    DFLASH_CHECK(norm_weight.device() == x.device() && norm_weight.scalar_type() == x.scalar_type() &&
                     norm_weight.dim() == 1 && norm_weight.size(0) == N && norm_weight.is_contiguous(),
                 op, ": norm_weight must be a contiguous [N] tensor of x's dtype on x's device, N = ", N);
    DFLASH_CHECK(ticket.device() == x.device() && ticket.scalar_type() == at::kInt && ticket.numel() == 1,
                 op, ": ticket must be one int32 on x's device");
    sum = at::empty(residual.sizes(), residual.options());
    out = at::empty(residual.sizes(), x.options());
    params.residual = residual.data_ptr<float>();
    params.weight = norm_weight.data_ptr();
    params.eps = static_cast<float>(eps);
    params.zero_centered = zero_centered;
    params.sum = sum.data_ptr<float>();
    params.out = out.data_ptr();
    params.ticket = ticket.data_ptr<int>();
  }
};

// x [1, K], weight [N, K], bias [N] or None as for gemv; residual [..., N] fp32 and norm_weight [N]
// in x's dtype, contiguous; ticket one int32, zero (the launch leaves it zero). Returns (sum, out)
// of add_rms_norm(residual, x W^T (+ bias), norm_weight), in residual's shape.
std::tuple<at::Tensor, at::Tensor> linear_add_rms_norm_cuda(const at::Tensor& x, const at::Tensor& weight,
                                                            const std::optional<at::Tensor>& bias,
                                                            const at::Tensor& residual, const at::Tensor& norm_weight,
                                                            double eps, bool zero_centered, const at::Tensor& ticket) {
  check_gemv_args(x, weight, bias);
  DFLASH_CHECK(x.size(0) == 1, "linear_add_rms_norm takes one row of x, got ", x.size(0));
  const c10::cuda::CUDAGuard guard(x.device());
  auto y = at::empty({1, weight.size(0)}, x.options());
  RowNorm norm(x, weight.size(0), residual, norm_weight, eps, zero_centered, ticket, "linear_add_rms_norm");
  gemv_run(gemv_params(x, weight, bias, y), "linear_add_rms_norm", &norm.params);
  return {norm.sum, norm.out};
}

// Shape-only versions for tracing (torch.compile, fake tensors).
at::Tensor rms_norm_meta(const at::Tensor& x, const at::Tensor& weight, double, bool) {
  return at::empty(x.sizes(), weight.options());
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_meta(const at::Tensor& x, const at::Tensor&, const at::Tensor& weight,
                                                     double, bool) {
  return {at::empty(x.sizes(), x.options().dtype(at::kFloat)), at::empty(x.sizes(), weight.options())};
}

at::Tensor gated_rms_norm_meta(const at::Tensor& x, const at::Tensor&, const at::Tensor& weight, double) {
  return at::empty(x.sizes(), weight.options());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> qk_norm_rope_meta(
    const at::Tensor& qkv, int64_t num_q_heads, int64_t num_kv_heads, const std::optional<at::Tensor>&,
    const at::Tensor& k_weight, double, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>& k_cache,
    const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, bool,
    int64_t, bool) {
  const int64_t N = qkv.size(0), d = k_weight.size(0), rows = k_cache ? 0 : N;
  return {at::empty({N, num_q_heads, d}, qkv.options()), at::empty({rows, num_kv_heads, d}, qkv.options()),
          at::empty({rows, num_kv_heads, d}, qkv.options())};
}

// x [bs, T, C] (token rows evenly spaced, channels contiguous: a view of the packed
// projection); conv_cache [num_slots, W, C]; snapshots [num_slots, NS, W, C] or None (then
// the window goes to conv_cache in place); weight [C, K]; slots, start [bs] int32.
at::Tensor causal_conv_cuda(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& conv_cache,
                            const std::optional<at::Tensor>& snapshots, const at::Tensor& slots,
                            const at::Tensor& start, const std::optional<at::Tensor>& num_tokens) {
  const dflash::DType dtype = model_dtype(x, "x");
  DFLASH_CHECK(x.is_cuda() && x.dim() == 3 && x.stride(2) == 1 && x.stride(0) == x.stride(1) * x.size(1),
               "x must be a [bs, T, C] CUDA tensor with contiguous channels and evenly spaced tokens");
  const int64_t bs = x.size(0), T = x.size(1), C = x.size(2);
  DFLASH_CHECK(weight.dim() == 2 && weight.size(0) == C && weight.is_contiguous(), "weight must be [C, K] contiguous");
  const int64_t K = weight.size(1);
  DFLASH_CHECK(conv_cache.dim() == 3 && conv_cache.size(1) == K - 1 && conv_cache.size(2) == C &&
                   conv_cache.is_contiguous(), "conv_cache must be [num_slots, K - 1, C] contiguous");
  for (const at::Tensor* t : {&weight, &conv_cache}) {
    DFLASH_CHECK(t->device() == x.device() && t->scalar_type() == x.scalar_type(), "weight and caches need x's dtype");
  }
  if (snapshots) {  // at least one: without snapshots the window goes to conv_cache instead
    DFLASH_CHECK(snapshots->dim() == 4 && snapshots->size(0) == conv_cache.size(0) && snapshots->size(1) >= 1 &&
                     snapshots->size(2) == K - 1 &&
                     snapshots->size(3) == C && snapshots->is_contiguous() && snapshots->device() == x.device() &&
                     snapshots->scalar_type() == x.scalar_type(),
                 "snapshots must be [num_slots, NS >= 1, K - 1, C] contiguous in x's dtype");
  }
  check_index(slots, "slots", x);
  check_index(start, "start", x);
  if (num_tokens) check_index(*num_tokens, "num_tokens", x);
  const c10::cuda::CUDAGuard guard(x.device());
  auto out = at::empty({bs, T, C}, x.options());
  dflash::CausalConvParams p;
  p.dtype = dtype;
  p.batch = static_cast<int>(bs);
  p.width = static_cast<int>(T);
  p.channels = static_cast<int>(C);
  p.kernel_size = static_cast<int>(K);
  p.num_snapshots = snapshots ? static_cast<int>(snapshots->size(1)) : 0;
  p.x = x.data_ptr();
  p.x_stride = x.stride(1);
  p.weight = weight.data_ptr();
  p.conv_cache = conv_cache.data_ptr();
  p.snapshots = snapshots ? snapshots->data_ptr() : nullptr;
  p.slots = slots.data_ptr<int32_t>();
  p.start = start.data_ptr<int32_t>();
  p.num_tokens = num_tokens ? num_tokens->data_ptr<int32_t>() : nullptr;
  p.out = out.data_ptr();
  if (const char* why = dflash::causal_conv_check(p)) DFLASH_CHECK(false, "causal_conv: ", why);
  check_launch(dflash::causal_conv_launch(p, c10::cuda::getCurrentCUDAStream().stream()), "causal_conv");
  return out;
}

at::Tensor causal_conv_meta(const at::Tensor& x, const at::Tensor&, const at::Tensor&,
                            const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&,
                            const std::optional<at::Tensor>&) {
  return at::empty(x.sizes(), x.options());
}

at::Tensor gemv_meta(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>&) {
  return at::empty({x.size(0), weight.size(0)}, x.options());
}

std::tuple<at::Tensor, at::Tensor> linear_add_rms_norm_meta(const at::Tensor& x, const at::Tensor&,
                                                            const std::optional<at::Tensor>&,
                                                            const at::Tensor& residual, const at::Tensor&, double,
                                                            bool, const at::Tensor&) {
  return {at::empty(residual.sizes(), residual.options()), at::empty(residual.sizes(), x.options())};
}

at::Tensor sigmoid_gate_meta(const at::Tensor& x, const at::Tensor&) { return at::empty(x.sizes(), x.options()); }

at::Tensor random_uniform_meta(const at::Tensor& keys, int64_t cols, bool) {
  return at::empty({keys.size(0), cols}, keys.options().dtype(at::kFloat));
}

at::Tensor silu_mul_meta(const at::Tensor& gate_up) {
  auto sizes = gate_up.sizes().vec();
  sizes.back() /= 2;
  return at::empty(sizes, gate_up.options());
}

// ---------------------------------------------------------------------------------------------
// Gated DeltaNet recurrence (gated_delta.h): reads state_cache, writes snapshot_cache in place.

void check_fp32(const at::Tensor& t, const char* name, const at::Tensor& q, at::IntArrayRef sizes) {
  DFLASH_CHECK(t.is_cuda() && t.device() == q.device(), name, " must be on q's CUDA device");
  DFLASH_CHECK(t.scalar_type() == at::kFloat, name, " must be fp32, got ", t.scalar_type());
  DFLASH_CHECK(t.sizes() == sizes, name, " must be ", sizes, ", got ", t.sizes());
  DFLASH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// q, k [bs, T, Hk, dk]; v [bs, T, Hv, dv]; g, beta [bs, T, Hv]; state_cache [num_slots, Hv,
// dk, dv] (read only); snapshot_cache [num_slots, NS, Hv, dk, dv] (written); slots, start,
// num_tokens [bs] int32; all fp32 and contiguous. Returns out [bs, T, Hv, dv] in out_dtype (fp32 by
// default; bf16 or fp16).
at::Tensor gated_delta_recurrent_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& g, const at::Tensor& beta, const at::Tensor& state_cache,
                                      const at::Tensor& snapshot_cache, const at::Tensor& slots,
                                      const at::Tensor& start, const at::Tensor& num_tokens,
                                      std::optional<at::ScalarType> out_dtype, bool outputs) {
  DFLASH_CHECK(q.is_cuda(), "q must be a CUDA tensor");
  DFLASH_CHECK(q.dim() == 4, "q must be [bs, T, Hk, dk], got ", q.sizes());
  DFLASH_CHECK(v.dim() == 4, "v must be [bs, T, Hv, dv], got ", v.sizes());
  DFLASH_CHECK(snapshot_cache.dim() == 5, "snapshot_cache must be [num_slots, NS, Hv, dk, dv], got ",
               snapshot_cache.sizes());
  const int64_t bs = q.size(0), T = q.size(1), Hk = q.size(2), dk = q.size(3), Hv = v.size(2), dv = v.size(3);
  const int64_t num_slots = snapshot_cache.size(0), NS = snapshot_cache.size(1);
  check_fp32(q, "q", q, q.sizes());
  check_fp32(k, "k", q, q.sizes());
  check_fp32(v, "v", q, {bs, T, Hv, dv});
  check_fp32(g, "g", q, {bs, T, Hv});
  check_fp32(beta, "beta", q, {bs, T, Hv});
  check_fp32(state_cache, "state_cache", q, {num_slots, Hv, dk, dv});
  check_fp32(snapshot_cache, "snapshot_cache", q, {num_slots, NS, Hv, dk, dv});
  check_index(slots, "slots", q);
  check_index(start, "start", q);
  check_index(num_tokens, "num_tokens", q);

  const at::ScalarType out_type = out_dtype.value_or(at::kFloat);
  const std::optional<dflash::DType> out_kind = attention_dtype(out_type);
  DFLASH_CHECK(out_kind.has_value(), "gated_delta_recurrent: out_dtype must be fp32, bf16 or fp16, got ", out_type);
  const c10::cuda::CUDAGuard guard(q.device());
  // without outputs (a commit's replay) an empty tensor: the kernel writes only the state
  auto out = at::empty({outputs ? bs : 0, T, Hv, dv}, q.options().dtype(out_type));

  dflash::GatedDeltaParams p;
  p.out_dtype = *out_kind;
  p.batch = static_cast<int>(bs);
  p.width = static_cast<int>(T);
  p.num_k_heads = static_cast<int>(Hk);
  p.num_v_heads = static_cast<int>(Hv);
  p.key_dim = static_cast<int>(dk);
  p.value_dim = static_cast<int>(dv);
  p.num_snapshots = static_cast<int>(NS);
  p.q = q.data_ptr<float>();
  p.k = k.data_ptr<float>();
  p.v = v.data_ptr<float>();
  p.g = g.data_ptr<float>();
  p.beta = beta.data_ptr<float>();
  p.state_cache = state_cache.data_ptr<float>();
  p.snapshot_cache = snapshot_cache.data_ptr<float>();
  p.slots = slots.data_ptr<int32_t>();
  p.start = start.data_ptr<int32_t>();
  p.num_tokens = num_tokens.data_ptr<int32_t>();
  p.out = outputs ? out.data_ptr() : nullptr;
  if (const char* why = dflash::gated_delta_recurrent_check(p)) DFLASH_CHECK(false, "gated_delta_recurrent: ", why);
  check_launch(dflash::gated_delta_recurrent_launch(p, c10::cuda::getCurrentCUDAStream().stream()),
               "gated_delta_recurrent");
  return out;
}

// q, k [..., Hk, dk], v [..., Hv, dv], g, beta [..., Hv]: fp32, the leading dims of qkv.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gated_delta_prepare_outputs(
    const at::Tensor& qkv, int64_t Hv, int64_t num_k_heads, int64_t key_dim, int64_t value_dim) {
  auto shape = [&](std::initializer_list<int64_t> tail) {
    auto s = qkv.sizes().vec();
    s.pop_back();
    s.insert(s.end(), tail);
    return s;
  };
  const auto f32 = qkv.options().dtype(at::kFloat);
  return {at::empty(shape({num_k_heads, key_dim}), f32), at::empty(shape({num_k_heads, key_dim}), f32),
          at::empty(shape({Hv, value_dim}), f32), at::empty(shape({Hv}), f32), at::empty(shape({Hv}), f32)};
}

// qkv [..., 2 Hk dk + Hv dv] (bf16, fp16 or fp32, contiguous); a, b [..., Hv] in qkv's dtype
// with a contiguous last dim (views of the packed projection); neg_a, dt_bias [Hv] fp32.
// Writes q, k [..., Hk, dk], v [..., Hv, dv], g, beta [..., Hv], all fp32 and contiguous.
void gated_delta_prepare_into(const at::Tensor& qkv, const at::Tensor& a, const at::Tensor& b,
                              const at::Tensor& neg_a, const at::Tensor& dt_bias, const at::Tensor& q,
                              const at::Tensor& k, const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
                              int64_t num_k_heads, int64_t key_dim, int64_t value_dim, double eps, double q_scale) {
  const auto dtype = attention_dtype(qkv.scalar_type());
  DFLASH_CHECK(qkv.is_cuda() && dtype, "qkv must be a bf16, fp16 or fp32 CUDA tensor");
  DFLASH_CHECK(qkv.dim() >= 1 && qkv.is_contiguous(), "qkv must be contiguous");
  DFLASH_CHECK(num_k_heads > 0 && key_dim > 0 && value_dim > 0 && neg_a.numel() > 0, "head sizes must be positive");
  const int64_t Hv = neg_a.numel(), width = 2 * num_k_heads * key_dim + Hv * value_dim;
  DFLASH_CHECK(qkv.size(-1) == width, "qkv must be [..., ", width, "], got ", qkv.sizes());
  const int64_t N = qkv.numel() / width;
  const auto lead = qkv.sizes().slice(0, qkv.dim() - 1);
  for (const auto* t : {&a, &b}) {
    DFLASH_CHECK(t->is_cuda() && t->device() == qkv.device() && t->scalar_type() == qkv.scalar_type(),
                 "a and b must be on qkv's device in its dtype");
    DFLASH_CHECK(t->dim() == qkv.dim() && t->sizes().slice(0, t->dim() - 1) == lead && t->size(-1) == Hv &&
                     t->stride(-1) == 1,
                 "a and b must be [..., Hv] with qkv's leading dims and a contiguous last dim, got ", t->sizes());
    // the rows are evenly spaced: [..., Hv] views of one [N, P] projection output
    for (int64_t d = 0; d + 2 < t->dim(); ++d) {
      DFLASH_CHECK(t->stride(d) == t->stride(d + 1) * t->size(d + 1), "a and b rows must be evenly spaced");
    }
  }
  DFLASH_CHECK(a.stride(-2) == b.stride(-2), "a and b must have the same row stride");
  for (const auto* t : {&neg_a, &dt_bias}) {
    DFLASH_CHECK(t->is_cuda() && t->device() == qkv.device() && t->scalar_type() == at::kFloat &&
                     t->dim() == 1 && t->numel() == Hv && t->is_contiguous(),
                 "neg_a and dt_bias must be contiguous fp32 [Hv] CUDA tensors");
  }
  const std::pair<const at::Tensor*, int64_t> outs[] = {
      {&q, num_k_heads * key_dim}, {&k, num_k_heads * key_dim}, {&v, Hv * value_dim}, {&g, Hv}, {&beta, Hv}};
  for (const auto& [t, per_token] : outs) {
    DFLASH_CHECK(t->device() == qkv.device() && t->scalar_type() == at::kFloat && t->is_contiguous() &&
                     t->numel() == N * per_token,
                 "the outputs must be contiguous fp32 tensors on qkv's device, ", per_token, " values per token");
  }
  const c10::cuda::CUDAGuard guard(qkv.device());

  dflash::GatedDeltaPrepareParams p;
  p.dtype = *dtype;
  p.tokens = N;
  p.num_k_heads = static_cast<int>(num_k_heads);
  p.num_v_heads = static_cast<int>(Hv);
  p.key_dim = static_cast<int>(key_dim);
  p.value_dim = static_cast<int>(value_dim);
  p.eps = static_cast<float>(eps);
  p.q_scale = static_cast<float>(q_scale);
  p.qkv = qkv.data_ptr();
  p.a = a.data_ptr();
  p.b = b.data_ptr();
  p.ab_stride = a.dim() >= 2 ? a.stride(-2) : Hv;
  p.neg_a = neg_a.data_ptr<float>();
  p.dt_bias = dt_bias.data_ptr<float>();
  p.q = q.data_ptr<float>();
  p.k = k.data_ptr<float>();
  p.v = v.data_ptr<float>();
  p.g = g.data_ptr<float>();
  p.beta = beta.data_ptr<float>();
  if (const char* why = dflash::gated_delta_prepare_check(p)) DFLASH_CHECK(false, "gated_delta_prepare: ", why);
  check_launch(dflash::gated_delta_prepare_launch(p, c10::cuda::getCurrentCUDAStream().stream()),
               "gated_delta_prepare");
}

// gated_delta_prepare_into's inputs -> its outputs, new tensors
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gated_delta_prepare_cuda(
    const at::Tensor& qkv, const at::Tensor& a, const at::Tensor& b, const at::Tensor& neg_a,
    const at::Tensor& dt_bias, int64_t num_k_heads, int64_t key_dim, int64_t value_dim, double eps, double q_scale) {
  DFLASH_CHECK(qkv.dim() >= 1 && neg_a.numel() > 0, "qkv must have a last dim, neg_a values");
  auto [q, k, v, g, beta] = gated_delta_prepare_outputs(qkv, neg_a.numel(), num_k_heads, key_dim, value_dim);
  gated_delta_prepare_into(qkv, a, b, neg_a, dt_bias, q, k, v, g, beta, num_k_heads, key_dim, value_dim, eps, q_scale);
  return {q, k, v, g, beta};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gated_delta_prepare_meta(
    const at::Tensor& qkv, const at::Tensor&, const at::Tensor&, const at::Tensor& neg_a, const at::Tensor&,
    int64_t num_k_heads, int64_t key_dim, int64_t value_dim, double, double) {
  return gated_delta_prepare_outputs(qkv, neg_a.numel(), num_k_heads, key_dim, value_dim);
}

// One in-place decode step (gated_delta.h, gated_delta_step): qkv [bs, 2 Hk dk + Hv dv] (the conv
// output), a and b [bs, Hv] and z [bs, Hv, dv] (views of the projection: last dims contiguous) and
// norm_weight [dv] in one 16-bit dtype; neg_a, dt_bias [Hv] fp32; state_cache [num_slots, Hv, dk,
// dv] fp32, stepped in place; slots, start, num_tokens [bs] int32. Returns y [bs, Hv, dv].
at::Tensor gated_delta_step_cuda(const at::Tensor& qkv, const at::Tensor& a, const at::Tensor& b, const at::Tensor& z,
                                 const at::Tensor& neg_a, const at::Tensor& dt_bias, const at::Tensor& norm_weight,
                                 double norm_eps, double l2_eps, double q_scale, const at::Tensor& state_cache,
                                 const at::Tensor& slots, const at::Tensor& start, const at::Tensor& num_tokens,
                                 int64_t num_k_heads) {
  DFLASH_CHECK(qkv.is_cuda() && qkv.dim() == 2 && qkv.stride(1) == 1, "qkv must be a CUDA [bs, C] tensor with "
               "contiguous rows, got ", qkv.sizes());
  const std::optional<dflash::DType> dtype = attention_dtype(qkv.scalar_type());
  DFLASH_CHECK(dtype.has_value() && *dtype != dflash::DType::kFloat32, "qkv must be bf16 or fp16");
  const int64_t bs = qkv.size(0), Hv = neg_a.numel(), D = dflash::kGatedDeltaStepDim;
  for (const auto& [t, name] : {std::pair{&a, "a"}, std::pair{&b, "b"}}) {
    DFLASH_CHECK(t->device() == qkv.device() && t->scalar_type() == qkv.scalar_type() && t->dim() == 2 &&
                     t->size(0) == bs && t->size(1) == Hv && t->stride(1) == 1 && t->stride(0) == a.stride(0),
                 name, " must be [bs, Hv] in qkv's dtype with a's strides and a contiguous last dim, got ", t->sizes());
  }
  DFLASH_CHECK(z.device() == qkv.device() && z.scalar_type() == qkv.scalar_type() && z.dim() == 3 && z.size(0) == bs &&
                   z.size(1) == Hv && z.size(2) == D && z.stride(2) == 1 && z.stride(1) == D,
               "z must be [bs, Hv, ", D, "] in qkv's dtype, each row's heads contiguous, got ", z.sizes());
  DFLASH_CHECK(norm_weight.device() == qkv.device() && norm_weight.scalar_type() == qkv.scalar_type() &&
                   norm_weight.numel() == D && norm_weight.is_contiguous(),
               "norm_weight must be a contiguous [", D, "] in qkv's dtype");
  check_fp32(neg_a, "neg_a", qkv, {Hv});
  check_fp32(dt_bias, "dt_bias", qkv, {Hv});
  check_fp32(state_cache, "state_cache", qkv, {state_cache.size(0), Hv, D, D});
  check_index(slots, "slots", qkv);
  check_index(start, "start", qkv);
  check_index(num_tokens, "num_tokens", qkv);

  const c10::cuda::CUDAGuard guard(qkv.device());
  auto y = at::empty({bs, Hv, D}, qkv.options());
  dflash::GatedDeltaStepParams p;
  p.dtype = *dtype;
  p.batch = static_cast<int>(bs);
  p.num_k_heads = static_cast<int>(num_k_heads);
  p.num_v_heads = static_cast<int>(Hv);
  p.qkv = qkv.data_ptr();
  p.qkv_stride = qkv.stride(0);
  p.a = a.data_ptr();
  p.b = b.data_ptr();
  p.ab_stride = a.stride(0);
  p.z = z.data_ptr();
  p.z_stride = z.stride(0);
  p.neg_a = neg_a.data_ptr<float>();
  p.dt_bias = dt_bias.data_ptr<float>();
  p.l2_eps = static_cast<float>(l2_eps);
  p.q_scale = static_cast<float>(q_scale);
  p.norm_weight = norm_weight.data_ptr();
  p.norm_eps = static_cast<float>(norm_eps);
  p.state_cache = state_cache.data_ptr<float>();
  p.slots = slots.data_ptr<int32_t>();
  p.start = start.data_ptr<int32_t>();
  p.num_tokens = num_tokens.data_ptr<int32_t>();
  p.y = y.data_ptr();
  if (const char* why = dflash::gated_delta_step_check(p)) DFLASH_CHECK(false, "gated_delta_step: ", why);
  check_launch(dflash::gated_delta_step_launch(p, c10::cuda::getCurrentCUDAStream().stream()), "gated_delta_step");
  return y;
}

at::Tensor gated_delta_step_meta(const at::Tensor& qkv, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const at::Tensor& neg_a, const at::Tensor&, const at::Tensor&, double, double, double,
                                 const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t) {
  return at::empty({qkv.size(0), neg_a.numel(), dflash::kGatedDeltaStepDim}, qkv.options());
}

at::Tensor gated_delta_recurrent_meta(const at::Tensor& q, const at::Tensor&, const at::Tensor& v, const at::Tensor&,
                                      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&, const at::Tensor&, std::optional<at::ScalarType> out_dtype,
                                      bool outputs) {
  return at::empty({outputs ? q.size(0) : 0, q.size(1), v.size(2), v.size(3)},
                   v.options().dtype(out_dtype.value_or(at::kFloat)));
}

// ---------------------------------------------------------------------------------------------
// Routed experts (moe.h). Scratch (the sort's outputs, the per-slot activations) comes from the
// caching allocator, so a launch can be captured in a CUDA graph.

// x [N, H] bf16, fp16 or fp32; gate_up [E, 2I, H], down [E, H, I] in x's dtype; weights [N, k]
// fp32; ids [N, k] int32; all contiguous. Returns [N, H] in fp32, or in x's dtype with fp32_out false.
// shared_last: a hint (moe.h) that every token's last pick is expert E - 1.
// norm: the residual add + norm after it (MoeTokenFusion::norm), or null.
// route: the router's logits and routing the kernels route from (MoeTokenFusion::route_logits; then
// weights and ids are not read and may be empty [N, k] tensors), or null.
struct RouteArgs {
  const at::Tensor& logits;
  bool renormalize;
};

at::Tensor moe_experts_run(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down,
                           const at::Tensor& weights, const at::Tensor& ids, bool fp32_out, bool shared_last,
                           const dflash::GemvNorm* norm, const RouteArgs* route, const char* op) {
  DFLASH_CHECK(x.is_cuda(), "x must be a CUDA tensor");
  const std::optional<dflash::DType> dtype = attention_dtype(x.scalar_type());
  DFLASH_CHECK(dtype.has_value(), "x must be bf16, fp16 or fp32, got ", x.scalar_type());
  DFLASH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [N, H] tensor, got ", x.sizes());
  DFLASH_CHECK(gate_up.dim() == 3 && down.dim() == 3, "gate_up must be [E, 2I, H] and down [E, H, I]");
  const int64_t N = x.size(0), H = x.size(1), E = gate_up.size(0), I = gate_up.size(1) / 2;
  DFLASH_CHECK(gate_up.size(1) == 2 * I && gate_up.size(2) == H, "gate_up must be [E, 2I, ", H, "], got ",
               gate_up.sizes());
  DFLASH_CHECK(down.size(0) == E && down.size(1) == H && down.size(2) == I, "down must be [", E, ", ", H, ", ", I,
               "], got ", down.sizes());
  for (const auto* t : {&gate_up, &down}) {
    DFLASH_CHECK(t->device() == x.device() && t->scalar_type() == x.scalar_type() && t->is_contiguous(),
                 "gate_up and down must be contiguous, on x's device, in x's dtype");
  }
  DFLASH_CHECK(ids.dim() == 2 && ids.size(0) == N && weights.sizes() == ids.sizes(),
               "weights and ids must be [N, k] with x's N");
  DFLASH_CHECK(weights.device() == x.device() && weights.scalar_type() == at::kFloat && weights.is_contiguous(),
               "weights must be contiguous fp32 on x's device");
  DFLASH_CHECK(ids.device() == x.device() && ids.scalar_type() == at::kInt && ids.is_contiguous(),
               "ids must be contiguous int32 on x's device");

  const c10::cuda::CUDAGuard guard(x.device());
  auto out = at::empty({N, H}, fp32_out ? x.options().dtype(at::kFloat) : x.options());
  dflash::MoeParams p;
  p.dtype = *dtype;
  p.out_dtype = fp32_out ? dflash::DType::kFloat32 : *dtype;
  p.tokens = static_cast<int>(N);
  p.top_k = static_cast<int>(ids.size(1));
  p.experts = static_cast<int>(E);
  p.hidden = static_cast<int>(H);
  p.inter = static_cast<int>(I);
  const int64_t slots = N * ids.size(1);
  auto work = at::empty({dflash::moe_work_ints(p)}, x.options().dtype(at::kInt));
  auto act = at::empty({slots, I}, x.options());
  auto y = at::empty({slots, H}, x.options());
  p.x = x.data_ptr();
  p.gate_up = gate_up.data_ptr();
  p.down = down.data_ptr();
  p.weights = weights.data_ptr<float>();
  p.ids = ids.data_ptr<int32_t>();
  p.work = work.data_ptr<int32_t>();
  p.act = act.data_ptr();
  p.y = y.data_ptr();
  p.out = out.data_ptr();
  p.shared_last = shared_last;
  dflash::MoeTokenFusion fusion;
  if (norm != nullptr) fusion.norm = *norm;
  if (route != nullptr) {
    const at::Tensor& logits = route->logits;
    DFLASH_CHECK(logits.device() == x.device() && logits.scalar_type() == x.scalar_type() && logits.dim() == 2 &&
                     logits.size(0) == N && logits.size(1) == E && logits.stride(1) >= 1,
                 op, ": logits must be [N, E] = [", N, ", ", E, "] (E counting a shared expert's gate) in x's dtype "
                 "on x's device, got ", logits.sizes(), " ", logits.scalar_type());
    fusion.route_logits = logits.data_ptr();
    fusion.route_stride = logits.stride(1);
    fusion.route_renormalize = route->renormalize;
    fusion.route_ids = ids.data_ptr<int32_t>();  // unread inputs: the routing's scratch
    fusion.route_weights = weights.data_ptr<float>();
    p.weights = nullptr;
    p.ids = nullptr;
  }
  if (const char* why = dflash::moe_check(p, &fusion)) DFLASH_CHECK(false, op, ": ", why);
  check_launch(dflash::moe_launch(p, c10::cuda::getCurrentCUDAStream().stream(), &fusion), op);
  return out;
}

at::Tensor moe_experts_cuda(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down,
                            const at::Tensor& weights, const at::Tensor& ids, bool fp32_out, bool shared_last) {
  return moe_experts_run(x, gate_up, down, weights, ids, fp32_out, shared_last, nullptr, nullptr, "moe_experts");
}

// moe_route, then moe_experts of one token (x [1, H], bf16 or fp16) with the output in x's
// dtype, then the residual add + norm after it, in one launch pair (the routing in the experts'
// kernels, the add + norm as linear_add_rms_norm's after its matmul): logits [1, E] in x's dtype
// (E counting a shared expert's gate, packed last in gate_up and down when `shared`), top_k the
// routed picks; residual [..., H] fp32, norm_weight [H], ticket one int32 zero. Returns (sum, out).
std::tuple<at::Tensor, at::Tensor> moe_experts_add_rms_norm_cuda(const at::Tensor& x, const at::Tensor& gate_up,
                                                                 const at::Tensor& down, const at::Tensor& logits,
                                                                 int64_t top_k, bool renormalize, bool shared,
                                                                 const at::Tensor& residual,
                                                                 const at::Tensor& norm_weight, double eps,
                                                                 bool zero_centered, const at::Tensor& ticket) {
  DFLASH_CHECK(x.is_cuda() && x.dim() == 2 && x.size(0) == 1, "moe_experts_add_rms_norm takes one token, x [1, H], got ",
               x.sizes());
  DFLASH_CHECK(top_k >= 1 && top_k <= dflash::kMoeRouteMaxTopK, "moe_experts_add_rms_norm: top_k must be in [1, ",
               dflash::kMoeRouteMaxTopK, "], got ", top_k);
  const c10::cuda::CUDAGuard guard(x.device());
  RowNorm norm(x, x.size(1), residual, norm_weight, eps, zero_centered, ticket, "moe_experts_add_rms_norm");
  const int64_t picks = top_k + (shared ? 1 : 0);  // the kernels' k; weights and ids their scratch
  const RouteArgs route{logits, renormalize};
  moe_experts_run(x, gate_up, down, at::empty({1, picks}, x.options().dtype(at::kFloat)),
                  at::empty({1, picks}, x.options().dtype(at::kInt)), false, shared, &norm.params, &route,
                  "moe_experts_add_rms_norm");
  return {norm.sum, norm.out};
}

// ids [N, k] int32 contiguous -> (order [N k]: the slots grouped by expert, then those with an
// id outside [0, E); rows [N k]: each slot's position in order; ends [E]: cumulative counts).
std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_sort_cuda(const at::Tensor& ids, int64_t num_experts) {
  DFLASH_CHECK(ids.is_cuda() && ids.scalar_type() == at::kInt && ids.is_contiguous(),
               "ids must be a contiguous int32 CUDA tensor");
  DFLASH_CHECK(num_experts >= 1 && num_experts <= dflash::kMoeMaxExperts, "moe_sort: num_experts must be in [1, ",
               dflash::kMoeMaxExperts, "]");
  const c10::cuda::CUDAGuard guard(ids.device());
  dflash::MoeSortParams p;
  p.slots = static_cast<int>(ids.numel());
  p.experts = static_cast<int>(num_experts);
  DFLASH_CHECK(ids.numel() < (int64_t{1} << 30), "moe_sort: too many slots");
  auto work = at::empty({dflash::moe_sort_work_ints(p)}, ids.options());
  p.ids = ids.data_ptr<int32_t>();
  p.work = work.data_ptr<int32_t>();
  if (const char* why = dflash::moe_sort_check(p)) DFLASH_CHECK(false, "moe_sort: ", why);
  check_launch(dflash::moe_sort_launch(p, c10::cuda::getCurrentCUDAStream().stream()), "moe_sort");
  const int64_t S = p.slots, E = num_experts;  // the layout of moe.h
  return {work.narrow(0, E + 1, S), work.narrow(0, E + 1 + S, S), work.narrow(0, 0, E)};
}

// y [N k, H] (bf16, fp16 or fp32, contiguous): row rows[s] (or s) is slot s's expert output;
// weights [N, k] fp32, ids [N, k] int32. Returns [N, H]: the fp32 sum, or (fp32_out false) that sum
// rounded to y's dtype by the kernel's store, without a cast kernel after it.
at::Tensor moe_combine_cuda(const at::Tensor& y, const at::Tensor& weights, const at::Tensor& ids,
                            const std::optional<at::Tensor>& rows, int64_t num_experts, bool fp32_out) {
  DFLASH_CHECK(y.is_cuda(), "y must be a CUDA tensor");
  const std::optional<dflash::DType> dtype = attention_dtype(y.scalar_type());
  DFLASH_CHECK(dtype.has_value(), "y must be bf16, fp16 or fp32, got ", y.scalar_type());
  DFLASH_CHECK(ids.dim() == 2 && weights.sizes() == ids.sizes(), "weights and ids must be [N, k]");
  const int64_t N = ids.size(0), k = ids.size(1);
  DFLASH_CHECK(y.dim() == 2 && y.size(0) == N * k && y.is_contiguous(), "y must be a contiguous [N k, H] tensor");
  DFLASH_CHECK(weights.device() == y.device() && weights.scalar_type() == at::kFloat && weights.is_contiguous(),
               "weights must be contiguous fp32 on y's device");
  DFLASH_CHECK(ids.device() == y.device() && ids.scalar_type() == at::kInt && ids.is_contiguous(),
               "ids must be contiguous int32 on y's device");
  if (rows) {
    DFLASH_CHECK(rows->device() == y.device() && rows->scalar_type() == at::kInt && rows->is_contiguous() &&
                     rows->numel() == N * k,
                 "rows must be contiguous int32 [N k] on y's device");
  }
  const c10::cuda::CUDAGuard guard(y.device());
  auto out = at::empty({N, y.size(1)}, fp32_out ? y.options().dtype(at::kFloat) : y.options());
  dflash::MoeCombineParams p;
  p.dtype = *dtype;
  p.out_dtype = fp32_out ? dflash::DType::kFloat32 : *dtype;
  p.tokens = static_cast<int>(N);
  p.top_k = static_cast<int>(k);
  p.experts = static_cast<int>(num_experts);
  p.hidden = static_cast<int>(y.size(1));
  p.y = y.data_ptr();
  p.rows = rows ? rows->data_ptr<int32_t>() : nullptr;
  p.weights = weights.data_ptr<float>();
  p.ids = ids.data_ptr<int32_t>();
  p.out = out.data_ptr();
  if (const char* why = dflash::moe_combine_check(p)) DFLASH_CHECK(false, "moe_combine: ", why);
  check_launch(dflash::moe_combine_launch(p, c10::cuda::getCurrentCUDAStream().stream()), "moe_combine");
  return out;
}

// Routing (moe_route.h): logits [N, E] bf16, fp16 or fp32, any strides (the router's
// W x^T read as its transpose) -> (weights [N, k] fp32, ids [N, k] int32).
std::tuple<at::Tensor, at::Tensor> moe_route_cuda(const at::Tensor& logits, int64_t top_k, bool renormalize,
                                                   bool shared) {
  DFLASH_CHECK(logits.is_cuda(), "logits must be a CUDA tensor");
  const std::optional<dflash::DType> dtype = attention_dtype(logits.scalar_type());
  DFLASH_CHECK(dtype.has_value(), "logits must be bf16, fp16 or fp32, got ", logits.scalar_type());
  DFLASH_CHECK(logits.dim() == 2 && logits.stride(0) >= 1 && logits.stride(1) >= 1,
               "logits must be an [N, E] tensor with positive strides, got sizes ", logits.sizes(), " strides ",
               logits.strides());
  DFLASH_CHECK(logits.size(0) < (int64_t{1} << 31), "moe_route: too many tokens");
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t picks = top_k + (shared ? 1 : 0);
  auto weights = at::empty({logits.size(0), picks}, logits.options().dtype(at::kFloat));
  auto ids = at::empty({logits.size(0), picks}, logits.options().dtype(at::kInt));
  dflash::MoeRouteParams p;
  p.dtype = *dtype;
  p.tokens = static_cast<int>(logits.size(0));
  p.experts = static_cast<int>(logits.size(1) - (shared ? 1 : 0));
  p.top_k = static_cast<int>(top_k);
  p.renormalize = renormalize;
  p.shared = shared;
  p.logits = logits.data_ptr();
  p.token_stride = logits.stride(0);
  p.expert_stride = logits.stride(1);
  p.weights = weights.data_ptr<float>();
  p.ids = ids.data_ptr<int32_t>();
  if (const char* why = dflash::moe_route_check(p)) DFLASH_CHECK(false, "moe_route: ", why);
  check_launch(dflash::moe_route_launch(p, c10::cuda::getCurrentCUDAStream().stream()), "moe_route");
  return {weights, ids};
}

std::tuple<at::Tensor, at::Tensor> moe_route_meta(const at::Tensor& logits, int64_t top_k, bool, bool shared) {
  const int64_t picks = top_k + (shared ? 1 : 0);
  return {at::empty({logits.size(0), picks}, logits.options().dtype(at::kFloat)),
          at::empty({logits.size(0), picks}, logits.options().dtype(at::kInt))};
}

at::Tensor moe_experts_meta(const at::Tensor& x, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, bool fp32_out, bool) {
  return at::empty(x.sizes(), fp32_out ? x.options().dtype(at::kFloat) : x.options());
}

std::tuple<at::Tensor, at::Tensor> moe_experts_add_rms_norm_meta(const at::Tensor& x, const at::Tensor&,
                                                                 const at::Tensor&, const at::Tensor&, int64_t, bool,
                                                                 bool, const at::Tensor& residual, const at::Tensor&,
                                                                 double, bool, const at::Tensor&) {
  return {at::empty(residual.sizes(), residual.options()), at::empty(residual.sizes(), x.options())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_sort_meta(const at::Tensor& ids, int64_t num_experts) {
  return {at::empty({ids.numel()}, ids.options()), at::empty({ids.numel()}, ids.options()),
          at::empty({num_experts}, ids.options())};
}

at::Tensor moe_combine_meta(const at::Tensor& y, const at::Tensor&, const at::Tensor& ids,
                            const std::optional<at::Tensor>&, int64_t, bool fp32_out) {
  return at::empty({ids.size(0), y.size(1)}, fp32_out ? y.options().dtype(at::kFloat) : y.options());
}

}  // namespace

TORCH_LIBRARY(dflash, m) {
  m.def(
      "block_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor ctx_len, Tensor q_start, "
      "Tensor? k_blk, Tensor? v_blk, bool causal, int window, float scale, int max_keys=0, int num_splits=0) "
      "-> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool zero_centered=False) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps, bool zero_centered=False) -> (Tensor, Tensor)");
  m.def("gated_rms_norm(Tensor x, Tensor gate, Tensor weight, float eps) -> Tensor");
  m.def(
      "qk_norm_rope(Tensor qkv, int num_q_heads, int num_kv_heads, Tensor? q_weight, Tensor k_weight, float eps, "
      "Tensor cos, Tensor sin, Tensor(a!)? k_cache=None, Tensor(b!)? v_cache=None, Tensor? slots=None, "
      "Tensor? positions=None, bool zero_centered=False, int rotary_dim=0, bool q_gate=False) "
      "-> (Tensor, Tensor, Tensor)");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("sigmoid_gate(Tensor x, Tensor gate) -> Tensor");
  m.def("random_uniform(Tensor keys, int cols, bool gumbel=False) -> Tensor");
  m.def("gemv(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def(
      "linear_add_rms_norm(Tensor x, Tensor weight, Tensor? bias, Tensor residual, Tensor norm_weight, float eps, "
      "bool zero_centered, Tensor(a!) ticket) -> (Tensor, Tensor)");
  m.def(
      "causal_conv(Tensor x, Tensor weight, Tensor(a!) conv_cache, Tensor(b!)? snapshots, Tensor slots, "
      "Tensor start, Tensor? num_tokens=None) -> Tensor");
  m.def(
      "gated_delta_recurrent(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor state_cache, "
      "Tensor(a!) snapshot_cache, Tensor slots, Tensor start, Tensor num_tokens, ScalarType? out_dtype=None, "
      "bool outputs=True) -> Tensor");
  m.def(
      "gated_delta_step(Tensor qkv, Tensor a, Tensor b, Tensor z, Tensor neg_a, Tensor dt_bias, Tensor norm_weight, "
      "float norm_eps, float l2_eps, float q_scale, Tensor(a!) state_cache, Tensor slots, Tensor start, "
      "Tensor num_tokens, int num_k_heads) -> Tensor");
  m.def(
      "gated_delta_prepare(Tensor qkv, Tensor a, Tensor b, Tensor neg_a, Tensor dt_bias, int num_k_heads, "
      "int key_dim, int value_dim, float eps, float q_scale) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "gated_delta_prepare_into(Tensor qkv, Tensor a, Tensor b, Tensor neg_a, Tensor dt_bias, Tensor(a!) q, "
      "Tensor(b!) k, Tensor(c!) v, Tensor(d!) g, Tensor(e!) beta, int num_k_heads, int key_dim, int value_dim, "
      "float eps, float q_scale) -> ()");
  m.def("moe_route(Tensor logits, int top_k, bool renormalize, bool shared) -> (Tensor, Tensor)");
  m.def(
      "moe_experts(Tensor x, Tensor gate_up, Tensor down, Tensor weights, Tensor ids, bool fp32_out=True, "
      "bool shared_last=False) -> Tensor");
  m.def(
      "moe_experts_add_rms_norm(Tensor x, Tensor gate_up, Tensor down, Tensor logits, int top_k, bool renormalize, "
      "bool shared, Tensor residual, Tensor norm_weight, float eps, bool zero_centered, Tensor(a!) ticket) "
      "-> (Tensor, Tensor)");
  m.def("moe_sort(Tensor ids, int num_experts) -> (Tensor, Tensor, Tensor)");
  m.def(
      "moe_combine(Tensor y, Tensor weights, Tensor ids, Tensor? rows, int num_experts, bool fp32_out=True) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(dflash, CUDA, m) {
  m.impl("block_attention", &block_attention_cuda);
  m.impl("rms_norm", &rms_norm_cuda);
  m.impl("add_rms_norm", &add_rms_norm_cuda);
  m.impl("gated_rms_norm", &gated_rms_norm_cuda);
  m.impl("qk_norm_rope", &qk_norm_rope_cuda);
  m.impl("silu_mul", &silu_mul_cuda);
  m.impl("sigmoid_gate", &sigmoid_gate_cuda);
  m.impl("random_uniform", &random_uniform_cuda);
  m.impl("gemv", &gemv_cuda);
  m.impl("linear_add_rms_norm", &linear_add_rms_norm_cuda);
  m.impl("causal_conv", &causal_conv_cuda);
  m.impl("gated_delta_recurrent", &gated_delta_recurrent_cuda);
  m.impl("gated_delta_prepare", &gated_delta_prepare_cuda);
  m.impl("gated_delta_step", &gated_delta_step_cuda);
  m.impl("gated_delta_prepare_into", &gated_delta_prepare_into);
  m.impl("moe_route", &moe_route_cuda);
  m.impl("moe_experts", &moe_experts_cuda);
  m.impl("moe_experts_add_rms_norm", &moe_experts_add_rms_norm_cuda);
  m.impl("moe_sort", &moe_sort_cuda);
  m.impl("moe_combine", &moe_combine_cuda);
}

TORCH_LIBRARY_IMPL(dflash, Meta, m) {
  m.impl("block_attention", &block_attention_meta);
  m.impl("rms_norm", &rms_norm_meta);
  m.impl("add_rms_norm", &add_rms_norm_meta);
  m.impl("gated_rms_norm", &gated_rms_norm_meta);
  m.impl("qk_norm_rope", &qk_norm_rope_meta);
  m.impl("silu_mul", &silu_mul_meta);
  m.impl("sigmoid_gate", &sigmoid_gate_meta);
  m.impl("random_uniform", &random_uniform_meta);
  m.impl("gemv", &gemv_meta);
  m.impl("linear_add_rms_norm", &linear_add_rms_norm_meta);
  m.impl("causal_conv", &causal_conv_meta);
  m.impl("gated_delta_recurrent", &gated_delta_recurrent_meta);
  m.impl("gated_delta_prepare", &gated_delta_prepare_meta);
  m.impl("gated_delta_step", &gated_delta_step_meta);
  m.impl("moe_route", &moe_route_meta);
  m.impl("moe_experts", &moe_experts_meta);
  m.impl("moe_experts_add_rms_norm", &moe_experts_add_rms_norm_meta);
  m.impl("moe_sort", &moe_sort_meta);
  m.impl("moe_combine", &moe_combine_meta);
}
