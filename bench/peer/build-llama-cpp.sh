#!/usr/bin/env bash
# Builds llama.cpp's llama-bench and llama-quantize, the C++ peer `npumoed bench prefill --peer` runs beside the
# engine, from the llama-cpp-python sdist on the package index (its vendor/llama.cpp): nothing from outside the
# registries. About 15 minutes on 2 cores. Usage: build-llama-cpp.sh [DEST] (default ~/.cache/npumoe/llama.cpp);
# the binaries land in DEST/bin. Needs cmake and ninja (Debian: apt-get install cmake ninja-build) and pip.
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
cmake -S "$src" -B "$work/build" -G Ninja "${flags[@]}" >/dev/null
cmake --build "$work/build" --target llama-bench llama-quantize -j "$(nproc)"
mkdir -p "$dest/bin"
cp "$work/build/bin/llama-bench" "$work/build/bin/llama-quantize" "$dest/bin/"
# The results' settings block quotes this file: which llama.cpp, built how.
printf 'llama-cpp-python %s, built %s on %s\ncmake %s\n' "$version" "$(date -u +%FT%TZ)" "$(uname -m)" \
    "${flags[*]}" > "$dest/VERSION"
echo "built: $dest/bin/llama-bench $dest/bin/llama-quantize"
