"""The embedded engine's model and how it runs (SGLang's model_executor/).

- model.py, model_args.py, attention.py, mla.py, moe.py, norm.py: the gpt-fast-style decoder of every served family,
  by HF names (mla.py: DeepSeek-V3's multi-latent attention).
- cuda_graph.py (capture, padding, replay), model_graphs.py (which forwards are captured), decode_graph.py
  (the overlap schedule's whole plain step).
- sampling.py: sampling and acceptance as pure tensor functions; transfer.py: non-blocking host <-> device copies.
- hf_configs.py: config classes transformers lacks (MiMo without its remote code).
"""
