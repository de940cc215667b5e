"""Drafters for speculative decoding, one module each; `make_drafter` picks one from resolved settings.

The protocol every drafter follows is documented in `base.py`.
"""

from __future__ import annotations

from slime_spec.engine.drafters.base import Drafter
from slime_spec.engine.drafters.eagle3 import Eagle3Drafter, load_eagle3_drafter
from slime_spec.engine.drafters.history import HistoryDrafter
from slime_spec.engine.drafters.hybrid import HybridDrafter
from slime_spec.engine.drafters.mtp import MTPDrafter
from slime_spec.engine.drafters.ngram import NgramDrafter
from slime_spec.engine.drafters.standalone import StandaloneDrafter
from slime_spec.engine.model_executor.model import CausalLM, load_model
from slime_spec.engine.speculative.tree import tree_shape
from slime_spec.speculative.settings import Algorithm, SpecConfig

__all__ = ["Drafter", "Eagle3Drafter", "HistoryDrafter", "HybridDrafter", "MTPDrafter", "NgramDrafter",
           "StandaloneDrafter", "make_drafter"]


def make_drafter(spec: SpecConfig | None, target: CausalLM, slots: int, max_seq: int, dtype: str,
                 device: str, num_steps: int) -> Drafter | None:
    """The drafter for `spec` (None without speculation); `spec.check_resolved` must have passed.
    num_steps: the most draft tokens a step may ask for (the step policy's `max_num_steps`: SpecConfig.num_steps,
    under adaptive speculation the largest candidate)."""
    if spec is None:
        return None
    drafter = _build_drafter(spec, target, slots, max_seq, dtype, device, num_steps)
    if tree_shape(spec) is not None and not drafter.supports_tree:
        raise ValueError(f"speculative_eagle_topk={spec.speculative_eagle_topk}: {type(drafter).__name__} drafts "
                         "chains only; use --speculative-eagle-topk 1")
    return drafter


def _build_drafter(spec: SpecConfig, target: CausalLM, slots: int, max_seq: int, dtype: str, device: str,
                   num_steps: int) -> Drafter:
    shape = tree_shape(spec)
    if shape is not None:  # a draft tree's frontier nodes take cache locations past the row's length
        max_seq += shape.draft_region
    algorithm = spec.speculative_algorithm
    if algorithm is Algorithm.EAGLE:
        # MTP; requests carrying `slime_history` (--rollout-history-drafting) may draft from history instead.
        history = HistoryDrafter(None, spec.speculative_ngram_max_trie_depth, num_steps, device)
        return HybridDrafter(MTPDrafter(target, num_steps, slots, max_seq), history)
    if algorithm is Algorithm.EAGLE3:
        return load_eagle3_drafter(target, spec.speculative_draft_model_path, num_steps, slots, max_seq)
    if algorithm is Algorithm.STANDALONE:
        path = spec.speculative_draft_model_path
        draft, config = load_model(path, dtype=dtype, device=device)
        if draft.args.vocab_size != target.args.vocab_size:
            raise ValueError(f"--speculative-draft-model-path {path}: vocab_size {draft.args.vocab_size} != the "
                             f"target's {target.args.vocab_size}; STANDALONE needs a draft with the target's "
                             "tokenizer")
        return StandaloneDrafter(draft, num_steps, slots, max_seq)
    if algorithm is Algorithm.NGRAM:
        # SGLang 0.5.23's trie matches suffixes of every length up to max_trie_depth (no minimum-window flag).
        depth = spec.speculative_ngram_max_trie_depth
        return HistoryDrafter(NgramDrafter(num_steps, depth, 1, device), depth)
    raise ValueError(f"speculative_algorithm={algorithm}: no drafter in the embedded engine "
                     "(spec.check_resolved refuses it first)")
