"""Tree drafting (eagle_topk > 1): the tree math of engine/tree.py on hand-checked trees, and the embedded
engine's tree steps for MTP, EAGLE3 and STANDALONE (greedy equal to plain decoding, sampled output following
the target distribution, logprobs the target's). SGLang's own selection code is compared in
tests/conformance/test_tree_draft.py."""

import dataclasses

import pytest
import torch

from slime_spec.engine import tree
from slime_spec.engine.core import EngineCore, Request, SamplingParams, SpecConfig
from slime_spec.engine.sampling import chi_square_pvalue
from slime_spec.tiny_model import make_tiny_eagle3_draft, make_tiny_model
from tests.test_engine_drafters import _copy_target_into_mtp, _exact_marginals, generate, make_requests

# A topk-2 tree of 3 steps: flat ids 0, 1 (the root's children), 2..5 (step 1: children of the frontier 0, 1),
# 6..9 (step 2: children of the step-1 frontier, flat ids 3 and 4).
PARENT_LIST = torch.tensor([[-1, 0, 1, 3, 4]])
SELECTED = torch.tensor([[0, 1, 3, 4, 6]])
TOKENS = torch.tensor([[10, 11, 12, 13, 14]])


def hand_tree():
    return tree.build_tree(torch.tensor([9]), PARENT_LIST, SELECTED, TOKENS, topk=2)


def test_build_tree_links_parents_depths_masks_and_siblings():
    t = hand_tree()
    assert t.tokens.tolist() == [[9, 10, 11, 12, 13, 14]]
    assert t.parent.tolist() == [[-1, 0, 0, 1, 2, 3]]
    assert t.depth.tolist() == [[0, 1, 1, 2, 2, 3]]
    assert t.first_child.tolist() == [[1, 3, 4, 5, -1, -1]]
    assert t.next_sibling.tolist() == [[-1, 2, -1, -1, -1, -1]]
    assert t.mask[0, 5].nonzero().flatten().tolist() == [0, 1, 3, 5]
    assert t.mask[0, 4].nonzero().flatten().tolist() == [0, 2, 4]
    # A node whose parent was not selected (tied scores) is linked to nothing: the walk never reaches it.
    orphan = tree.build_tree(torch.tensor([9]), PARENT_LIST, torch.tensor([[0, 6]]), torch.tensor([[10, 14]]), 2)
    assert orphan.parent.tolist() == [[-1, 0, -1]] and orphan.first_child.tolist() == [[1, -1, -1]]


def test_greedy_walk_follows_the_target_argmax():
    t = hand_tree()
    first, sib, toks = t.first_child[0].tolist(), t.next_sibling[0].tolist(), t.tokens[0].tolist()
    # target argmax at nodes 0..5
    assert tree.greedy_walk(first, sib, toks, [10, 12, 0, 14, 0, 7]) == ([0, 1, 3, 5], 7)
    assert tree.greedy_walk(first, sib, toks, [11, 0, 13, 0, 5, 0]) == ([0, 2, 4], 5)
    assert tree.greedy_walk(first, sib, toks, [3, 0, 0, 0, 0, 0]) == ([0], 3)
    assert tree.greedy_walk(first, sib, toks, [10, 4, 0, 0, 0, 0]) == ([0, 1], 4)


def test_sampled_walk_emits_the_target_distribution():
    """SGLang's target-only rule is lossless: the first token follows p at the root, the second p at the node
    of the first token (accepted in the tree or drawn as the bonus)."""
    n, vocab = 20000, 16
    gen = torch.Generator().manual_seed(0)
    t = hand_tree()
    batch = tree.DraftTree(*(x.expand(n, *x.shape[1:]) for x in dataclasses.astuple(t)))
    probs = torch.softmax(torch.randn(1, 6, vocab, generator=gen) * 1.5, -1)
    logits = probs.log().expand(n, -1, -1)
    paths, bonus = tree.accept(batch, logits, torch.zeros(n, dtype=torch.bool), probs.expand(n, -1, -1), gen)
    toks = t.tokens[0].tolist()
    emitted = [[toks[node] for node in p[1:]] + [b] for p, b in zip(paths, bonus)]
    assert len({len(p) for p in paths}) > 2  # paths of several lengths ran
    first = torch.bincount(torch.tensor([e[0] for e in emitted]), minlength=vocab)
    assert chi_square_pvalue(first, probs[0, 0]) > 1e-3
    second = torch.bincount(torch.tensor([e[1] for e in emitted if e[0] == 10]), minlength=vocab)
    assert chi_square_pvalue(second, probs[0, 1]) > 1e-3
    # Greedy rows in the same call follow the argmax
    greedy = torch.ones(n, dtype=torch.bool)
    paths, nxt = tree.accept(batch, logits, greedy, None, gen)
    ref = tree.greedy_walk(t.first_child[0].tolist(), t.next_sibling[0].tolist(), toks, probs[0].argmax(-1).tolist())
    assert (paths[0], nxt[0]) == ref and all(p == paths[0] for p in paths)


def test_region_mask_sees_the_context_and_the_visible_region():
    visible = torch.tensor([[[True, False, True]], [[False, True, False]]])
    mask = tree.region_mask(torch.tensor([2, 4]), visible, 8)
    assert mask.shape == (2, 1, 1, 8)
    assert mask[0, 0, 0].tolist() == [True, True, True, False, True, False, False, False]
    assert mask[1, 0, 0].tolist() == [True, True, True, True, False, True, False, False]


def test_move_accepted_kv_makes_the_path_contiguous():
    cache = torch.arange(2 * 10).view(2, 10, 1).float()
    tree.move_accepted_kv([cache], [1, 0], [3, 2], [[0, 2, 5], [0]])
    assert cache[1, 3:6, 0].tolist() == [13.0, 15.0, 18.0]
    assert cache[0].flatten().tolist() == list(map(float, range(10)))


def test_tree_shape_and_the_options_it_refuses():
    assert tree.tree_shape(SpecConfig("EAGLE", 3, 1, 4)) is None
    assert tree.tree_shape(SpecConfig("NGRAM", 2, 4, 8)) is None
    shape = tree.tree_shape(SpecConfig("EAGLE", 3, 4, 8))
    assert (shape.steps, shape.topk, shape.num_draft_tokens, shape.draft_region) == (3, 4, 8, 8)
