#!/usr/bin/env bash
# The demo MoE as GGUF files made by llama.cpp's own tools, for `npumoed bench fidelity --peer` (and any bench that
# compares with llama.cpp on the file it would be given): convert_hf_to_gguf.py writes the checkpoint in bf16, then
# llama-quantize writes each type from it. Usage: make-demo-ggufs.sh [CHECKPOINT] [OUT] [TYPE ...] writes
# OUT/NAME-bf16.gguf and OUT/NAME-<type>.gguf (NAME: demo, or the folder name of a checkpoint given); defaults: the
# demo checkpoint `make setup` made, ~/.cache/npumoe/peer, Q4_K_M Q4_0 Q8_0. A file already there is kept. Needs
# the peer build (bench/peer/build-llama-cpp.sh; NPUMOE_LLAMA_CPP names another) and sentencepiece for the
# converter.
set -euo pipefail
cache=${XDG_CACHE_HOME:-$HOME/.cache}/npumoe
llama=${NPUMOE_LLAMA_CPP:-$cache/llama.cpp}
checkpoint=${1:-$cache/models/demo-smollm2-135m-moe-8x1-bf16-v2}
out=${2:-$cache/peer}
types=("${@:3}")
(( ${#types[@]} )) || types=(Q4_K_M Q4_0 Q8_0)
name=demo  # the files are named for the demo unless another checkpoint is given
(( $# )) && name=$(basename "$checkpoint")
mkdir -p "$out"
source_file="$out/$name-bf16.gguf"
[[ -f "$source_file" ]] || python3 "$llama/convert/convert_hf_to_gguf.py" "$checkpoint" --outtype bf16 \
    --outfile "$source_file"
for type in "${types[@]}"; do
    target="$out/$name-$(tr '[:upper:]' '[:lower:]' <<<"$type").gguf"
    [[ -f "$target" ]] || "$llama/bin/llama-quantize" "$source_file" "$target" "$type" "$(nproc)"
    echo "$target"
done
