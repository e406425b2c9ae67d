"""The demo task (rlft/cli/demo.py: LoRA on the shipped tiny-adder, 8 prompts x 8 completions a step) under each
advantage estimator and with DAPO's dynamic sampling: held-out greedy accuracy against steps, the same seed,
steps and every other setting, plus how many groups each run trained on without a reward spread (zero
advantage: no signal) and how many it generated but did not train on (dynamic sampling: the zero-spread
groups it dropped and the spare groups of its last round).

    python benchmarks/estimators.py --steps 400 --plot docs/figures/estimators.png

Prints one JSON line per run and a markdown table (docs/losses.md shows it with the machine it ran on).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

RUNS = {
    "grpo": {},
    "rloo": {"advantage_estimator": "rloo"},
    "reinforce_pp": {"advantage_estimator": "reinforce_pp"},
    "grpo + dynamic sampling": {"dynamic_sampling": True},
}


def run(name: str, overrides: dict, steps: int, eval_every: int, seed: int, folder: str) -> dict:
    from rlft.cli.demo import HELDOUT_KEY, demo_config, demo_lora
    from rlft.data.addition import rows, split_problems
    from rlft.model.loading import shipped_policy_path
    from rlft.rewards.builtins import exact_match_reward, format_reward
    from rlft.train.grpo import GRPOTrainer

    train, heldout = split_problems()
    cfg = demo_config(f"{folder}/{name.replace(' ', '_')}", steps, True, seed)
    cfg.eval_steps, cfg.logging_steps, cfg.log_completions, cfg.disable_tqdm = eval_every, 1, False, True
    for key, value in overrides.items():
        setattr(cfg, key, value)
    started = time.perf_counter()
    trainer = GRPOTrainer(str(shipped_policy_path()), [exact_match_reward, format_reward], cfg,
                          train_dataset=rows(train), eval_dataset=rows(heldout), peft_config=demo_lora(True))
    trainer.train()
    history = trainer.state.log_history
    curve = [(row["step"], row[HELDOUT_KEY]) for row in history if HELDOUT_KEY in row]
    steps_rows = [row for row in history if "frac_reward_zero_std" in row and "loss" in row]
    groups = cfg.per_device_train_batch_size // cfg.num_generations
    zero = sum(row["frac_reward_zero_std"] * groups for row in steps_rows)
    kept = [row.get("dynamic_sampling/kept_fraction") for row in steps_rows]
    dropped = sum(groups / k - groups for k in kept if k) if any(k is not None for k in kept) else 0.0
    return {"run": name, "steps": steps, "curve": curve, "final": curve[-1][1], "best": max(a for _, a in curve),
            "zero_spread_groups_trained": round(zero), "groups_generated_and_dropped": round(dropped),
            "seconds": round(time.perf_counter() - started, 1)}


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for result in results:
        steps, accuracy = zip(*result["curve"])
        ax.plot(steps, [100 * a for a in accuracy], marker="o", markersize=3, label=result["run"])
    ax.set_xlabel("optimiser step")
    ax.set_ylabel("held-out greedy accuracy (%)")
    ax.set_title("demo task (tiny-adder, LoRA) by advantage estimator, seed 0")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--plot", default=None, help="write a PNG of the accuracy curves")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as folder:
        for name in args.runs:
            results.append(run(name, RUNS[name], args.steps, args.eval_every, args.seed, folder))
            print(json.dumps(results[-1]), flush=True)
    print("\n| run | held-out accuracy: start -> end (best) | zero-spread groups trained on | groups generated "
          "but not trained on | seconds |\n| --- | --- | ---: | ---: | ---: |")
    for r in results:
        print(f"| {r['run']} | {r['curve'][0][1]:.1%} -> {r['final']:.1%} ({r['best']:.1%}) | "
              f"{r['zero_spread_groups_trained']} | {r['groups_generated_and_dropped']} | {r['seconds']} |")
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
