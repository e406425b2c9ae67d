"""SDPO on a CPU: `rlft demo`'s GRPO run on the shipped tiny-adder, with the self-distillation term at several
weights. The figure and numbers in docs/distillation.md come from:

    python examples/sdpo_demo.py --out docs/figures/sdpo.png

Each run is `rlft demo`'s (LoRA r16, 8 problems x 8 completions per step, exact-match and format rewards,
dapo, the cosine schedule) as SDPOTrainer with `distillation_weight` w: w = 0 is GRPO itself; above it, each
completion also learns toward its ema teacher reading the prompt with a successful sibling's completion
(total reward >= 1.5: right answer and format). Held-out greedy accuracy (200 problems never trained on) every
`--eval_every` steps, runs one after another, the same seed; and once, the teacher's own skill: the model as
loaded answering each held-out problem with SDPO's reprompt holding the correct answer as the sibling's.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rlft.cli.demo import demo_config, demo_lora
from rlft.data.addition import rows, split_problems
from rlft.experimental.sdpo import SDPOConfig, SDPOTrainer
from rlft.model.loading import shipped_policy_path
from rlft.rewards.builtins import exact_match_reward, format_reward

KEY = "eval_rewards/exact_match_reward/mean"


def run(weight: float, steps: int, every: int, seed: int, output_dir: str) -> list:
    """One SDPO run's held-out curve: [(step, accuracy), ...]."""
    train, heldout = split_problems()
    cfg = demo_config(f"{output_dir}/w{weight}", steps, True, seed, config_class=SDPOConfig,
                      distillation_weight=weight, success_reward_threshold=1.5)
    cfg.eval_steps, cfg.logging_steps, cfg.disable_tqdm = every, every, True
    trainer = SDPOTrainer(str(shipped_policy_path()), [exact_match_reward, format_reward], cfg,
                          train_dataset=rows(train), eval_dataset=rows(heldout), peft_config=demo_lora(True))
    trainer.train()
    curve = [(h["step"], h[KEY]) for h in trainer.state.log_history if KEY in h]
    print(f"w {weight}: held-out accuracy {curve[0][1]:.1%} -> {curve[-1][1]:.1%}", flush=True)
    return curve


def teacher_accuracy() -> float:
    """Greedy held-out accuracy of the model as loaded when its prompt is SDPO's reprompt with a
    correct sibling completion (`<answer>N</answer>`) shown."""
    import importlib.util

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlft.train.sdft import rewritten

    spec = importlib.util.spec_from_file_location("demo", Path(__file__).with_name("distillation_demo.py"))
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    cfg, problems = SDPOConfig(output_dir="unused"), rows(split_problems()[1])

    def shown(text, answer):
        solution = cfg.solution_template.format(successful_previous_attempt=f"<answer>{answer}</answer>")
        return cfg.reprompt_template.format(prompt=text, solution=solution, feedback="")

    seen = [dict(p, prompt=rewritten(p["prompt"], i, lambda t, a=p["answer"]: shown(t, a)))
            for i, p in enumerate(problems)]
    return demo.accuracy(AutoModelForCausalLM.from_pretrained(shipped_policy_path()),
                         AutoTokenizer.from_pretrained(shipped_policy_path()), seen)


def plot(curves: dict, teacher: float, out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8))
    for weight, curve in curves.items():
        label = "w = 0 (GRPO)" if weight == 0 else f"w = {weight:g}"
        ax.plot([s for s, _ in curve], [100 * a for _, a in curve], marker="o", label=label)
    ax.axhline(100 * teacher, color="gray", linestyle="--", label=f"teacher: a correct sibling in view ({teacher:.1%})")
    ax.set_xlabel("optimiser step")
    ax.set_ylabel("held-out greedy accuracy (%)")
    ax.set_ylim(0, 100)
    ax.set_title(title, fontsize=8)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", type=float, nargs="+", default=[0.0, 0.5, 1.0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eval_every", type=int, default=25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output_dir", default="runs/sdpo-demo")
    parser.add_argument("--out", default=None, help="figure (PNG); its numbers go beside it as JSON")
    args = parser.parse_args()
    started = time.perf_counter()
    teacher = teacher_accuracy()
    print(f"the model with a correct sibling's completion in view: held-out accuracy {teacher:.1%}", flush=True)
    curves = {w: run(w, args.steps, args.eval_every, args.seed, args.output_dir) for w in args.weights}
    wall = time.perf_counter() - started
    print(f"{wall:.0f} s for {len(curves)} runs", flush=True)
    if args.out:
        out = Path(args.out)
        title = ("SDPO on the shipped tiny-adder: rlft demo's GRPO + w x self-distillation (LoRA r16)\n"
                 f"python examples/sdpo_demo.py --out {args.out}")
        plot(curves, teacher, out, title)
        out.with_suffix(".json").write_text(json.dumps(
            {"teacher_accuracy": teacher, "curves": {str(w): c for w, c in curves.items()}, "steps": args.steps,
             "seed": args.seed,
             "seconds": wall}, indent=1) + "\n")


if __name__ == "__main__":
    main()
