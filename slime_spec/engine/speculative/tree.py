"""Tree drafting (eagle_topk > 1) as SGLang 0.5.23's EAGLE worker builds and verifies a draft tree: pure tensor math.

Drafting (`draft_tree`, SGLang's draft_forward + select_top_k_tokens): the root's top-k children come from the
first draft distribution; at every further step each of the top-k frontier nodes is expanded into its own top-k
children, a child's score is its parent's score times its draft probability (the cumulative product along the
path), and the top-k of those top-k * top-k children by score become the next frontier. The verify tree
(`organize`, SGLang's organize_draft_results) is the root plus the num_draft_tokens - 1 best-scored nodes of all
steps, kept in their drafting order. `build_tree` gives each node its parent, depth (its RoPE offset), ancestor
mask, and the first-child / next-sibling links the accept walk follows (SGLang's build_tree_kernel_efficient).

Verification follows SGLang's target-only rule (sgl_kernel `tree_speculative_sampling_target_only` with
threshold_single = threshold_acc = 1, which is lossless): one uniform coin per level; the node's children are
tried in order and child c is accepted when coin <= the summed target probability of the children tried so far;
when none is accepted the bonus token is drawn from the target distribution with every tried child zeroed,
renormalised. Greedy verification follows the child equal to the target's argmax.

Node caches: a drafter or the target gives tree node j of a row its own cache location base + j, while its RoPE
position is the row's length + depth; `region_mask` lets each node see the row's context and its own ancestors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from slime_spec.engine.model_executor import sampling
from slime_spec.engine.model_executor.transfer import device_tensor
from slime_spec.speculative.settings import SpecConfig


@dataclass(frozen=True)
class TreeShape:
    """SGLang's tree flags: speculative_num_steps, speculative_eagle_topk, speculative_num_draft_tokens."""

    steps: int
    topk: int
    num_draft_tokens: int

    @property
    def draft_region(self) -> int:
        """Cache locations the frontier nodes of one draft need past the row's length (steps - 1 forwards of top-k)."""
        return self.topk * (self.steps - 1)


def tree_shape(spec: SpecConfig | None) -> TreeShape | None:
    """The tree of a resolved EAGLE / EAGLE3 / STANDALONE config with eagle_topk > 1, else None (a chain; NGRAM's
    top-k is its BFS breadth, which the embedded engine drafts as a chain)."""
    if spec is None or not spec.speculative_algorithm.eagle_family or (spec.speculative_eagle_topk or 1) == 1:
        return None
    return TreeShape(spec.speculative_num_steps, spec.speculative_eagle_topk, spec.speculative_num_draft_tokens)


@dataclass
class DraftTree:
    """The verify tree of a batch: node 0 is the root (the pending token), nodes 1.. the drafted ones.

    tokens / parent / depth / first_child / next_sibling: [B, N] (parent of the root and missing links: -1);
    mask: [B, N, N] bool, node i sees node j iff j is i or an ancestor of i."""

    tokens: torch.Tensor
    parent: torch.Tensor
    depth: torch.Tensor
    mask: torch.Tensor
    first_child: torch.Tensor
    next_sibling: torch.Tensor


# ------------------------------------------------------------------ drafting
def first_level(topk_p: torch.Tensor, topk_index: torch.Tensor):
    """Step 0: the root's top-k children. Returns (frontier tokens [B, k], scores [B, k], level record)."""
    b, k = topk_p.shape
    parents = torch.arange(-1, k, device=topk_p.device).expand(b, k + 1)  # -1: the root, then the k nodes' ids
    return topk_index, topk_p, (topk_p[:, None], topk_index, parents)


