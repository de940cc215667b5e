"""Every check fires on a minimal bad configuration and stays silent on a good one."""

import pytest

from slime_spec.config.flags import MODEL_SHAPE_FLAGS
from slime_spec.doctor.spec_checks import CheckInput, run_checks

LLAMA = {"torch_dtype": "bfloat16", "max_position_embeddings": 131072, "num_hidden_layers": 32, "hidden_size": 4096,
         "tie_word_embeddings": False, "model_type": "llama"}
EAGLE3 = {"torch_dtype": "float16", "max_position_embeddings": 2048}
MIMO = {"torch_dtype": "bfloat16", "max_position_embeddings": 32768, "num_nextn_predict_layers": 1,
        "model_type": "mimo"}
GOOD_GPU = {"attention_backend": "fa3", "cuda_graph_bs_decode": list(range(1, 33)) + [40, 48],
            "max_running_requests": 48}


def codes(**kw):
    base = dict(sglang={}, backend="sglang", sglang_version="0.5.23", target_config=MIMO)
    base.update(kw)
    return {f.code: f for f in run_checks(CheckInput(**base), MODEL_SHAPE_FLAGS)}


def eagle3(**sg):
    return {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": "/d", "speculative_num_steps": 5,
            "speculative_eagle_topk": 8, "speculative_num_draft_tokens": 32, "dtype": "float16",
            "context_length": 2048, **GOOD_GPU, **sg}


def mtp(**sg):
    return {"speculative_algorithm": "EAGLE", "speculative_num_steps": 3, "speculative_eagle_topk": 1,
            "speculative_num_draft_tokens": 4, **GOOD_GPU, **sg}


def test_good_configurations_are_silent():
    assert codes(sglang=eagle3(), target_config=LLAMA, draft_config=EAGLE3) == {}
    assert codes(sglang=mtp()) == {}
    assert codes(sglang=mtp(), enable_mtp_training=True, mtp_num_layers=1, mtp_unroll_steps=3) == {}
    embedded_ngram = codes(sglang={"speculative_algorithm": "NGRAM"}, backend="embedded")
    assert embedded_ngram == {"SGLANG_ONLY_CHECKS_SKIPPED": embedded_ngram["SGLANG_ONLY_CHECKS_SKIPPED"]}
    assert codes(sglang={}) == {}


def test_dtype_mismatch():
    f = codes(sglang=eagle3(dtype=None), target_config=LLAMA, draft_config=EAGLE3)["SPEC_DTYPE_MISMATCH"]
    assert f.level == "error" and "Capture cuda graph failed" in f.message and f.fix == "--sglang-dtype float16"


def test_context_length_draft_shorter():
    f = codes(sglang=eagle3(context_length=None), target_config=LLAMA, draft_config=EAGLE3)["SPEC_CONTEXT_LENGTH"]
    assert f.level == "error" and f.fix == "--sglang-context-length 2048"
    assert "SPEC_CONTEXT_LENGTH" in codes(sglang=eagle3(context_length=4096), target_config=LLAMA, draft_config=EAGLE3)


def test_context_length_prompt_plus_response():
    f = codes(sglang=mtp(context_length=1024), longest_prompt_tokens=900, max_response_len=200)["SPEC_CONTEXT_LENGTH"]
    assert "1100" in f.message and "--rollout-max-response-len to 124" in f.fix
    fits = codes(sglang=mtp(context_length=1024), longest_prompt_tokens=800, max_response_len=200)
    assert "SPEC_CONTEXT_LENGTH" not in fits


@pytest.mark.parametrize("backend", ["flashinfer", None])
def test_flashinfer(backend):
    f = codes(sglang=mtp(attention_backend=backend))["SPEC_FLASHINFER"]
    assert f.level == "warning" and "#9888" in f.message and "fa3" in f.fix
    assert "SPEC_FLASHINFER" not in codes(sglang=mtp(attention_backend="triton"))


def test_cuda_graph_bs():
    f = codes(sglang=mtp(cuda_graph_bs_decode=None))["SPEC_CUDA_GRAPH_BS"]
    assert "disable-cuda-graph-padding does not help" in f.message and "$(seq 1 32)" in f.fix
    assert "below the max running requests" in codes(sglang=mtp(max_running_requests=128))["SPEC_CUDA_GRAPH_BS"].message
    assert "[3, 5]" in codes(sglang=mtp(cuda_graph_bs_decode=[1, 2, 4, *range(6, 49)]))["SPEC_CUDA_GRAPH_BS"].message
    assert "SPEC_CUDA_GRAPH_BS" not in codes(sglang=mtp(cuda_graph_bs_decode=None, disable_cuda_graph=True))


