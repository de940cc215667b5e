#!/usr/bin/env bash
# Prepare the lent GPU machine (Python 3.12, torch with CUDA, no network, no SGLang) for the benchmarks:
# a venv over the system packages plus the wheels carried in .gpuwheels/ (sglang --no-deps for its
# ServerArgs and weight-sync helpers, megatron-core, the server's light dependencies).
# Usage (on the GPU machine, from the repo root): source bench/gpu_env.sh
set -e
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast
python3 -m venv --system-site-packages /tmp/gpuvenv
/tmp/gpuvenv/bin/pip install -q --no-deps --no-index .gpuwheels/*.whl
export PATH=/tmp/gpuvenv/bin:$PATH PYTHONPATH=$PWD HF_HUB_OFFLINE=1
python -c "import torch, sglang, megatron.core; from sglang.srt.server_args import ServerArgs; print('gpu env ok:', torch.__version__, sglang.__version__, torch.cuda.device_count(), 'GPUs')"
set +e
