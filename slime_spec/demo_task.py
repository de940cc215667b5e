"""The demo's synthetic task: multi-digit addition with a verifiable answer.

Prompts look like "37+58=" and the answer is "95"; the reward is exact match on the
generated answer (`--rm-type exact_match`). Pure functions, deterministic by seed.
"""

from __future__ import annotations

import json
import random
from pathlib import Path


def write_jsonl(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def split_problems(n_train: int, n_eval: int, seed: int, max_operand: int = 99) -> tuple[list[dict], list[dict]]:
    """Disjoint train and eval problems drawn from every a+b with operands <= max_operand (eval never trains)."""
    pool = [{"prompt": f"{a}+{b}=", "label": str(a + b)} for a in range(max_operand + 1) for b in range(max_operand + 1)]
    if len(pool) < n_train + n_eval:
        raise ValueError(f"only {len(pool)} distinct problems with operands <= {max_operand}; ask for fewer")
    random.Random(seed).shuffle(pool)
    return pool[n_eval:n_eval + n_train], pool[:n_eval]
