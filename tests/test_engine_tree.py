"""Tree drafting (eagle_topk > 1): the tree math of engine/speculative/tree.py on hand-checked trees, and the embedded
engine's tree steps for MTP, EAGLE3 and STANDALONE (greedy equal to plain decoding, sampled output following
the target distribution, logprobs the target's), and those steps through the tree graphs
(engine/speculative/tree_graphs.py: on CPU
their padded shapes run eagerly). SGLang's own selection code is compared in tests/conformance/test_tree_draft.py."""

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from slime_spec.engine.drafters.eagle3 import load_eagle3_drafter
from slime_spec.engine.managers.engine_core import EngineCore, Request, SamplingParams, SpecConfig
from slime_spec.engine.model_executor.cuda_graph import CudaGraphSettings, key_buckets
from slime_spec.engine.model_executor.sampling import chi_square_pvalue
from slime_spec.engine.speculative import tree, tree_graphs
from slime_spec.tools.tiny_model import make_tiny_eagle3_draft, make_tiny_model
from tests.helpers.spec_runs import copy_target_into_mtp, exact_marginals, generate, make_requests

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


def reference_tree(parent_list: list[int], selected: list[int], topk: int):
    """build_tree's structure for one row, node by node: (parent, depth, ancestor-or-self sets, first child, next
    sibling), children linked in ascending order."""
    n = len(selected) + 1
    where = {flat: i + 1 for i, flat in enumerate(selected)}
    parent, depth, seen = [-1] * n, [0] * n, [{0}] + [set() for _ in range(n - 1)]
    for i in range(1, n):
        slot = selected[i - 1] // topk
        p = 0 if slot == 0 else where.get(parent_list[slot], -1)
        parent[i] = p
        if p >= 0:
            depth[i], seen[i] = depth[p] + 1, set(seen[p])
        seen[i].add(i)
    first, sibling = [-1] * n, [-1] * n
    for i in range(n - 1, 0, -1):
        if parent[i] >= 0:
            sibling[i], first[parent[i]] = first[parent[i]], i
    return parent, depth, seen, first, sibling


@pytest.mark.parametrize("steps,topk,num_draft_tokens", [(1, 4, 5), (3, 2, 6), (5, 4, 16), (5, 8, 32)])
def test_build_tree_on_the_device_equals_the_node_by_node_reference(steps, topk, num_draft_tokens):
    """Random draft trees through the real drafting selection (first_level, next_level, organize), with tied
    scores, built in tensor ops and checked row by row against the reference (an orphan: the hand tree above)."""
    gen = torch.Generator().manual_seed(steps * 100 + topk)
    b, vocab = 6, 50
    for _ in range(5):
        # coarse probabilities so ties occur
        probs = lambda *shape: torch.randint(1, 4, shape, generator=gen).float().div(4)  # noqa: E731
        tokens = lambda *shape: torch.randint(0, vocab, shape, generator=gen)  # noqa: E731
        frontier, scores, level = tree.first_level(probs(b, topk), tokens(b, topk))
        levels = [level]
        for i in range(1, steps):
            frontier, _, scores, level = tree.next_level(i, probs(b, topk, topk), tokens(b, topk, topk), scores)
            levels.append(level)
        parents, selected, draft_tokens = tree.organize(levels, num_draft_tokens)
        t = tree.build_tree(tokens(b), parents, selected, draft_tokens, topk)
        for r in range(b):
            parent, depth, seen, first, sibling = reference_tree(parents[r].tolist(), selected[r].tolist(), topk)
            assert t.parent[r].tolist() == parent and t.depth[r].tolist() == depth
            assert t.first_child[r].tolist() == first and t.next_sibling[r].tolist() == sibling
            assert [set(row.nonzero().flatten().tolist()) for row in t.mask[r]] == seen


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


