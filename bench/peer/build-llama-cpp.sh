#!/usr/bin/env bash
# Builds llama.cpp's llama-bench, llama-quantize, llama-completion and llama-perplexity, the C++ peer that
# `npumoed bench prefill`, `bench document` and `bench fidelity` run beside the engine, and keeps its
# convert_hf_to_gguf.py (with its gguf-py) for turning a checkpoint into GGUF; from the llama-cpp-python sdist on
# the package index (its vendor/llama.cpp): nothing from outside the registries. About 15 minutes on 2 cores. Usage: build-llama-cpp.sh
# [DEST] (default ~/.cache/npumoe/llama.cpp); the binaries land in DEST/bin. Needs cmake and ninja (Debian:
# apt-get install cmake ninja-build) and pip.
set -euo pipefail
dest=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/npumoe/llama.cpp}
version=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}  # the sdist whose vendored llama.cpp is built; named in results
for tool in cmake ninja; do
    command -v "$tool" >/dev/null || { echo "build-llama-cpp: $tool is needed (Debian: cmake, ninja-build)" >&2; exit 2; }
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$work"
tar -xzf "$work"/llama_cpp_python-"$version".tar.gz -C "$work"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
# Native code for this CPU, as a person building it here would; no network (CURL), only the two tools.
flags=(-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
       -DLLAMA_BUILD_SERVER=OFF -DBUILD_SHARED_LIBS=OFF)
# On a CPU with AMX-INT8 a native build's quantized weights crash once repacked for AMX (llama.cpp issue 20824,
# seen here on a Sapphire Rapids with Q8_0 and Q4_0): every other feature of this CPU is named instead, AMX left out.
cpu_flags=$(sed -n 's/^flags[[:space:]]*:[[:space:]]*//p' /proc/cpuinfo 2>/dev/null | head -n 1)
if [[ " $cpu_flags " == *" amx_int8 "* ]]; then
    flags=("${flags[@]/-DGGML_NATIVE=ON/-DGGML_NATIVE=OFF}")
    for pair in avx:AVX avx2:AVX2 bmi2:BMI2 fma:FMA f16c:F16C avx_vnni:AVX_VNNI avx512f:AVX512 \
                avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
        [[ " $cpu_flags " == *" ${pair%%:*} "* ]] && flags+=("-DGGML_${pair#*:}=ON")
    done
fi
read -r -a extra <<<"${LLAMA_CPP_CMAKE_FLAGS:-}"  # anything else a person wants to try, recorded in VERSION
flags+=("${extra[@]}")
cmake -S "$src" -B "$work/build" -G Ninja "${flags[@]}" >/dev/null
# `bench document` times whole documents with the one-shot text tool: llama-completion, llama-cli before it existed
completion=llama-completion
[[ -d "$src/tools/completion" ]] || completion=llama-cli
cmake --build "$work/build" --target llama-bench llama-quantize llama-perplexity "$completion" -j "$(nproc)"
mkdir -p "$dest/bin"
cp "$work/build/bin/llama-bench" "$work/build/bin/llama-quantize" "$work/build/bin/llama-perplexity" \
    "$work/build/bin/$completion" "$dest/bin/"
# the converter reads its own gguf-py first (it is newer than the gguf package npumoed uses); it needs sentencepiece
rm -rf "$dest/convert" && mkdir -p "$dest/convert"
cp -r "$src/convert_hf_to_gguf.py" "$src/gguf-py" "$dest/convert/"
[[ -d "$src/conversion" ]] && cp -r "$src/conversion" "$dest/convert/"  # newer converters are a package
# The results' settings block quotes this file: which llama.cpp, built how.
printf 'llama-cpp-python %s, built %s on %s\ncmake %s\n' "$version" "$(date -u +%FT%TZ)" "$(uname -m)" \
    "${flags[*]}" > "$dest/VERSION"
echo "built: $dest/bin/llama-bench $dest/bin/llama-quantize $dest/bin/llama-perplexity $dest/bin/$completion;" \
    "converter: $dest/convert/convert_hf_to_gguf.py"