def test_topk_tokens():
    f = codes(sglang=mtp(speculative_num_draft_tokens=8))["SPEC_TOPK_TOKENS"]
    assert f.level == "warning" and "overrides" in f.message and f.fix == "--sglang-speculative-num-draft-tokens 4"
    f = codes(sglang=mtp(speculative_num_steps=None))["SPEC_TOPK_TOKENS"]
    assert f.level == "error" and "asserts" in f.message
    f = codes(sglang=eagle3(speculative_num_steps=2, speculative_eagle_topk=2, speculative_num_draft_tokens=64),
              target_config=LLAMA, draft_config=EAGLE3)["SPEC_TOPK_TOKENS"]
    assert f.level == "error" and "at most 7 nodes" in f.message


def test_no_mtp():
    f = codes(sglang=mtp(), target_config=LLAMA)["SPEC_NO_MTP"]
    assert f.level == "error" and "NGRAM" in f.fix
    assert "SPEC_NO_MTP" not in codes(sglang=mtp(speculative_draft_model_path="/d"), target_config=LLAMA)


def test_eagle3_without_draft():
    found = codes(sglang=eagle3(speculative_draft_model_path=None), target_config=LLAMA)
    assert found["SPEC_EAGLE3_NO_DRAFT"].level == "error"


def test_old_sglang_with_external_draft():
    external = dict(sglang=eagle3(), target_config=LLAMA, draft_config=EAGLE3)
    f = codes(**external, sglang_version="0.4.10.post2")["SPEC_SGLANG_VERSION"]
    assert "#9388" in f.message
    assert "SPEC_SGLANG_VERSION" not in codes(**external, sglang_version="0.5.1")


def test_mtp_training():
    assert "--mtp-num-layers 1" in codes(enable_mtp_training=True, mtp_num_layers=0)["SPEC_MTP_TRAINING"].fix
    no_mtp = codes(enable_mtp_training=True, mtp_num_layers=1, target_config=LLAMA)["SPEC_MTP_TRAINING"]
    assert "no MTP layers" in no_mtp.message


def test_mtp_unroll_recommended_when_one_layer_drafts_several_steps():
    """NEXTN feeds the one MTP layer its own hidden states after the first step: trained one step ahead only, those
    later drafts are accepted less often; doctor says so (info) and names the unroll that covers the steps."""
    f = codes(sglang=mtp(), enable_mtp_training=True, mtp_num_layers=1)["SPEC_MTP_UNROLL_RECOMMENDED"]
    assert f.level == "info" and "--sglang-speculative-num-steps 3" in f.message and f.fix == "--mtp-unroll-steps 3"
    assert "SPEC_MTP_UNROLL_RECOMMENDED" not in codes(sglang=mtp(speculative_num_steps=1), enable_mtp_training=True,
                                                      mtp_num_layers=1)
    assert "SPEC_MTP_UNROLL_RECOMMENDED" not in codes(sglang=mtp(), mtp_num_layers=1)  # the draft is not trained
    assert "SPEC_MTP_UNROLL_RECOMMENDED" not in codes(sglang=eagle3(), enable_mtp_training=True, mtp_num_layers=1,
                                                      target_config=LLAMA, draft_config=EAGLE3)


def test_unsupported_by_embedded_backend():
    f = codes(sglang=eagle3(speculative_algorithm="DFLASH"), backend="embedded", target_config=LLAMA,
              draft_config=EAGLE3)["SPEC_UNSUPPORTED_BY_BACKEND"]
    assert f.level == "error"
    # The seeds' EAGLE3 tree (5 / 8 / 32) runs on the embedded engine (tree drafting, engine/speculative/tree.py).
    assert "SPEC_UNSUPPORTED_BY_BACKEND" not in codes(sglang=eagle3(), backend="embedded", target_config=LLAMA,
                                                      draft_config=EAGLE3)
    assert "SPEC_UNSUPPORTED_BY_BACKEND" not in codes(sglang=mtp(), backend="embedded")


def test_model_args_mismatch():
    f = codes(target_config=LLAMA, model_flags={"num_layers": 32, "hidden_size": 4000})["MODEL_ARGS_MISMATCH"]
    assert "--hidden-size 4000" in f.message and "hidden_size=4096" in f.message
    untied = {"num_layers": 32, "untie_embeddings_and_output_weights": True}
    assert "MODEL_ARGS_MISMATCH" not in codes(target_config=LLAMA, model_flags=untied)
    tied = {"untie_embeddings_and_output_weights": False}
    assert "MODEL_ARGS_MISMATCH" in codes(target_config=LLAMA, model_flags=tied)