def test_node_attention_places_nodes_from_start_and_masks_by_region():
    visible = torch.tensor([[[True, False, False], [True, True, False]]])
    where, mask = tree.node_attention(torch.tensor([2]), torch.tensor([3]), visible, 6)
    assert where.tolist() == [[3, 4]]
    assert torch.equal(mask, tree.region_mask(torch.tensor([2]), visible, 6))


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


# ------------------------------------------------------------------ the engine's tree steps
TREES = [(3, 2, 4), (3, 4, 8), (4, 8, 16)]  # (num_steps, eagle_topk, num_draft_tokens)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("tree_models")
    llama = make_tiny_model(root / "llama", hidden_size=32, num_layers=4, seed=31)
    v16 = make_tiny_model(root / "v16", vocab_size=16, hidden_size=32, num_layers=4, seed=32)
    return {
        "llama": llama,
        "llama_small": make_tiny_model(root / "small", hidden_size=32, num_layers=1, seed=33, init_from=str(llama)),
        "llama_eagle3": make_tiny_eagle3_draft(root / "le", llama, draft_vocab_size=40),
        "mimo": make_tiny_model(root / "mimo", arch="mimo", hidden_size=32, num_layers=1, seed=13),
        "v16": v16,
        "v16_small": make_tiny_model(root / "v16s", vocab_size=16, hidden_size=32, num_layers=1, seed=34),
        "v16_eagle3": make_tiny_eagle3_draft(root / "ve", v16, draft_vocab_size=12),
        "v16_mimo": make_tiny_model(root / "v16m", arch="mimo", vocab_size=16, hidden_size=32, num_layers=1, seed=16),
    }


def _tree_spec(algorithm, steps, topk, tokens, draft=None):
    return SpecConfig(algorithm, steps, topk, tokens, None if draft is None else str(draft))


def _check_lossless(ckpts, target, spec, prepare=None):
    """Greedy rows (sharing batches with sampled ones) equal plain decoding, logprobs included; returns the
    engine's accept length."""
    base_engine = EngineCore(str(ckpts[target]), None, max_running_requests=4)
    tok = base_engine.tokenizer
    base = generate(base_engine, make_requests(tok, logprob=True))
    engine = EngineCore(str(ckpts[target]), spec, max_running_requests=4)
    if prepare is not None:
        prepare(engine)
    outs = generate(engine, make_requests(tok, temps=[0.0, 0.0, 0.9], logprob=True), join_every=3)
    for rid, o in base.items():
        if int(rid[1:]) % 3 != 2:
            assert o.output_ids == outs[rid].output_ids, (spec, rid)
            assert o.finish_reason == outs[rid].finish_reason
            torch.testing.assert_close(torch.tensor(outs[rid].output_logprobs), torch.tensor(o.output_logprobs),
                                       atol=1e-4, rtol=0)
    verified = [o for o in outs.values() if o.spec_verify_ct]
    assert verified and all(o.spec_draft_token_num == o.spec_verify_ct * (spec.speculative_num_draft_tokens - 1)
                            for o in verified)
    assert 1.0 <= engine.avg_spec_accept_length <= spec.speculative_num_steps + 1
    return engine.avg_spec_accept_length


def _check_sampling(ckpts, target, spec, min_accept):
    """Sampled output follows the target distribution (the plain sampler's exact marginals of tokens 2 and 3)."""
    prompt, temperature, n = [5, 6, 7, 5, 6], 1.3, 3000
    engine = EngineCore(str(ckpts[target]), spec, max_running_requests=64, seed=0)
    params = SamplingParams(temperature=temperature, max_new_tokens=3, ignore_eos=True)
    for i in range(n):
        engine.add_request(Request(str(i), prompt, params))
    outs = []
    while engine.has_work():
        outs += engine.step()
    accepted = sum(o.spec_accept_token_num for o in outs)
    assert min_accept * n < accepted < sum(o.spec_draft_token_num for o in outs)
    p2, p3 = exact_marginals(str(ckpts[target]), prompt, temperature)
    t2 = torch.bincount(torch.tensor([o.output_ids[1] for o in outs]), minlength=16)
    t3 = torch.bincount(torch.tensor([o.output_ids[2] for o in outs]), minlength=16)
    assert chi_square_pvalue(t2, p2) > 1e-3
    assert chi_square_pvalue(t3, p3) > 1e-3


