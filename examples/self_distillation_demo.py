"""Self-distillation (SDFT) on a CPU: the shipped tiny-adder taught by itself with each problem's answer in
view. The figure and numbers in docs/distillation.md come from:

    python examples/self_distillation_demo.py --out docs/figures/sdft.png

1. The student: the shipped tiny-adder, LoRA r16 on every linear layer; SDFTTrainer with TRL's defaults
   (top-100 logits, alpha 0.5, the `base` teacher: the model under the adapters), 8 problems x 8 sampled
   completions per step; each training row's privileged_context is "The answer is N.".
2. The teacher's own skill: greedy held-out accuracy of the model as loaded when its prompt holds the answer
   (SDFT's teacher prompt), measured once.
3. Every `--eval_every` steps: greedy held-out accuracy of the student on plain prompts (200 problems never
   trained on), and the step's self-distillation loss from the log.

SDFT moves the student toward what the teacher predicts with the context; it helps where that teacher is better
than the student. This run measures what happens with a model that never learnt to read a context.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

from rlft.cli.demo import demo_lora
from rlft.data.addition import rows, split_problems
from rlft.experimental.sdft import SDFTConfig, SDFTTrainer
from rlft.model.loading import shipped_policy_path
from rlft.train.sdft import teacher_prompt

CONTEXT = "The answer is {answer}."
TEMPLATE = "{prompt}\n\n{privileged_context}"


def load_demo():
    """distillation_demo.py's accuracy and held-out callback (one definition for both demos)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("distillation_demo", Path(__file__).with_name(
        "distillation_demo.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def plot(curve, losses, teacher: float, out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    left.plot([s for s, _ in curve], [100 * a for _, a in curve], marker="o", label="student (plain prompt)")
    left.axhline(100 * teacher, color="gray", linestyle="--", label=f"teacher: answer in view ({teacher:.1%})")
    left.set_xlabel("optimiser step")
    left.set_ylabel("held-out greedy accuracy (%)")
    left.set_ylim(0, 100)
    left.legend(loc="upper right")
    right.plot([s for s, _ in losses], [v for _, v in losses])
    right.set_xlabel("optimiser step")
    right.set_ylabel("self_distillation/distillation_loss")
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--eval_every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output_dir", default="runs/sdft-demo")
    parser.add_argument("--out", default=None, help="figure (PNG); its numbers go beside it as JSON")
    args = parser.parse_args()
    started, demo = time.perf_counter(), load_demo()
    train, heldout = split_problems()
    problems = rows(heldout)
    tokenizer = AutoTokenizer.from_pretrained(shipped_policy_path())
    seen = [dict(p, prompt=teacher_prompt(p["prompt"], CONTEXT.format(answer=p["answer"]), TEMPLATE, i))
            for i, p in enumerate(problems)]
    teacher = demo.accuracy(AutoModelForCausalLM.from_pretrained(shipped_policy_path()), tokenizer, seen)
    print(f"the model with the answer in view: held-out accuracy {teacher:.1%}", flush=True)
    held = demo.HeldOut(tokenizer, problems, args.eval_every)
    data = [dict(r, privileged_context=CONTEXT.format(answer=r["answer"])) for r in rows(train)]
    cfg = SDFTConfig(output_dir=args.output_dir, overwrite_output_dir=True, seed=args.seed, max_steps=args.steps,
                     learning_rate=1.5e-3, lr_scheduler_type="cosine", warmup_ratio=0.05,
                     per_device_train_batch_size=64, num_generations=8, max_completion_length=8,
                     teacher_prompt_template=TEMPLATE, logging_steps=1, save_steps=args.steps, report_to="none",
                     gradient_checkpointing=False, disable_tqdm=True)
    trainer = SDFTTrainer(str(shipped_policy_path()), cfg, train_dataset=data, callbacks=[held],
                          peft_config=demo_lora(True))
    trainer.train()
    losses = [(r["step"], r["self_distillation/distillation_loss"]) for r in trainer.state.log_history
              if "self_distillation/distillation_loss" in r]
    wall = time.perf_counter() - started
    print(f"student held-out accuracy {held.curve[0][1]:.1%} -> {held.curve[-1][1]:.1%} in {args.steps} steps; "
          f"distillation loss {losses[0][1]:.4f} -> {losses[-1][1]:.4f}; {wall:.0f} s", flush=True)
    if args.out:
        out = Path(args.out)
        title = ("SDFT: the shipped tiny-adder taught by itself with the answer in view (LoRA r16, top-100, alpha "
                 f"0.5)\npython examples/self_distillation_demo.py --out {args.out}")
        plot(held.curve, losses, teacher, out, title)
        out.with_suffix(".json").write_text(json.dumps(
            {"teacher_accuracy": teacher, "curve": held.curve, "losses": losses, "steps": args.steps,
             "seed": args.seed, "seconds": wall}, indent=1) + "\n")


if __name__ == "__main__":
    main()
