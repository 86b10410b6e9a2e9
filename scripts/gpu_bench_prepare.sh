#!/usr/bin/env bash
# Builds what scripts/gpu_bench.sh runs on a GPU machine, here, on a machine without a GPU or a
# CUDA toolkit (cudarc loads the driver, NVRTC and cuBLAS at run time): the picaso binary and the
# two test binaries with the `cuda` feature, stripped and packed into .gpu-bench/bins.tar.xz, and
# the peer's PyPI sdist (mamba_ssm 2.3.0). Carry .gpu-bench to the device call.
set -euo pipefail
cd "$(dirname "$0")/.."
G=.gpu-bench
mkdir -p "$G/bin"
cargo build --release -p picaso --features cuda
tests=$(cargo test --release -p picaso-model --features cuda --lib --test reference --no-run --message-format=json 2>/dev/null |
  python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] in ("picaso_model", "reference"):
        print(("model-lib" if m["target"]["name"] == "picaso_model" else "reference") + " " + m["executable"])')
cp "${CARGO_TARGET_DIR:-target}/release/picaso" "$G/bin/picaso"
while read -r name exe; do cp "$exe" "$G/bin/$name"; done <<< "$tests"
strip "$G"/bin/*
tar cJf "$G/bins.tar.xz" -C "$G/bin" .
rm -rf "$G/bin"
if [[ ! -s $G/mamba_ssm-2.3.0.tar.gz ]]; then
  # The simple index (PEP 503), which pip's mirrors serve too.
  url=$(curl -sSfL https://pypi.org/simple/mamba-ssm/ | grep -o 'https://[^"#]*mamba_ssm-2\.3\.0\.tar\.gz' | head -1)
  curl -sSfL -o "$G/mamba_ssm-2.3.0.tar.gz" "$url"
fi
git rev-parse --short HEAD > "$G/revision"
ls -la "$G"