@pytest.mark.parametrize("steps,topk,tokens", TREES)
def test_mtp_tree_greedy_equals_plain_decoding(ckpts, steps, topk, tokens):
    accept = _check_lossless(ckpts, "mimo", _tree_spec("EAGLE", steps, topk, tokens), prepare=copy_target_into_mtp)
    assert accept > 1.8  # a good draft's trees are accepted: the moved KV and the draft's catch-up are exercised


def _reference_mtp_logits(engine, ckpts, tokens, path):
    """The MTP layer's logits after `path` (draft tokens after the pending one), recomputed from scratch: target
    forward, MTP extend over x_1..x_n, then one chained step per path token."""
    model, n = engine.model, len(tokens) - 1
    ids, pos = torch.tensor([tokens[:n]]), torch.arange(n)[None]
    hidden = model(ids, pos, model.new_cache(1, n + len(path) + 2), torch.tensor([0]))
    cache = model.new_mtp_cache(1, n + len(path) + 2)
    out = model.mtp_forward(torch.tensor([tokens[1:]]), hidden, pos, cache, torch.tensor([0]))[:, -1]
    for j, t in enumerate(path):
        out = model.mtp_forward(torch.tensor([[t]]), out[:, None], torch.tensor([[n + j]]), cache,
                                torch.tensor([0]))[:, 0]
    return model.logits(out)[0]


def _reference_eagle3_logits(engine, ckpts, tokens, path):
    """The EAGLE3 draft's logits after `path`, recomputed by a fresh chain drafter: target aux states over the
    context, a draft extend over x_1..x_n, then one chained step per path token."""
    target, n = engine.model, len(tokens) - 1
    d = load_eagle3_drafter(target, str(ckpts["llama_eagle3"]), num_steps=1, slots=1, max_seq=n + len(path) + 2)
    ids, pos, slot = torch.tensor([tokens[:n]]), torch.arange(n)[None], torch.tensor([0])
    _, aux = target(ids, pos, target.new_cache(1, n + 1), slot, aux_layer_ids=d.aux_layer_ids)
    out = d.step(torch.tensor([tokens[1:]]), aux, pos, slot)
    logits, hidden = d.logits(out)[:, -1], out[:, -1]
    for j, t in enumerate(path):
        out = d.step(torch.tensor([[t]]), hidden[:, None], torch.tensor([[n + j]]), slot, num_keys=n + j + 1)
        logits, hidden = d.logits(out)[:, 0], out[:, 0]
    return d.target_vocab_logits(logits)[0]


def _reference_standalone_logits(engine, ckpts, tokens, path):
    """The draft model's logits after the row's tokens and `path`, by one full forward."""
    draft = engine.drafter.draft
    seq = torch.tensor([tokens + path])
    hidden = draft(seq, torch.arange(seq.shape[1])[None], draft.new_cache(1, seq.shape[1]), torch.tensor([0]))
    return draft.logits(hidden[0, -1])


