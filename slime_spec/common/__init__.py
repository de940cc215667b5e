"""What more than one process shares and that depends on no other part of slime-spec.

- rope.py: RoPE inverse frequencies from an HF config, plain and Llama-3.1's llama3 scaling (as transformers
  computes them); the trainer's GPTModel and the embedded engine's model both use them.
- eagle3_draft.py: the EAGLE3 draft head in SGLang's LlamaForCausalLMEagle3 layout: the module the trainer
  trains online and the embedded engine's EAGLE3 drafter runs.
- model_families.py: model families by trait (mixture-of-experts), for the trainer, the weight sync and the doctor.
- errors.py: the base of errors with fields besides their message, so that they cross Ray's actor boundary whole.
"""
