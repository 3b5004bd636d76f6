#!/usr/bin/env bash
# Builds llama.cpp from source for this machine (GGML_NATIVE=ON, CPU only, shared libraries), from the
# git bundle of the release .ci/setup keeps in .cache/llama.cpp, into .cache/llama.cpp/native (lib/,
# include/, bin/, VERSION). Reconfigure the efim build afterwards: it then builds efim-llama-native,
# the same reference program as efim-llama-reference over these libraries, and efim-model-bench
# compares with both. Takes about 5 minutes on 2 cores.
#
#   bench/build_llama_cpp.sh            the libraries
#   bench/build_llama_cpp.sh --server   and llama-server (bin/), for the HTTP benchmarks
#   bench/build_llama_cpp.sh --no-amx   this machine's best without the AMX tile kernels (-mno-amx-*):
#                                       on a VM whose CPUID advertises AMX, llama.cpp's native build
#                                       dies with SIGILL in its tile kernels (tileloadd in a worker
#                                       thread) on quantized files; this is the build to compare with
#   bench/build_llama_cpp.sh --avx2     for x86-64-v3 (AVX2, FMA, F16C) instead of this machine's best,
#                                       to compare with efim's AVX2 path on an AVX-512 machine
#   bench/build_llama_cpp.sh --cuda     llama.cpp's CUDA build instead: llama-bench (pp/tg) and
#                                       llama-batched-bench (decode of many sequences at once) over
#                                       shared, stripped libraries, for CUDA_ARCHITECTURES (default 90,
#                                       Hopper), into .cache/llama.cpp/cuda (bin/, lib/): the peer of
#                                       efim-cuda-bench. Needs the CUDA toolkit, not a GPU (build here,
#                                       run where one is, with the toolkit's libcudart and libcublas).
#                                       About 27 minutes on 2 cores (AMD EPYC Zen 4); libggml-cuda is
#                                       most of its size (about 40 MB under xz).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=$PWD/.cache/llama.cpp
bundle=$dir/gitRelease.bundle
targets=(llama)
isa=(-DGGML_NATIVE=ON)
what="GGML_NATIVE=ON"
cuda=(-DGGML_CUDA=OFF -DBUILD_SHARED_LIBS=ON)
kind=native
for arg in "$@"; do
  case $arg in
    --server) targets+=(llama-server) ;;
    --no-amx)
      # GCC and clang let an explicit -mno-* win over what -march=native implies, wherever it stands.
      isa=(-DGGML_NATIVE=ON "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
           "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
      what="GGML_NATIVE=ON without AMX (-mno-amx-tile -mno-amx-int8 -mno-amx-bf16)" ;;
    --avx2)
      isa=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
           -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF)
      what="GGML_NATIVE=OFF, AVX2 + FMA + F16C (x86-64-v3)" ;;
    --cuda)
      targets=(llama-bench llama-batched-bench)
      isa=(-DGGML_NATIVE=OFF)
      cuda=(-DGGML_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHITECTURES:-90}" -DGGML_CUDA_NCCL=OFF
            -DBUILD_SHARED_LIBS=ON -DLLAMA_BUILD_TOOLS=ON
            # (libggml-cuda needs the driver's libcuda.so.1, which a machine without a GPU lacks: the
            # programs are linked without resolving it, and find it where they run.)
            -DCMAKE_EXE_LINKER_FLAGS=-Wl,--allow-shlib-undefined)
      kind=cuda
      what="GGML_CUDA=ON for CUDA architectures ${CUDA_ARCHITECTURES:-90}, GGML_NATIVE=OFF" ;;
    *) echo "build_llama_cpp: unknown option $arg" >&2; exit 2 ;;
  esac
done
if [ ! -f "$bundle" ] || [ ! -f "$dir/VERSION" ]; then
  echo "build_llama_cpp: no $bundle; run .ci/setup first" >&2
  exit 1
fi
commit=$(sed -n 's/.*commit \([0-9a-f]\{40\}\).*/\1/p' "$dir/VERSION" | head -n 1)
[ -n "$commit" ] || { echo "build_llama_cpp: no commit in $dir/VERSION" >&2; exit 1; }

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
git init -q "$scratch/git"
git -C "$scratch/git" bundle unbundle "$bundle" >/dev/null 2>&1
mkdir "$scratch/src"
git -C "$scratch/git" archive "$commit" | tar -x -C "$scratch/src"

log=$scratch/build.log
# ccache (which llama.cpp's CMake uses where it is installed) keyed on paths relative to the scratch
# folder, so that a build in another scratch folder finds the objects of an earlier one.
export CCACHE_BASEDIR=$scratch CCACHE_NOHASHDIR=1
if [ $kind = cuda ] && ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi
if ! { cmake -S "$scratch/src" -B "$scratch/build" -DCMAKE_BUILD_TYPE=Release \
         "${isa[@]}" "${cuda[@]}" -DGGML_BACKEND_DL=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
         -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DCMAKE_BUILD_RPATH='$ORIGIN/../lib' &&
       cmake --build "$scratch/build" -j"$(nproc)" --target "${targets[@]}"; } >"$log" 2>&1; then
  tail -n 40 "$log" >&2
  echo "build_llama_cpp: the build failed (above: the end of its log)" >&2
  exit 1
fi

out=$dir/$kind
rm -rf "$out"
mkdir -p "$out/lib" "$out/include" "$out/bin"
find "$scratch/build" -name 'lib*.so*' -exec cp -P {} "$out/lib/" \;
cp "$scratch/src/include/llama.h" "$scratch/src/include/llama-cpp.h" "$scratch"/src/ggml/include/*.h "$out/include/"
for program in llama-server llama-bench llama-batched-bench; do
  [ -f "$scratch/build/bin/$program" ] && cp "$scratch/build/bin/$program" "$out/bin/"
done
if [ $kind = cuda ]; then strip "$out"/bin/*; find "$out/lib" -type f -name "*.so*" -exec strip {} +; fi
{
  echo "llama.cpp commit $commit, built from source here: $what$([ $kind = cuda ] || echo ", CPU only")"
  echo "cpu: $(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1)"
  echo "compiler: $(c++ --version | head -n 1)"
} > "$out/VERSION"
echo "build_llama_cpp: llama.cpp $commit ($what) in $out"