def test_trainer_unsupported_model_unless_rollout_only():
    gemma = {"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"]}
    f = codes(target_config=gemma)["TRAINER_UNSUPPORTED_MODEL"]
    assert f.level == "error" and "--debug-rollout-only" in f.fix
    assert "TRAINER_UNSUPPORTED_MODEL" not in codes(target_config=gemma, debug_rollout_only=True)
    glm = {"model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"], "num_nextn_predict_layers": 1}
    assert "TRAINER_UNSUPPORTED_MODEL" not in codes(target_config=glm)  # GLM-4.5 trains (trainer/model.py)
    # MoE under TP trains with sequence parallelism (trainer/sequence_parallel.py), an online draft too
    assert "TRAINER_UNSUPPORTED_MODEL" not in codes(target_config=glm, tensor_model_parallel_size=4)
    assert "TRAINER_UNSUPPORTED_MODEL" not in codes(target_config=glm, tensor_model_parallel_size=4,
                                                    enable_draft_training=True)
    assert "TRAINER_UNSUPPORTED_MODEL" not in codes(target_config=LLAMA, tensor_model_parallel_size=4)
    yarn = {**LLAMA, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    assert "'yarn'" in codes(target_config=yarn)["TRAINER_UNSUPPORTED_MODEL"].message
    llama31 = {**LLAMA, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}  # the trainer builds Llama-3.1
    assert "TRAINER_UNSUPPORTED_MODEL" not in codes(target_config=llama31)
    assert "TRAINER_UNSUPPORTED_MODEL" not in codes(target_config=LLAMA)
    deepseek = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "num_nextn_predict_layers": 1,
                "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096}}
    assert "TRAINER_UNSUPPORTED_MODEL" not in codes(target_config=deepseek)  # MLA with its YaRN (trainer/model.py)
    assert "TRAINER_UNSUPPORTED_MODEL" not in codes(target_config=deepseek, tensor_model_parallel_size=8)
    # nor together with expert parallelism
    moe_tp_ep = codes(target_config=deepseek, tensor_model_parallel_size=8,
                      expert_model_parallel_size=8)["TRAINER_UNSUPPORTED_MODEL"]
    assert "deepseek_v3" in moe_tp_ep.message and "--expert-model-parallel-size 8" in moe_tp_ep.message



def test_a_quantized_checkpoint_trains_only_as_deepseek_v3_fp8_blocks():
    """DeepSeek-V3 ships FP8 weights with 128x128 block scales, which the sync reproduces (weight_sync/fp8.py); any
    other quantization would keep stale scales after a sync, and is refused for training, not for rollout."""
    from slime_spec.weight_sync.fp8 import DEEPSEEK_V3_FP8
    fp8 = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "num_nextn_predict_layers": 1,
           "quantization_config": dict(DEEPSEEK_V3_FP8)}
    assert "MODEL_QUANTIZED_CHECKPOINT" not in codes(target_config=fp8)
    ue8m0 = {**fp8, "quantization_config": {**DEEPSEEK_V3_FP8, "scale_fmt": "ue8m0"}}  # DeepSeek-V3.1's
    f = codes(target_config=ue8m0)["MODEL_QUANTIZED_CHECKPOINT"]
    assert f.level == "error" and "--hf-checkpoint has a quantization_config" in f.message
    assert "quantization_config.scale_fmt is 'ue8m0'" in f.message and "bf16" in f.fix
    per_tensor = {**fp8, "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"}}
    assert "weight_block_size is None" in codes(target_config=per_tensor)["MODEL_QUANTIZED_CHECKPOINT"].message
    awq = {**LLAMA, "quantization_config": {"quant_method": "awq"}}
    assert "quant_method is 'awq'" in codes(target_config=awq)["MODEL_QUANTIZED_CHECKPOINT"].message
    assert "MODEL_QUANTIZED_CHECKPOINT" not in codes(target_config=ue8m0, debug_rollout_only=True)
    assert "the draft model" in codes(target_config=LLAMA, draft_config={**LLAMA, "quantization_config": {
        "quant_method": "fp8"}})["MODEL_QUANTIZED_CHECKPOINT"].message
    assert "MODEL_QUANTIZED_CHECKPOINT" not in codes(target_config=LLAMA)