def next_level(step: int, topk_p: torch.Tensor, topk_index: torch.Tensor, scores: torch.Tensor):
    """Step >= 1: expand each frontier node (topk_p / topk_index [B, k, k]: its children's draft probabilities and
    tokens) and keep the top-k children by cumulative score. Returns (frontier tokens [B, k], which previous
    frontier node each came from [B, k], scores [B, k], level record)."""
    b, k = scores.shape
    expanded = scores[:, :, None] * topk_p                       # [B, k, k]
    best_p, best = expanded.flatten(1).topk(k, dim=-1)           # [B, k]
    tokens = topk_index.reshape(b, k * k)
    frontier = tokens.gather(1, best)
    # Flat ids in the concatenated score list: k first-level nodes, then k * k per later step.
    ids = best + (k * k * (step - 1) + k)
    return frontier, best // k, best_p, (expanded, tokens, ids)


def organize(levels: list[tuple], num_draft_tokens: int):
    """The best num_draft_tokens - 1 nodes by score, in drafting order. Returns (parent_list [B, 1 + k (steps-1)]:
    flat id of each expanded node, selected flat ids [B, N-1], their tokens [B, N-1])."""
    scores = torch.cat([lv[0].flatten(1) for lv in levels], dim=1)
    tokens = torch.cat([lv[1] for lv in levels], dim=1)
    selected = scores.topk(num_draft_tokens - 1, dim=-1).indices.sort(dim=-1).values
    parents = torch.cat([lv[2] for lv in levels[:-1]], dim=1) if len(levels) > 1 else \
        torch.empty(scores.shape[0], 0, dtype=torch.long, device=scores.device)
    return parents, selected, tokens.gather(1, selected)


def build_tree(root: torch.Tensor, parent_list: torch.Tensor, selected: torch.Tensor, draft_tokens: torch.Tensor,
               topk: int) -> DraftTree:
    """Verify-tree structure from `organize`'s output (root [B]: each row's pending token), in tensor ops on the
    drafts' device, as SGLang builds it on the GPU: nothing is read back, where a loop over rows and nodes on the host
    cost O(B N^2) Python per step.

    A selected node's parent is the root when it is a first-level node, else the selected node holding its
    parent's flat id. A node whose parent was not selected (possible only through tied scores) is linked to no
    parent, so the walk never reaches it (SGLang's kernel skips it the same way). Children are linked in ascending
    node order."""
    b, n1 = selected.shape
    n, dev = n1 + 1, selected.device
    slot = selected // topk  # 0: a child of the root; else its parent's entry in parent_list
    parent_flat = (parent_list.gather(1, slot.clamp(0, parent_list.shape[1] - 1)) if parent_list.shape[1]
                   else torch.full_like(slot, -1))
    holds = selected[:, None, :] == parent_flat[:, :, None]  # [B, child, node]: that node is the child's parent
    linked = torch.where(holds.any(-1), holds.long().argmax(-1) + 1, -1)
    parent = torch.cat((torch.full((b, 1), -1, dtype=torch.long, device=dev),
                        torch.where(slot == 0, 0, linked)), dim=1)
    nodes = torch.arange(n, device=dev)
    # mask[i, j]: j is i or an ancestor of i; pointer doubling over the parent links reaches every ancestor
    mask = torch.eye(n, dtype=torch.bool, device=dev).expand(b, n, n) | (parent[:, :, None] == nodes)
    for _ in range(max(1, (n - 1).bit_length())):
        mask = mask | (torch.bmm(mask.float(), mask.float()) > 0)
    depth = mask.sum(-1) - 1
    is_child = parent[:, None, :] == nodes[None, :, None]  # [B, node, candidate child]
    first_child = torch.where(is_child.any(-1), is_child.long().argmax(-1), -1)
    later_sibling = ((parent[:, :, None] == parent[:, None, :]) & (nodes[None, :] > nodes[:, None])
                     & (parent >= 0)[:, :, None])
    next_sibling = torch.where(later_sibling.any(-1), later_sibling.long().argmax(-1), -1)
    return DraftTree(torch.cat((root[:, None], draft_tokens), dim=1), parent, depth, mask, first_child, next_sibling)


