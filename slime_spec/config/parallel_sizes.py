"""The trainer's data-parallel size as Megatron derives it: one definition for the flags' table, the doctor and the
train group (no imports, so the flag tables can use it)."""


def data_parallel_size(actor_gpus: int, tp: int, pp: int = 1, cp: int = 1) -> int:
    """actor GPUs / (tensor x pipeline x context parallel sizes); 0 when those do not divide the GPUs."""
    model_parallel = tp * pp * cp
    return actor_gpus // model_parallel if model_parallel >= 1 and actor_gpus % model_parallel == 0 else 0
