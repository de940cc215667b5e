"""The overlap schedule's plain decode step captured whole: input token, forward, lm_head, non-finite check, argmax
and the last-token update in one CUDA graph.

With the forward alone captured (cuda_graph.GraphedForward), a plain step still launched about 15 small eager ops
around the replay (copies into the graph's inputs, the lm_head, the non-finite check, the argmax, the token buffer's
gather and scatter, packing the read-back) and copied the hidden states out. At batch 1 of a 0.7B model each such
launch costs the host more than its kernel costs the device, and the device waits for them. Here the step's inputs
(position and slot per row) go in as one copy from pinned memory, the graph does the rest, and its packed result
(token and non-finite flag per row) comes back as one copy. Rows that sample or ask for logprobs take the graph's
logits, in the model's dtype and unmasked as the sampling kernel reads them (the eager sampler upcasts and masks its
own copy), and are picked outside the graph (the greedy rows' tokens stay the argmax either way).
"""

from __future__ import annotations

from functools import partial

import torch

from slime_spec.engine.model_executor import sampling
from slime_spec.engine.model_executor.cuda_graph import GraphedForward


class DecodeStepGraph(GraphedForward):
    """Captured (hidden [B, 1, H], logits [B, V] as the lm_head gives them, tokens [B], values [2, B] float64:
    token and non-finite flag) per (batch, key count), reading each row's input token from `last_token[slot]` and
    writing the argmax back there. Its outputs are the graph's own buffers: the next replay overwrites them, so what
    must outlive the step (a drafter's hidden states) is cloned by the caller; the device reads them in stream
    order."""

    def __init__(self, model, cache, last_token: torch.Tensor, **common):
        common = {**common, "token_counts": [1]}
        if common.get("compile_max_bs"):  # --enable-torch-compile: the decoder layers compiled, as the target's graph
            common["compiled_fn"] = partial(self._step, compiled=True)
        super().__init__(self._step, cache=cache, **common)
        self.model, self.last_token = model, last_token
        # One buffer for both per-row inputs, so a step's inputs are one host-to-device copy.
        self.meta = torch.zeros(self.batch_sizes[-1], 2, dtype=torch.long, device=self.device)
        self.positions, self.slots = self.meta[:, 0:1], self.meta[:, 1]

    def _step(self, ids, positions, slots, num_keys, compiled=False):
        ids = self.last_token[slots][:, None]
        hidden = self.model.eager_forward(ids, positions, self.cache, slots, num_keys, compiled=compiled,
                                          graphed=True)
        # raw: the sampling kernel reads the model's dtype and checks finiteness itself; the argmax of the raw
        # logits is the argmax of their float32 copy, and a broken row's token is 0, as of its zeroed logits
        logits = self.model.logits(hidden[:, 0], upcast=False)
        broken = sampling.non_finite(logits)
        tokens = logits.argmax(-1).masked_fill_(broken, 0)
        self.last_token[slots] = tokens  # padded rows all write the scratch slot's entry
        return hidden, logits, tokens, torch.stack((tokens.double(), broken.double()))

    def pad_rows(self, host: torch.Tensor, n: int, bs: int) -> None:
        """Fill host[n:bs] (pinned [rows, 2]) with the padded rows' inputs: position 0 of the scratch slot."""
        if bs > n:
            host[n:bs, 0] = 0
            host[n:bs, 1] = self.scratch_slot

    def replay(self, host: torch.Tensor, n: int, shape: tuple[int, int, int]):
        """Run the step for host[:bs] ([bs, 2] pinned: position and slot per row, padded rows included); returns the
        graph's outputs for the first n rows (values [2, bs]: the caller reads its first n columns)."""
        bs = shape[0]
        self.calls += 1
        self.meta[:bs].copy_(host[:bs], non_blocking=True)
        if not self.capture_graphs:  # CPU: the same step eagerly, so its logic is tested where no GPU is
            with torch.no_grad():
                hidden, logits, tokens, values = self._static_call(bs, 1, shape[2])
        else:
            if not self.graphs:
                self.capture()
            graph, (hidden, logits, tokens, values) = self.graphs[shape]
            graph.replay()
        return hidden[:n], logits[:n], tokens[:n], values
