#!/usr/bin/env bash
# Downloads the wheels bench/gpu/run.sh installs on a GPU machine that has no network (bench/gpu/wheels.txt:
# what the engine, its gpu tests and the benches import beyond that machine's own packages; never torch) into
# .whl at the repository's root, for x86-64 Linux and Python 3.12.
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl -r bench/gpu/wheels.txt
du -ch .whl/*.whl | tail -1
