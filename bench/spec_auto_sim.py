"""`--spec-auto`'s choice of k on scripted costs and acceptance, over many seeds: does it settle where it should?

    python bench/spec_auto_sim.py                       # the GPU case: a captured draft chain, batch 1
    python bench/spec_auto_sim.py --accept 0.5          # drafts that do not pay: it should settle on plain steps

Each step drafts k tokens (AutoSteps.choose at batch 1), each draft accepted with probability --accept until the
first rejection; the step costs --plain-ms at k = 0 and --chain-ms + --verify-ms[k] otherwise (a captured chain
costs about the same for any k). Prints, per seed, the share of the last 200 steps at each k, and the expected
tokens per ms each k would give, so the right answer is on the table.
"""

from __future__ import annotations

import argparse
import random

from slime_spec.engine.speculative.policy import AutoSteps, expected_tokens


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--accept", type=float, default=0.9, help="probability each draft token is accepted")
    p.add_argument("--plain-ms", type=float, default=0.9)
    p.add_argument("--chain-ms", type=float, default=0.4, help="drafting cost of any k >= 1 (one captured chain)")
    p.add_argument("--verify-ms", type=float, nargs=3, default=(2.0, 2.05, 2.1), help="verify cost at k = 1, 2, 3")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--seeds", type=int, default=20)
    a = p.parse_args(argv)
    cost = {0: a.plain_ms, **{k: a.chain_ms + v for k, v in zip((1, 2, 3), a.verify_ms)}}
    rates = {k: expected_tokens(a.accept, k) / c for k, c in cost.items()}
    print("tokens per ms by k: " + ", ".join(f"{k}: {r:.3f}" for k, r in rates.items())
          + f" -> best k {max(rates, key=rates.get)}")
    print("| seed | share of the last 200 steps at k = 0 / 1 / 2 / 3 | accept rate estimate |\n|---|---|---|")
    for seed in range(a.seeds):
        rng = random.Random(seed)
        auto = AutoSteps(max_num_steps=3)
        ks = []
        for _ in range(a.steps):
            k = auto.choose(1)
            accepted = next((j for j in range(k) if rng.random() >= a.accept), k)
            draft_ms = a.chain_ms if k else 0.0
            auto.observe(1, k, [accepted], draft_s=draft_ms, verify_s=cost[k] - draft_ms)
            ks.append(k)
        tail = ks[-200:]
        shares = " / ".join(f"{tail.count(k) / len(tail):.2f}" for k in range(4))
        print(f"| {seed} | {shares} | {auto.accept_rate:.3f} |")


if __name__ == "__main__":
    main()