# step(i, frontier tokens [B, k], input state [B, k, ...], visible [B, k, region]) -> (logits [B, k, V], state)
DraftStep = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def draft_tree(root: torch.Tensor, first_logits: torch.Tensor, first_state: torch.Tensor, step: DraftStep,
               shape: TreeShape) -> DraftTree:
    """Draft a tree for each row: SGLang's draft loop over `shape.steps` selections with steps - 1 draft forwards.

    first_logits [B, V]: the draft's logits for the root's children; first_state [B, ...]: the state the first
    frontier reads (e.g. the draft hidden state the last extend left). `step` runs the draft on the frontier
    of step i (tokens at depth i + 1, each reading its parent's output state) and returns each node's logits and
    output state; `visible[b, j]` marks the draft-region locations frontier node j may attend to (its
    ancestors' and its own, at location i * topk + j: see TreeShape.draft_region)."""
    k = shape.topk
    b = first_logits.shape[0]
    topk_p, topk_index = torch.softmax(first_logits.float(), dim=-1).topk(k, dim=-1)
    frontier, scores, level = first_level(topk_p, topk_index)
    levels = [level]
    state = first_state[:, None].expand(b, k, *first_state.shape[1:])
    visible = torch.zeros(b, k, shape.draft_region, dtype=torch.bool, device=first_logits.device)
    cols = torch.arange(k, device=first_logits.device)
    for i in range(shape.steps - 1):
        visible = visible.clone()
        visible[:, cols, i * k + cols] = True
        logits, out = step(i, frontier, state, visible)
        topk_p, topk_index = torch.softmax(logits.float(), dim=-1).topk(k, dim=-1)
        frontier, came_from, scores, level = next_level(i + 1, topk_p, topk_index, scores)
        levels.append(level)
        state = _take(out, came_from)
        visible = _take(visible, came_from)
    parents, selected, tokens = organize(levels, shape.num_draft_tokens)
    return build_tree(root, parents, selected, tokens, k)


def _take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [B, k, ...] -> x[b, index[b, j]] for each j."""
    return x[torch.arange(x.shape[0], device=x.device)[:, None], index]


def region_mask(base: torch.Tensor, visible: torch.Tensor, num_keys: int) -> torch.Tensor:
    """[B, 1, T, S] attention mask for T tree queries per row: every context key (location < base[b]) and the
    region locations base[b] + r where visible[b, t, r]."""
    keys = torch.arange(num_keys, device=base.device)
    offset = keys[None, :] - base[:, None]                                  # [B, S]
    context = (offset < 0)[:, None, :].expand(-1, visible.shape[1], -1)
    inside = (offset >= 0) & (offset < visible.shape[2])
    region = visible.gather(2, offset.clamp(0, visible.shape[2] - 1)[:, None, :].expand(-1, visible.shape[1], -1))
    return (context | (region & inside[:, None, :]))[:, None]


def node_attention(base: torch.Tensor, start: torch.Tensor, visible: torch.Tensor,
                   num_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cache locations [B, T], attention mask [B, 1, T, S]) of T tree nodes per row: node t at start[b] + t (a
    verify: start = base; draft step i: base + i * topk), seeing the context and what `visible` marks
    (`region_mask`). Tensor ops only, so a captured graph computes both from its static inputs
    (engine/speculative/tree_graphs.py)."""
    nodes = torch.arange(visible.shape[1], device=start.device)
    return start[:, None] + nodes, region_mask(base, visible, num_keys)


# ------------------------------------------------------------------ verification
def greedy_walk(first_child: list[int], next_sibling: list[int], tokens: list[int],
                target: list[int]) -> tuple[list[int], int]:
    """Follow the child whose token is the target's argmax at its parent. Returns (accepted node path from the
    root, root included; the next token: the target's argmax at the last accepted node)."""
    path, cur = [0], 0
    while True:
        child = first_child[cur]
        while child != -1 and tokens[child] != target[cur]:
            child = next_sibling[child]
        if child == -1:
            return path, target[cur]
        path.append(child)
        cur = child