@pytest.mark.parametrize("target,spec,reference", [
    ("mimo", ("EAGLE", None), _reference_mtp_logits),
    ("llama", ("EAGLE3", "llama_eagle3"), _reference_eagle3_logits),
    ("llama", ("STANDALONE", "llama_small"), _reference_standalone_logits),
])
def test_tree_nodes_are_the_top_k_of_their_parents_draft_distribution(ckpts, target, spec, reference):
    """Each node's token is among the top-k of the draft distribution at its parent, recomputed from scratch over
    the parent's path: the frontier's tree attention (context + own ancestors) and state hand-off are right."""
    steps, topk, tokens = 3, 4, 8
    algorithm, draft = spec
    engine = EngineCore(str(ckpts[target]), _tree_spec(algorithm, steps, topk, tokens, draft and ckpts[draft]),
                        max_running_requests=4)
    if algorithm == "EAGLE":
        copy_target_into_mtp(engine)
    recorded = []
    draft_tree = engine.drafter.tree_draft

    def recording(rows, shape):
        t = draft_tree(rows, shape)
        if len(recorded) < 6:
            recorded.extend((list(r.tokens), t.tokens[i].tolist(), t.parent[i].tolist()) for i, r in enumerate(rows))
        return t

    engine.drafter.tree_draft = recording
    generate(engine, make_requests(engine.tokenizer)[:4])
    assert len(recorded) >= 6
    for row_tokens, node_tokens, parent in recorded:
        for node in range(1, tokens):
            path, p = [], parent[node]
            while p > 0:
                path.insert(0, node_tokens[p])
                p = parent[p]
            with torch.no_grad():
                probs = torch.softmax(reference(engine, ckpts, row_tokens, path).float(), -1)
            assert probs[node_tokens[node]] >= probs.topk(topk).values[-1] - 1e-5, (row_tokens, node)


def test_mtp_tree_sampling_follows_the_target_distribution(ckpts):
    _check_sampling(ckpts, "v16_mimo", _tree_spec("EAGLE", 2, 4, 6), min_accept=0.05)


@pytest.mark.parametrize("steps,topk,tokens", TREES)
def test_eagle3_tree_greedy_equals_plain_decoding(ckpts, steps, topk, tokens):
    _check_lossless(ckpts, "llama", _tree_spec("EAGLE3", steps, topk, tokens, ckpts["llama_eagle3"]))


def test_eagle3_tree_sampling_follows_the_target_distribution(ckpts):
    _check_sampling(ckpts, "v16", _tree_spec("EAGLE3", 2, 4, 6, ckpts["v16_eagle3"]), min_accept=0.02)


@pytest.mark.parametrize("steps,topk,tokens", TREES)
def test_standalone_tree_greedy_equals_plain_decoding(ckpts, steps, topk, tokens):
    _check_lossless(ckpts, "llama", _tree_spec("STANDALONE", steps, topk, tokens, ckpts["llama_small"]))


def test_standalone_tree_with_the_target_as_draft_accepts_every_verify(ckpts):
    """A draft equal to the target, greedy: the root's most likely child has the highest score of the whole tree,
    so it is always verified and accepted; deeper nodes are accepted where the greedy path stayed in the tree.
    The output stays plain decoding's, so the moved KV is right."""
    _check_lossless(ckpts, "llama", _tree_spec("STANDALONE", 3, 2, 6, ckpts["llama"]))
    engine = EngineCore(str(ckpts["llama"]), _tree_spec("STANDALONE", 3, 2, 6, ckpts["llama"]), max_running_requests=4)
    outs = generate(engine, make_requests(engine.tokenizer))
    assert all(o.spec_accept_token_num >= o.spec_verify_ct for o in outs.values())
    assert engine.avg_spec_accept_length > 2.5


def test_standalone_tree_sampling_follows_the_target_distribution(ckpts):
    _check_sampling(ckpts, "v16", _tree_spec("STANDALONE", 2, 4, 6, ckpts["v16_small"]), min_accept=0.02)


# ------------------------------------------------------------------ the tree graphs (engine/speculative/tree_graphs.py)
GRAPHED = [("mimo", "EAGLE", None), ("llama", "EAGLE3", "llama_eagle3"), ("llama", "STANDALONE", "llama_small")]
# What each tree engine replays: the target's verify, and its drafter's tree step and extend (or catch-up).
GRAPH_NAMES = {"EAGLE": {"target.tree", "target.mtp", "target.mtp_tree"},
               "EAGLE3": {"target.tree", "drafter.tree", "drafter.extend"},
               "STANDALONE": {"target.tree", "draft.tree", "draft.target"}}


