"""The engine's kernel choices (`engine/kernels/ops.Kernels`) read SGLang 0.5.23's own flags: every name we map is a
value SGLang's parser accepts, and SGLang's defaults select the kernels."""

from slime_spec.engine.kernels.ops import GEMV_BACKENDS, SDPA_BACKENDS, Kernels
from slime_spec.engine.server_args import defaults_of, engine_parser


def choices_of(dest: str) -> set[str]:
    (action,) = [a for a in engine_parser()._actions if a.dest == dest]
    return set(action.choices)


def test_the_gemv_backends_are_sglangs_bf16_gemm_backends_but_torch():
    assert set(GEMV_BACKENDS) | {"torch"} == choices_of("bf16_gemm_backend")


def test_the_sdpa_backends_are_sglang_attention_backends():
    assert set(SDPA_BACKENDS) <= choices_of("attention_backend")
    assert set(SDPA_BACKENDS) <= choices_of("decode_attention_backend")


def test_sglangs_defaults_select_every_kernel():
    assert Kernels.from_values(defaults_of(engine_parser())) == Kernels(gemv=True, attention=True, norm=True,
                                                                        activation=True, sampling=True)


def test_sglangs_pytorch_sampling_backend_and_deterministic_inference_keep_eager_sampling():
    assert "pytorch" in choices_of("sampling_backend")
    defaults = defaults_of(engine_parser())
    assert not Kernels.from_values({**defaults, "sampling_backend": "pytorch"}).sampling
    assert not Kernels.from_values({**defaults, "enable_deterministic_inference": True}).sampling
    assert Kernels.from_values({**defaults, "sampling_backend": "flashinfer"}).sampling
