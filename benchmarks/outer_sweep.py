"""Outer-optimizer sweep for the quality gap: Decoupled DiLoCo vs data-parallel at equal tokens.

4 learners, tiny model, uniform speeds, K = 1 + grace, int4; each row changes the outer optimizer,
the merge rule or H. ``python benchmarks/outer_sweep.py [--steps 600]``: a table, then one JSON
object as the last line (no plot: the numbers are the result).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import _common as C

from islands.orchestrator import inprocess

CONFIGS = [  # (name, outer kind, outer kwargs, merge rule, H)
    ("nesterov 0.7/0.9 (the first default)", "nesterov", dict(lr=0.7, momentum=0.9), "rda", 24),
    ("nesterov 0.7/0.5", "nesterov", dict(lr=0.7, momentum=0.5), "rda", 24),
    ("nesterov 1.0/0.5", "nesterov", dict(lr=1.0, momentum=0.5), "rda", 24),
    ("nesterov 0.3/0.9", "nesterov", dict(lr=0.3, momentum=0.9), "rda", 24),
    ("sgd 1.0 (averaging)", "sgd", dict(lr=1.0, momentum=0.0), "rda", 24),
    ("sgd 1.2", "sgd", dict(lr=1.2, momentum=0.0), "rda", 24),
    ("sgd 1.0, weighted mean merge", "sgd", dict(lr=1.0, momentum=0.0), "mean", 24),
    ("nesterov 0.7/0.9, weighted mean merge", "nesterov", dict(lr=0.7, momentum=0.9), "mean", 24),
    ("sgd 1.0, H = 8", "sgd", dict(lr=1.0, momentum=0.0), "rda", 8),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args()
    t0 = time.time()
    steps = args.steps
    ids = [f"{r}:{i}" for r in ("us-east", "eu-west") for i in range(2)]
    setup = C.make_setup(model_kwargs={}, num_learners=4, batch_size=8, total_steps=steps, seed=0)
    uniform = inprocess.Fleet([1.0] * 4, step_time_s=1.0, latency_s=0.05,
                              bandwidth_bytes_per_s=1e9 / 8, seed=0)
    dp = C.run_dp(setup, learner_ids=ids, fleet=uniform, steps=steps,
                  checkpoint_every_steps=10 ** 9)
    dp_loss = dp.evals[-1][2]
    rows = [{"run": "data-parallel", "eval_loss": dp_loss, "gap": 0.0}]
    for name, kind, kwargs, rule, h in CONFIGS:
        rec = C.run_ours(setup, learner_ids=ids, fleet=uniform, num_fragments=min(12, h),
                         sync_every_steps=h, steps=steps, outer_kind=kind, outer_kwargs=kwargs,
                         merge_rule=rule)
        loss = rec.evals[-1][2]
        rows.append({"run": name, "eval_loss": loss, "gap": (loss - dp_loss) / dp_loss})
        print(f"{name}: {loss:.4f} ({rows[-1]['gap']:+.1%})", flush=True)
    print(C.table(rows, ["run", "eval_loss", "gap"]))
    print(json.dumps({"benchmark": "outer_sweep", "steps_per_learner": steps, "rows": rows,
                      "command": " ".join(["python"] + sys.argv), "machine": C.machine(),
                      "elapsed_s": round(time.time() - t0, 1)}))


if __name__ == "__main__":
    main()