def test_colocated_sglang_needs_memory_saver_and_draft_backup():
    found = codes(sglang=mtp(), colocate=True)
    assert found["COLOCATE_MEMORY_SAVER"].fix.startswith("drop --no-offload-rollout")
    assert "collapses" in found["COLOCATE_DRAFT_BACKUP"].message
    ok = mtp(enable_memory_saver=True, enable_draft_weights_cpu_backup=True)
    assert not {"COLOCATE_MEMORY_SAVER", "COLOCATE_DRAFT_BACKUP"} & set(codes(sglang=ok, colocate=True))
    assert "COLOCATE_MEMORY_SAVER" not in codes(sglang=mtp(), colocate=True, backend="embedded")


def test_pipeline_parallel_engines_cannot_join_the_distributed_weight_sync():
    """SGLang 0.5.23 joins the weight-update group as rank_offset + tp_rank: two pipeline stages, one rank."""
    found = codes(sglang=mtp(pp_size=2))
    f = found["SYNC_PIPELINE_PARALLEL"]
    assert f.level == "error" and "rank_offset + tp_rank" in f.message
    assert "SYNC_PIPELINE_PARALLEL" not in codes(sglang=mtp(pp_size=2), weight_sync_transport="disk")
    assert "SYNC_PIPELINE_PARALLEL" not in codes(sglang=mtp(pp_size=2), debug_rollout_only=True)  # no sync
    assert "SYNC_PIPELINE_PARALLEL" not in codes(sglang=mtp(pp_size=1))


def test_version_suffixes_do_not_bleed_into_the_patch_number():
    draft = dict(sglang=eagle3(), target_config=LLAMA, draft_config=EAGLE3)
    assert "SPEC_SGLANG_VERSION" in codes(**draft, sglang_version="0.5.0rc1")  # not read as 0.5.1
    assert "SPEC_SGLANG_VERSION" not in codes(**draft, sglang_version="0.5.1rc0")


def test_history_drafting_needs_ngram_and_consistent_budgets():
    ngram = {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 8, **GOOD_GPU}
    on = dict(history_drafting=True)
    assert "SPEC_HISTORY" not in codes(sglang=mtp())  # off: nothing to check
    assert "NGRAM" in codes(sglang=mtp(), **on)["SPEC_HISTORY"].fix
    assert "NGRAM" in codes(sglang={}, backend="embedded", **on)["SPEC_HISTORY"].fix
    assert "SPEC_HISTORY" not in codes(sglang={"speculative_algorithm": "NGRAM"}, backend="embedded", **on)
    f = codes(sglang=ngram, **on)["SPEC_HISTORY"]
    assert f.level == "error" and "external-sam-budget 0" in f.message and "(7)" in f.fix
    assert "SPEC_HISTORY" not in codes(sglang={**ngram, "speculative_ngram_external_sam_budget": 4}, **on)
    high = codes(sglang={**ngram, "speculative_ngram_external_sam_budget": 9}, **on)["SPEC_HISTORY"]
    assert high.level == "warning" and "caps it" in high.message
    tight = {**ngram, "speculative_ngram_external_sam_budget": 4, "speculative_ngram_external_corpus_max_tokens": 1000}
    over = codes(sglang=tight, history_max_tokens=200, prompts_per_rollout=8, **on)["SPEC_HISTORY"]
    assert over.level == "warning" and "newest" in over.message
    bad = codes(sglang={"speculative_algorithm": "NGRAM"}, backend="embedded", history_epochs=-1, **on)
    assert "--rollout-history-epochs -1" in bad["SPEC_HISTORY"].message


EAGLE3_DRAFT = {**EAGLE3, "architectures": ["LlamaForCausalLMEagle3"]}


def test_draft_training_needs_eagle3_a_draft_and_layers_the_target_has():
    good = dict(sglang=eagle3(), target_config=LLAMA, enable_draft_training=True)
    assert codes(draft_config=EAGLE3_DRAFT, **good) == {}  # Llama-3.1-8B: SGLang's default layers 1, 15, 28
    f = codes(sglang=mtp(), enable_draft_training=True)["SPEC_DRAFT_TRAINING"]
    assert "EAGLE" in f.message and "--enable-draft-training" in f.fix
    assert "LlamaForCausalLMEagle3" in codes(draft_config={**EAGLE3, "architectures": ["LlamaForCausalLM"]},
                                             **good)["SPEC_DRAFT_TRAINING"].message
    four = {**LLAMA, "num_hidden_layers": 4}
    assert "0..2" in codes(**{**good, "target_config": four}, draft_config=EAGLE3_DRAFT)["SPEC_DRAFT_TRAINING"].message
    explicit = {**EAGLE3_DRAFT, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}}
    assert codes(**{**good, "target_config": four}, draft_config=explicit) == {}
    assert "SPEC_DRAFT_TRAINING" not in codes(sglang=mtp(), enable_draft_training=True, debug_rollout_only=True)