def sampled_walk(first_child: list[int], next_sibling: list[int], tokens: list[int], child_prob: list[float],
                 coins: list[float]) -> list[int]:
    """SGLang's target-only tree rule up to the bonus token (module docstring). child_prob[c]: the target's
    probability of node c's token at its parent; coins[c]: the uniform draw of the level below node c."""
    path, cur = [0], 0
    while True:
        coin, acc = coins[cur], 0.0
        child = first_child[cur]
        while child != -1:
            acc += child_prob[child]
            if coin <= acc:
                break
            child = next_sibling[child]
        if child == -1:
            return path
        path.append(child)
        cur = child


def residual_probs(probs: torch.Tensor, tried: torch.Tensor) -> torch.Tensor:
    """probs [V] with the tried children's tokens zeroed, renormalised (the bonus distribution after a level
    rejected all its children). A residual of zero mass can only come from float round-off; p itself then."""
    residual = probs.index_fill(0, tried, 0.0) if tried.numel() else probs
    mass = residual.sum()
    return residual / mass if float(mass) > 0 else probs


def move_accepted_kv(caches: list[torch.Tensor], slots: list[int], base: list[int], paths: list[list[int]]) -> None:
    """Copy each row's accepted nodes' keys/values from their tree locations base + node to base + depth, so the
    row's cache is contiguous again (SGLang moves the accepted KV the same way). caches: [slots, S, ...] each."""
    moves = [(slot, b + node, b + j) for slot, b, path in zip(slots, base, paths)
             for j, node in enumerate(path) if node != j]
    if not moves:
        return
    slot, src, dst = (device_tensor(col, caches[0].device) for col in zip(*moves))
    for cache in caches:
        cache[slot, dst] = cache[slot, src]


def children(first_child: list[int], next_sibling: list[int], node: int) -> list[int]:
    out, c = [], first_child[node]
    while c != -1:
        out.append(c)
        c = next_sibling[c]
    return out


def accept(tree: DraftTree, logits: torch.Tensor, greedy: torch.Tensor, probs: torch.Tensor | None,
           generator: torch.Generator) -> tuple[list[list[int]], list[int]]:
    """Accepted paths (node indices from the root) and next tokens, per row.

    logits [B, N, V] the target's at every node; greedy [B] bool; probs [S, N, V] the filtered target
    distributions of the sampled rows (in row order), None when every row is greedy."""
    b, n = tree.tokens.shape
    first, sib, toks = tree.first_child.tolist(), tree.next_sibling.tolist(), tree.tokens.tolist()
    paths, nxt = [None] * b, [0] * b
    greedy_rows = greedy.nonzero().flatten().tolist()
    if greedy_rows:
        target = logits[greedy_rows].argmax(-1).tolist()
        for i, r in enumerate(greedy_rows):
            paths[r], nxt[r] = greedy_walk(first[r], sib[r], toks[r], target[i])
    sampled_rows = (~greedy).nonzero().flatten().tolist()
    if sampled_rows:
        idx = device_tensor(sampled_rows, logits.device)
        parent = tree.parent[idx].clamp_min(0)
        # The target's probability of each node's token at its parent.
        child_p = probs.gather(1, parent[..., None].expand(-1, -1, probs.shape[-1])) \
            .gather(2, tree.tokens[idx][..., None])[..., 0].tolist()
        coins = torch.rand(len(sampled_rows), n, generator=generator, device=logits.device).tolist()
        residuals = []
        for i, r in enumerate(sampled_rows):
            paths[r] = sampled_walk(first[r], sib[r], toks[r], child_p[i], coins[i])
            cur = paths[r][-1]
            tried = device_tensor([toks[r][c] for c in children(first[r], sib[r], cur)], logits.device, torch.long)
            residuals.append(residual_probs(probs[i, cur], tried))
        bonus = sampling.sample(torch.stack(residuals), generator).tolist()
        for i, r in enumerate(sampled_rows):
            nxt[r] = bonus[i]
    return paths, nxt