def _tree_graphs_of(engine) -> dict:
    """Every graph a tree engine holds, as "owner.name": the target's, an EAGLE3 head's, a STANDALONE draft's."""
    drafter = engine.drafter
    owners = {"target": engine.model.graphs, "drafter": getattr(drafter, "graphs", {}),
              "draft": getattr(getattr(drafter, "draft", None), "graphs", {})}
    return {f"{owner}.{name}": g for owner, graphs in owners.items() for name, g in graphs.items()}


def _install_tree_graphs(engine) -> dict:
    """The engine's tree graphs over batch sizes 1, 2, 4 (a batch of 3 is padded to 4), run eagerly (CPU)."""
    engine.cuda_graph = CudaGraphSettings(batch_sizes=(1, 2, 4))
    tree_graphs.capture_tree_graphs(engine, tree.tree_shape(engine.spec), capture=False)
    return _tree_graphs_of(engine)


def _tree_engine(ckpts, target, algorithm, draft, shape=(3, 4, 8), **kwargs):
    engine = EngineCore(str(ckpts[target]), _tree_spec(algorithm, *shape, draft and ckpts[draft]),
                        max_running_requests=4, **kwargs)
    if algorithm == "EAGLE":
        copy_target_into_mtp(engine)  # a good draft: accepted paths of every length
    return engine


@pytest.mark.parametrize("target,algorithm,draft", GRAPHED[:2])
def test_graphed_tree_verify_equals_the_eager_verify(ckpts, target, algorithm, draft):
    """The verify graph (3 rows padded to 4, keys to a bucket, node locations and mask computed from its inputs)
    gives the eager verify's outputs: bit for bit at the same key count, and the same accepted paths at the
    row's own; the padded row writes only into the scratch slot."""
    engine = _tree_engine(ckpts, target, algorithm, draft)
    for r in make_requests(engine.tokenizer)[:3]:
        engine.add_request(r)
    engine.step()  # the prefill
    engine.step()  # a tree step
    rows, aux = engine.running, getattr(engine.drafter, "aux_layer_ids", None)
    base, slots = torch.tensor([r.kv_len for r in rows]), torch.tensor([r.slot for r in rows])
    num_keys = int(base.max()) + 8
    with torch.no_grad():
        drafted = engine.drafter.tree_draft(rows, tree.tree_shape(engine.spec))
        eager = tree_graphs.verify_tree(engine.model, engine.cache, drafted, base, slots, num_keys, aux)
        bucket = min(b for b in key_buckets(engine.cache.max_seq) if b >= num_keys)
        eager_at_bucket = tree_graphs.verify_tree(engine.model, engine.cache, drafted, base, slots, bucket, aux)
        graph = _install_tree_graphs(engine)["target.tree"]
        free = next(s for s in range(4) if s not in slots.tolist())
        untouched = engine.cache.k[0][free].clone()
        graphed = tree_graphs.verify_tree(engine.model, engine.cache, drafted, base, slots, num_keys, aux)
    assert graph.calls == 1 and graph.shape_for(len(rows), 8, num_keys) == (4, 8, bucket)
    assert torch.equal(engine.cache.k[0][free], untouched)
    assert all(torch.equal(g, e) for g, e in zip(graphed, eager_at_bucket))
    for g, e in zip(graphed, eager):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)
    greedy, gen = torch.ones(len(rows), dtype=torch.bool), torch.Generator()
    accepted = [tree.accept(drafted, engine.model.logits(h), greedy, None, gen) for h in (graphed[0], eager[0])]
    assert accepted[0] == accepted[1]


