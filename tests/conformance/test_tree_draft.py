"""Tree drafting (engine/speculative/tree.py) against SGLang 0.5.23's own pure-torch tree functions on the same inputs.

Runs SGLang's `select_top_k_tokens` (spec_utils.py: the top-k expansion with cumulative scores) and
`organize_draft_results` (eagle_utils.py: the best num_draft_tokens - 1 nodes, parent_list) through a whole
draft loop of random draft distributions, and compares every level and the final selection with ours.
`build_tree_kernel_efficient` (tree mask, positions, retrieve_next_token / next_sibling) and the tree sampling
kernel `tree_speculative_sampling_target_only` run only in sgl_kernel (CUDA): they are not ported or run
here; tests/test_engine_tree.py pins our build_tree and accept walk on hand-checked trees instead.
"""

import pytest
import torch

from slime_spec.engine.speculative import tree
from tests.conformance import sglang_doubles

sglang_doubles.install()


def _sglang():
    from sglang.srt.speculative import spec_utils
    from sglang.srt.speculative.eagle_utils import organize_draft_results

    later = spec_utils._select_top_k_tokens_later
    # The later-step helper is wrapped in torch.compile (a C++ toolchain on CPU); run the function it wraps.
    later = getattr(later, "_torchdynamo_orig_callable", later)

    def select(i, topk_p, topk_index, hidden, scores, topk):
        if i == 0:
            return spec_utils._select_top_k_tokens_first(topk_p, topk_index, hidden, topk)
        return later(i, topk_p, topk_index, hidden, scores, topk)

    return select, organize_draft_results


@pytest.mark.parametrize("b,topk,steps,tokens", [(1, 2, 3, 4), (3, 4, 3, 8), (2, 8, 4, 16), (2, 4, 5, 21)])
def test_draft_loop_and_selection_follow_sglang(b, topk, steps, tokens):
    select, organize_draft_results = _sglang()
    gen = torch.Generator().manual_seed(topk * 100 + tokens)
    vocab, hidden_size = 50, 3

    def draft_probs(rows):  # a random draft distribution per frontier node
        return torch.softmax(3 * torch.randn(rows, vocab, generator=gen), dim=-1).topk(topk, dim=-1)

    topk_p, topk_index = draft_probs(b)
    hidden = torch.randn(b, hidden_size, generator=gen)
    # SGLang's loop
    scores, sg_levels = None, []
    # ours
    frontier, our_scores, level = tree.first_level(topk_p, topk_index)
    our_levels = [level]
    for i in range(steps):
        ids, hidden_sel, scores, info = select(i, topk_p, topk_index, hidden, scores, topk)
        sg_levels.append(info)
        if i > 0:
            frontier, came_from, our_scores, level = tree.next_level(i, topk_p.view(b, topk, topk),
                                                                     topk_index.view(b, topk, topk), our_scores)
            our_levels.append(level)
            assert torch.equal(hidden_sel.view(b, topk, -1), tree._take(hidden.view(b, topk, -1), came_from))
        assert torch.equal(ids.view(b, topk), frontier) and torch.allclose(scores, our_scores)
        if i == steps - 1:
            break
        topk_p, topk_index = draft_probs(b * topk)
        hidden = torch.randn(b * topk, hidden_size, generator=gen)
    for (s1, t1, p1), (s2, t2, p2) in zip(sg_levels, our_levels):
        assert torch.allclose(s1, s2) and torch.equal(t1, t2) and torch.equal(p1, p2)
    sg = organize_draft_results([lv[0] for lv in sg_levels], [lv[1] for lv in sg_levels],
                                [lv[2] for lv in sg_levels], tokens)
    ours = tree.organize(our_levels, tokens)
    for a, o in zip(sg, ours):
        assert torch.equal(a, o)
