#!/usr/bin/env bash
# Prepare the lent GPU machine (Python 3.12, torch with CUDA, no network, no SGLang) for the benchmarks:
# the wheels carried in .gpuwheels/ (megatron-core, the embedded server's light dependencies: fastapi, starlette,
# uvicorn, pydantic, orjson, msgspec, pybase64) and, when no sglang wheel for Python 3.12 is at hand,
# .gpuwheels/sglang_py.zip (the installed sglang 0.5.23's Python sources, for its argument parser, io_struct and
# serializers) are installed into /tmp/gpusite and put on PYTHONPATH.
# Usage (on the GPU machine, from the repo root; do not pipe it): source bench/gpu_env.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast
python3 -m pip install -q --no-deps --no-index --target /tmp/gpusite .gpuwheels/*.whl > /tmp/gpusite.log 2>&1 \
  || tail -5 /tmp/gpusite.log
if [ -f .gpuwheels/sglang_py.zip ]; then
  python3 -c "import zipfile; zipfile.ZipFile('.gpuwheels/sglang_py.zip').extractall('/tmp/gpusite')"
fi
export PYTHONPATH=$PWD:/tmp/gpusite HF_HUB_OFFLINE=1
python3 -c "import torch, sglang, megatron.core; print('gpu env ok:', torch.__version__, sglang.__version__, torch.cuda.device_count(), 'GPUs')"
