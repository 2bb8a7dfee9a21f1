#!/usr/bin/env bash
# `make test-arm64`: the engine's tests in an arm64 Debian userland under qemu-user emulation, built only from
# registry packages (Debian's qemu-user-static and debootstrap, the aarch64 wheels on the package index).
# Needs root (debootstrap, binfmt_misc, chroot). Both the root and the wheels are cached and rebuilt only
# when their recipe changes. Emulated speed means nothing; what counts is that the results are right.
#   tests/arm64/run.sh [PYTEST ARGS…]   (default: the paths below, -m "not slow")
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
CACHE=${NPUMOE_ARM64_CACHE:-$HOME/.cache/npumoe/arm64}
SUITE=bookworm  # its python3 is 3.11, the wheels' --python-version below
PACKAGES=python3,python3-venv,python3-dev,gcc,libc6-dev,ca-certificates,libgomp1,procps
PYVER=3.11
HOST_PYTHON=$REPO/.venv/bin/python  # `make setup`'s venv: its pip unpacks the aarch64 wheels
# The emulated CPU: qemu's newest, without SVE, as Apple silicon is (NEON with dot products, i8mm and bf16). With
# SVE, torch's float32 matmuls of transposed operands came out wrong under qemu 7.2 (relative error 0.6 against
# float64; right without SVE), so a test comparing with transformers' eager attention (gpt-oss's) failed.
export QEMU_CPU=${QEMU_CPU:-max,sve=off}
# The demo run takes over ten times the host's time under emulation (over 30 minutes for the six samples, and for
# two with the long one's vectors): the shortest sample shows the pipeline works (tests/support/demo_run.py).
export NPUMOE_TEST_DEMO_SAMPLES=${NPUMOE_TEST_DEMO_SAMPLES:-1}
# The engine's tests: kernels, quantization, equivalence, prefill, and the demo's pipeline.
DEFAULT_TESTS=(tests/engine/test_neon_linear.py tests/engine/test_vnni_linear.py tests/engine/test_quantize.py
    tests/engine/test_quantized_weights.py tests/engine/test_equivalence.py tests/engine/test_engine.py
    tests/engine/test_cpu_experts.py tests/engine/test_projections.py tests/engine/test_attention_kernel.py
    tests/engine/test_norms.py tests/engine/test_combine_kernel.py tests/demo)

say() { echo "arm64: $*" >&2; }
[[ $(id -u) == 0 ]] || { say "needs root (debootstrap, binfmt_misc, chroot)"; exit 2; }