TREE_SHAPES = [(5, 8, 32), (5, 8, 330), (5, 8, 331), (1, 4, 5), (1, 4, 6), (2, 2, 7), (2, 2, 8), (3, 4, 37),
               (3, 4, 38), (4, 2, 15)]


@pytest.mark.parametrize("steps,topk,tokens", TREE_SHAPES)
def test_tree_capacity_agrees_with_sglangs_tree_builder(steps, topk, tokens):
    """SGLang picks num_draft_tokens - 1 tree nodes from the draft's candidate scores with its own
    organize_draft_results: it fails exactly where our SPEC_TOPK_TOKENS capacity error fires."""
    import torch

    from tests.conformance import sglang_doubles

    sglang_doubles.install()
    from sglang.srt.speculative.eagle_utils import organize_draft_results

    batch = 2
    scores = [torch.rand(batch, 1, topk)] + [torch.rand(batch, topk, topk) for _ in range(steps - 1)]
    tokens_list = [torch.randint(0, 100, (batch, topk))] + [torch.randint(0, 100, (batch, topk * topk))
                                                            for _ in range(steps - 1)]
    parents = [torch.zeros(batch, topk + 1, dtype=torch.long)] + [torch.zeros(batch, topk, dtype=torch.long)
                                                                  for _ in range(steps - 1)]
    try:
        organize_draft_results(scores, tokens_list, parents, tokens)
        sglang_builds = True
    except RuntimeError:
        sglang_builds = False
    found = run_checks(CheckInput(sglang=eagle3(speculative_num_steps=steps, speculative_eagle_topk=topk,
                                                 speculative_num_draft_tokens=tokens),
                                  backend="sglang", sglang_version="0.5.23", target_config=LLAMA,
                                  draft_config=EAGLE3_DRAFT))
    capacity_error = any(f.code == "SPEC_TOPK_TOKENS" and f.level == "error" for f in found)
    assert sglang_builds != capacity_error, (steps, topk, tokens, [f.message for f in found])


def test_own_speculative_options_are_refused_on_sglang():
    f = codes(sglang=mtp(), spec_draft_sampling=True, spec_auto=True)["SPEC_OWN_OPTION_ON_SGLANG"]
    assert f.level == "error" and "--spec-draft-sampling and --spec-auto" in f.message
    assert "--rollout-backend embedded" in f.fix
    assert "SPEC_OWN_OPTION_ON_SGLANG" not in codes(sglang=mtp(), backend="embedded", spec_auto=True)


def test_adaptive_is_recommended_when_the_draft_length_is_left_to_the_default():
    untuned = {"speculative_algorithm": "EAGLE", **GOOD_GPU}
    f = codes(sglang=untuned)["SPEC_ADAPTIVE_RECOMMENDED"]
    assert f.level == "info" and "--sglang-speculative-adaptive" in f.fix and "3 steps" in f.message
    assert "--spec-auto" in codes(sglang=untuned, backend="embedded")["SPEC_ADAPTIVE_RECOMMENDED"].fix
    assert "SPEC_ADAPTIVE_RECOMMENDED" not in codes(sglang={**untuned, "speculative_adaptive": True})
    assert "SPEC_ADAPTIVE_RECOMMENDED" not in codes(sglang=untuned, backend="embedded", spec_auto=True)
    assert "SPEC_ADAPTIVE_RECOMMENDED" not in codes(sglang={"speculative_algorithm": "NGRAM"}, backend="embedded")


def test_speculation_that_would_decode_the_rollout_in_waves_is_named():
    """SGLang runs 48 requests at once with speculation unless --sglang-max-running-requests says otherwise."""
    unset = {k: v for k, v in mtp().items() if k != "max_running_requests"}
    f = codes(sglang=unset, in_flight_per_engine=128)["SPEC_MAX_RUNNING_REQUESTS"]
    assert f.level == "warning" and "48" in f.message and "128" in f.message
    assert f.fix == "--sglang-max-running-requests 128"
    assert "SPEC_MAX_RUNNING_REQUESTS" not in codes(sglang=unset, in_flight_per_engine=48)
    assert "SPEC_MAX_RUNNING_REQUESTS" not in codes(sglang=mtp(max_running_requests=64), in_flight_per_engine=128)
    assert "SPEC_MAX_RUNNING_REQUESTS" not in codes(sglang={}, in_flight_per_engine=128)
