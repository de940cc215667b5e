#!/usr/bin/env bash
# Prepare the lent GPU machine (Python 3.12, torch with CUDA, no network, no SGLang) for the benchmarks:
# the wheels carried in .gpuwheels/ (sglang --no-deps for its ServerArgs and weight-sync helpers,
# megatron-core, the server's light dependencies) installed into /tmp/gpusite, put on PYTHONPATH.
# Usage (on the GPU machine, from the repo root; do not pipe it): source bench/gpu_env.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast
python3 -m pip install -q --no-deps --no-index --target /tmp/gpusite .gpuwheels/*.whl > /tmp/gpusite.log 2>&1 \
  || tail -5 /tmp/gpusite.log
export PYTHONPATH=$PWD:/tmp/gpusite HF_HUB_OFFLINE=1
python3 -c "import torch, sglang, megatron.core; from sglang.srt.server_args import ServerArgs; print('gpu env ok:', torch.__version__, sglang.__version__, torch.cuda.device_count(), 'GPUs')"