need_tools() {
    local missing=()
    command -v qemu-aarch64-static >/dev/null || missing+=(qemu-user-static)
    command -v debootstrap >/dev/null || missing+=(debootstrap)
    command -v update-binfmts >/dev/null || missing+=(binfmt-support)
    if ((${#missing[@]})); then
        say "installing ${missing[*]}"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
    mountpoint -q /proc/sys/fs/binfmt_misc || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
    update-binfmts --enable qemu-aarch64 2>/dev/null || true
    [[ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]] || { say "qemu-aarch64 is not registered with binfmt_misc"; exit 2; }
}

# The first Debian mirror this machine's apt is configured with (deb822 or one-line sources).
debian_mirror() {
    local uri
    uri=$(grep -hs -E '^URIs:' /etc/apt/sources.list.d/*.sources | awk '$2 !~ /security/ {print $2; exit}')
    [[ -n "$uri" ]] || uri=$(grep -hs -E '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list |
        awk '$2 !~ /security/ {print $2; exit}')
    echo "${uri:-http://deb.debian.org/debian}"
}

# The root, made once per recipe (suite and packages); a half-made one is never used.
ROOT=$CACHE/root
build_root() {
    local recipe="$SUITE $PACKAGES"
    if [[ -f $ROOT/.recipe && "$(cat "$ROOT/.recipe")" == "$recipe" ]]; then return; fi
    local mirror; mirror=$(debian_mirror)
    say "building the $SUITE arm64 root from $mirror (a few minutes)"
    rm -rf "$ROOT.partial" && mkdir -p "$CACHE"
    debootstrap --arch=arm64 --variant=minbase --include="$PACKAGES" "$SUITE" "$ROOT.partial" "$mirror" \
        >"$CACHE/debootstrap.log" 2>&1 || { say "debootstrap failed; see $CACHE/debootstrap.log"; exit 1; }
    echo "$recipe" >"$ROOT.partial/.recipe"
    rm -rf "$ROOT" && mv "$ROOT.partial" "$ROOT"
}

# The project's dependencies as aarch64 wheels, unpacked on the host by its own pip (under emulation pip took 11
# minutes for torch alone), into a folder named by their list. coremltools has no aarch64 Linux wheel (Core ML is
# macOS's; its tests do not run here), nor has pgserver (the PostgreSQL queue's tests do not either); the dev
# extras' linters are not needed. The platform tags are listed one by one: pip does not widen manylinux_2_28.
SITE=
install_wheels() {
    local requirements
    requirements=$(cd "$REPO" && "$HOST_PYTHON" -c 'import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))
dev = [r for r in project["project"]["optional-dependencies"]["dev"] if not r.startswith(("ruff", "actionlint", "pgserver"))]
print("\n".join(r for r in project["project"]["dependencies"] + dev if not r.startswith("coremltools")))')
    SITE=$CACHE/site-$(sha256sum <<<"$requirements $PYVER" | cut -c1-16)
    [[ -f $SITE/.complete ]] && return
    local platforms=() v
    for v in $(seq 17 36); do platforms+=(--platform "manylinux_2_${v}_aarch64"); done  # bookworm's glibc is 2.36
    say "installing the aarch64 wheels into $SITE (a few GB, minutes)"
    rm -rf "$SITE" && mkdir -p "$SITE"
    "$HOST_PYTHON" -m pip install --quiet --disable-pip-version-check --target "$SITE" "${platforms[@]}" \
        --platform manylinux2014_aarch64 --platform linux_aarch64 --only-binary=:all: --python-version "$PYVER" \
        --implementation cp -r /dev/stdin <<<"$requirements" 2>&1 | grep -v "^WARNING: Location 'file:" >&2 || true
    [[ -d $SITE/torch ]] || { say "the aarch64 wheels did not install"; exit 1; }
    touch "$SITE/.complete"
}

# Inside the root, in a mount namespace of its own (nothing to unmount after): the repository at /repo, the wheels
# at /opt/site, the host's models cache (the demo model `make setup` made) at the root user's.
in_root() {
    local models=${NPUMOE_MODELS:-$HOME/.cache/npumoe/models}
    mkdir -p "$ROOT/repo" "$ROOT/opt/site" "$ROOT/root/.cache/npumoe/models" "$models"
    unshare --mount --propagation private /bin/sh -ec '
        mount --bind "$1" "$0/repo"
        mount --bind -o ro "$2" "$0/opt/site"
        mount --bind "$3" "$0/root/.cache/npumoe/models"
        mount -t proc proc "$0/proc"
        chroot "$0" python3 /repo/tests/arm64/cpuinfo.py >"$0/run/cpuinfo"  # what qemu 7.2 does not show
        mount --bind "$0/run/cpuinfo" "$0/proc/cpuinfo"
        mount -t tmpfs sys "$0/sys"  # not the host sysfs (oneDNN crashes on its x86 CPUs): the CPU lists alone
        mkdir -p "$0/sys/devices/system/cpu"
        for list in possible present online; do echo "0-$(($(nproc) - 1))" >"$0/sys/devices/system/cpu/$list"; done
        mount --rbind /dev "$0/dev"
        shift 3; exec chroot "$0" /usr/bin/env -i QEMU_CPU="$QEMU_CPU" HOME=/root LANG=C.UTF-8 \
            NPUMOE_TEST_DEMO_SAMPLES="$NPUMOE_TEST_DEMO_SAMPLES" PATH=/opt/venv/bin:/usr/bin:/bin "$@"' \
        "$ROOT" "$REPO" "$SITE" "$models" "$@"
}

# A venv that sees the wheels (a .pth) with the repository installed editable, remade when pyproject.toml changes.
make_venv() {
    local stamp; stamp=$(cat "$REPO/pyproject.toml" "$SITE/.complete" | sha256sum | cut -c1-16)-$(basename "$SITE")
    [[ -f $ROOT/opt/venv/.stamp && "$(cat "$ROOT/opt/venv/.stamp")" == "$stamp" ]] && return
    say "making the root's venv and installing the repository in it"
    rm -rf "$ROOT/opt/venv"
    in_root /bin/sh -ec "python3 -m venv /opt/venv
        echo /opt/site > /opt/venv/lib/python$PYVER/site-packages/arm64-wheels.pth
        cd /repo && PYTHONPATH=/opt/site pip install --quiet --no-deps --no-build-isolation --disable-pip-version-check -e ."
    echo "$stamp" >"$ROOT/opt/venv/.stamp"
}

need_tools
build_root
install_wheels
make_venv
(($#)) || set -- -m "not slow" "${DEFAULT_TESTS[@]}"
say "running pytest $* under emulation"
# Emulated, a test takes 5 to 10 times as long as on the host (the demo run's set-up over 10 minutes): each may
# take 30 minutes before pytest-timeout calls it hung.
in_root /bin/sh -c 'cd /repo && exec python -m pytest -p no:cacheprovider --timeout=1800 "$@"' pytest "$@"