@pytest.mark.parametrize("target,algorithm,draft", GRAPHED)
def test_graphed_tree_greedy_equals_plain_decoding(ckpts, target, algorithm, draft):
    """Tree steps through the graphs (verify, draft steps, the drafter's extend or catch-up; padded batches, key
    buckets) keep greedy output plain decoding's, logprobs included; every graph was called."""
    graphs = {}

    def prepare(engine):
        if algorithm == "EAGLE":
            copy_target_into_mtp(engine)
        graphs.update(_install_tree_graphs(engine))

    _check_lossless(ckpts, target, _tree_spec(algorithm, 3, 4, 8, draft and ckpts[draft]), prepare=prepare)
    assert set(graphs) == GRAPH_NAMES[algorithm]
    assert all(g.calls > 0 for g in graphs.values()), {n: g.calls for n, g in graphs.items()}


class HostReads(TorchDispatchMode):
    """Records the ops a CUDA graph capture refuses: reading a value back (.item(), int(t), bool masks, which
    count their rows on the host) and making a tensor from host data (torch.tensor(list))."""

    REFUSED = {"aten._local_scalar_dense.default", "aten.lift_fresh.default", "aten.nonzero.default",
               "aten.masked_select.default"}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        indices = args[1] if str(func).startswith(("aten.index.", "aten.index_put")) else ()
        if str(func) in self.REFUSED or any(i is not None and i.dtype == torch.bool for i in indices):
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("target,algorithm,draft", GRAPHED)
def test_tree_graph_forwards_read_nothing_back_to_the_host(ckpts, target, algorithm, draft, monkeypatch):
    """What each tree graph captures (its padded static call, as `GraphedForward.capture` runs it) is device work
    only, so the capture on CUDA cannot fail on a sync or a host copy; checked here on CPU."""
    engine = _tree_engine(ckpts, target, algorithm, draft)
    graphs = _install_tree_graphs(engine)
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("tolist() in a captured forward"))
    for name, graph in graphs.items():
        with torch.no_grad(), HostReads() as reads:
            graph._static_call(4, graph.token_counts[-1], graph.key_counts[0])
        assert not reads.seen, (name, reads.seen)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (runs on the GPU machine)")
@pytest.mark.parametrize("target,algorithm,draft", GRAPHED)
def test_cuda_graphed_tree_equals_eager_tree_and_plain_decoding(ckpts, target, algorithm, draft):
    """On CUDA a tree engine captures its verify and draft graphs: greedy output equals the eager tree's
    (--disable-cuda-graph) and plain decoding's on the same device (CPU and CUDA kernels may round differently),
    every graph replayed, and the accept length is the eager tree's (an MTP layer updated in place after capture,
    as `copy_target_into_mtp` does, is read by the graphs)."""
    plain = EngineCore(str(ckpts[target]), None, device="cuda", max_running_requests=4)
    base = generate(plain, make_requests(plain.tokenizer))
    for shape in TREES:
        outs, accept = {}, {}
        for settings in (CudaGraphSettings(disable=True), CudaGraphSettings(batch_sizes=(1, 2, 4))):
            engine = _tree_engine(ckpts, target, algorithm, draft, shape, device="cuda", cuda_graph=settings)
            graphs = _tree_graphs_of(engine)
            assert set(graphs) == (set() if settings.disable else GRAPH_NAMES[algorithm])
            outs[settings.disable] = generate(engine, make_requests(engine.tokenizer, logprob=True))
            accept[settings.disable] = engine.avg_spec_accept_length
            assert all(g.calls > 0 for g in graphs.values()), (shape, {n: g.calls for n, g in graphs.items()})
        for rid, o in base.items():
            assert outs[True][rid].output_ids == o.output_ids, (algorithm, shape, rid)
            assert outs[False][rid].output_ids == o.output_ids, (algorithm, shape, rid)
        assert accept[False] == pytest.approx(accept[True], rel=0.05), (algorithm, shape)
