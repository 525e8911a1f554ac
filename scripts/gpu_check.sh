#!/usr/bin/env bash
# The CUDA check: greedy parity with transformers and the engine benchmark on the GPU.
# Needs a CUDA build of torch in .venv (TORCH_SPEC='torch==2.13.0' from PyPI on Linux x86_64 is one):
#   TORCH_SPEC=torch==2.13.0 ./scripts/gpu_check.sh
# Untested in CI (no GPU there); see docs/performance.md, "The GPU path".
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/bootstrap.sh
.venv/bin/python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA device visible to torch")'
echo "==> parity tests on $(.venv/bin/python -c 'import torch; print(torch.cuda.get_device_name())')"
.venv/bin/python -m pytest -q tests/test_parity_real.py tests/test_engine_tiny.py tests/test_model.py
echo "==> Triton paged-attention kernels, compiled for the GPU (the CPU suite runs them interpreted)"
env -u TRITON_INTERPRET .venv/bin/python -m pytest -q tests/test_triton_kernels.py
echo "==> engine benchmark (bf16, CUDA)"
.venv/bin/python benchmarks/bench_engine.py --skip-transformers
