"""On-policy distillation on a CPU: a GRPO-trained tiny addition policy (the teacher) distilled into the shipped
one (the student), held-out accuracy measured as the student learns. The figures and numbers in
docs/distillation.md come from:

    python examples/distillation_demo.py --out docs/figures/distillation.png
    python examples/distillation_demo.py --trainer gkd --out docs/figures/gkd.png
    python examples/distillation_demo.py --trainer gold --teacher runs/distillation-teacher --out docs/figures/gold.png
    python examples/distillation_demo.py --trainer async --teacher runs/distillation-teacher --out docs/figures/async-distillation.png
    python examples/build_tiny_policy.py --out runs/uld-teacher --seed 1 --vocab-size 512 --no-tag-tokens --stop-at 0.9 --eval-every 50
    python examples/distillation_demo.py --trainer gold --uld hybrid --teacher runs/uld-teacher --out docs/figures/gold-uld.png

With `--trainer gkd`, GKDTrainer instead: each step with probability `--lmbda` on the student's own
completions, else on the dataset's (each problem's correct answer, TRL's `messages` format), the same
divergence to the teacher on either. `--trainer gold`: GOLDTrainer, the same with the divergence at the
sampling temperature; with `--uld plain|hybrid`, a teacher with its own tokenizer (the second-to-last command builds one: the
tiny adder's recipe with another seed and vocabulary size, `<answer>` tags cut by BPE into several tokens,
supervised to 90% accuracy) through the ULD loss. `--trainer async`: AsyncDistillationTrainer, the student's completions sampled by the
async producer one step ahead (producer on core 1, trainer on core 0).

1. The teacher: `rlft demo`'s run (GRPO, LoRA r16, 1,500 steps, seed 0), its adapter merged into the shipped
   tiny-adder (`--teacher DIR` takes one already trained: a model folder, or the demo's output folder).
2. The student: the shipped tiny-adder, LoRA r16 on every linear layer, DistillationTrainer with beta 0.5 (the
   generalized Jensen-Shannon divergence), one sampled completion per prompt at temperature 0.7, 64 prompts
   per step. No reward function is used in training: the teacher's distributions are the only signal.
3. Every `--eval_every` steps: greedy accuracy on the 200 held-out problems (never trained on), for the student;
   once for the teacher.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

from rlft import DistillationConfig, DistillationTrainer
from rlft.cli.demo import demo_lora
from rlft.config import AsyncDistillationConfig, GKDConfig, GOLDConfig
from rlft.data.addition import rows, split_problems
from rlft.model.loading import shipped_policy_path
from rlft.rewards.builtins import exact_match_reward
from rlft.train.distillation import AsyncDistillationTrainer
from rlft.train.gkd import GKDTrainer, GOLDTrainer


@torch.no_grad()
def accuracy(model, tokenizer, problems: list[dict], max_new_tokens: int = 8) -> float:
    """Greedy held-out accuracy: the fraction of problems whose answer is exactly right."""
    was_training = model.training
    model.eval()
    texts = [tokenizer.apply_chat_template(p["prompt"], tokenize=False, add_generation_prompt=True)
             for p in problems]
    tokenizer.padding_side = "left"
    inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    completions = tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    model.train(was_training)
    scores = exact_match_reward(completions, [p["answer"] for p in problems])
    return sum(scores) / len(scores)


def teacher_model(path: str | None):
    """The teacher: a model folder as it is, a LoRA adapter folder merged into the shipped policy, or (None)
    `rlft demo` trained now."""
    if path is None:
        from rlft.cli.demo import run_demo

        path = "runs/distillation-teacher"
        run_demo(output_dir=path)
    folder = Path(path)
    if (folder / "adapter_config.json").exists():
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(shipped_policy_path())
        return PeftModel.from_pretrained(base, folder).merge_and_unload()
    return AutoModelForCausalLM.from_pretrained(folder)


class HeldOut(TrainerCallback):
    """Held-out greedy accuracy every `every` steps (and at step 0)."""

    def __init__(self, tokenizer, problems, every: int):
        self.tokenizer, self.problems, self.every, self.curve = tokenizer, problems, every, []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.curve.append((0, accuracy(model, self.tokenizer, self.problems)))

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.every == 0 or state.global_step == state.max_steps:
            self.curve.append((state.global_step, accuracy(model, self.tokenizer, self.problems)))
            print(f"step {state.global_step}: held-out accuracy {self.curve[-1][1]:.1%}", flush=True)


def tokenizer_facts(student, teacher) -> dict:
    """What docs/distillation.md says of two tokenizers: their sizes, the token strings both hold, and how
    many tokens each spends on one answer (with its EOS)."""
    from rlft.core.uld import matched_vocabulary

    answer = "<answer>126</answer>"
    return {"vocabulary": {"student": len(student), "teacher": len(teacher),
                           "shared_strings": len(matched_vocabulary(student.get_vocab(), teacher.get_vocab())[0])},
            "answer_tokens": {side: len(tok(answer, add_special_tokens=False)["input_ids"]) + 1
                              for side, tok in (("student", student), ("teacher", teacher))}}


def plot(curve, teacher: float, out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8))
    ax.plot([s for s, _ in curve], [100 * a for _, a in curve], marker="o", label="student (distilled)")
    ax.axhline(100 * teacher, color="gray", linestyle="--", label=f"teacher ({teacher:.1%})")
    ax.set_xlabel("optimiser step")
    ax.set_ylabel("held-out greedy accuracy (%)")
    ax.set_ylim(0, 100)
    ax.set_title(title, fontsize=8)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def build(args, teacher, train: list[dict], held: HeldOut):
    """The student's trainer: the same schedule, batch, LoRA and divergence for both trainers."""
    common = dict(output_dir=args.output_dir or f"runs/{args.trainer}-demo", overwrite_output_dir=True,
                  seed=args.seed, max_steps=args.steps, learning_rate=1.5e-3, lr_scheduler_type="cosine",
                  warmup_ratio=0.05, per_device_train_batch_size=64, temperature=0.7, beta=args.beta,
                  logging_steps=25, save_steps=args.steps, report_to="none", gradient_checkpointing=False,
                  disable_tqdm=True)
    student = str(shipped_policy_path())
    if args.trainer in ("gkd", "gold"):
        messages = [{"messages": r["prompt"] + [{"role": "assistant", "content": f"<answer>{r['answer']}</answer>"}]}
                    for r in train]
        if args.trainer == "gold":
            uld = {} if not args.uld else dict(use_uld_loss=True,  # (its own tokenizer: from its folder)
                                               uld_use_hybrid_loss=args.uld == "hybrid")
            cfg = GOLDConfig(**{**common, **uld}, max_completion_length=8, lmbda=args.lmbda)
            return GOLDTrainer(student, args.teacher if args.uld else teacher, cfg, train_dataset=messages,
                               callbacks=[held], peft_config=demo_lora(True))
        cfg = GKDConfig(**common, max_new_tokens=8, lmbda=args.lmbda)
        return GKDTrainer(student, teacher, cfg, train_dataset=messages, callbacks=[held],
                          peft_config=demo_lora(True))
    if args.trainer == "async":
        cfg = AsyncDistillationConfig(**common, max_completion_length=8, producer_cpus=[1], producer_threads=1)
        return AsyncDistillationTrainer(student, cfg, train, callbacks=[held], peft_config=demo_lora(True),
                                        teacher_model=teacher)
    cfg = DistillationConfig(**common, max_completion_length=8)
    return DistillationTrainer(student, teacher, cfg, train, callbacks=[held], peft_config=demo_lora(True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--teacher", default=None, help="a trained teacher (model or adapter folder); default: "
                                                        "run `rlft demo` first")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval_every", type=int, default=25)
    parser.add_argument("--beta", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trainer", choices=["distillation", "gkd", "gold", "async"], default="distillation")
    parser.add_argument("--lmbda", type=float, default=0.5, help="gkd: the share of on-policy steps")
    parser.add_argument("--uld", choices=["plain", "hybrid"], default=None,
                        help="gold: the teacher (--teacher, a folder) has its own tokenizer: the ULD loss, "
                             "plain or hybrid (uld_use_hybrid_loss)")
    parser.add_argument("--output_dir", default=None, help="default runs/<trainer>-demo")
    parser.add_argument("--out", default=None, help="figure (PNG); its numbers go beside it as JSON")
    args = parser.parse_args()
    started = time.perf_counter()
    train, heldout = split_problems()
    problems = rows(heldout)
    tokenizer = AutoTokenizer.from_pretrained(shipped_policy_path())
    teacher = teacher_model(args.teacher)
    teacher_tokenizer = AutoTokenizer.from_pretrained(args.teacher) if args.uld else tokenizer
    # (a teacher with its own tokenizer may take more tokens for the same answer)
    teacher_accuracy = accuracy(teacher, teacher_tokenizer, problems, 16 if args.uld else 8)
    print(f"teacher held-out accuracy {teacher_accuracy:.1%}", flush=True)
    held = HeldOut(tokenizer, problems, args.eval_every)
    trainer = build(args, teacher, rows(train), held)
    trainer.train()
    wall = time.perf_counter() - started
    before, after = held.curve[0][1], held.curve[-1][1]
    print(f"student held-out accuracy {before:.1%} -> {after:.1%} in {args.steps} steps "
          f"(teacher {teacher_accuracy:.1%}); {wall:.0f} s including the teacher's evaluation")
    if args.out:
        out = Path(args.out)
        how = {"gkd": f"GKD, lmbda {args.lmbda}", "gold": f"GOLD{f' ULD {args.uld}' if args.uld else ''}, lmbda {args.lmbda}",
               "async": "async on-policy"}.get(args.trainer, "on-policy")
        flag = f" --trainer {args.trainer}" if args.trainer != "distillation" else ""
        flag += (f" --uld {args.uld}" if args.uld else "") + (f" --teacher {args.teacher}" if args.teacher else "")
        who = "A tiny adder with another tokenizer" if args.uld else "A GRPO-trained tiny-adder"
        mix = "" if args.uld else f", beta {args.beta}"
        title = (f"{who} distilled into the shipped one ({how}{mix}, LoRA r16)"
                 f"\npython examples/distillation_demo.py{flag} --out {args.out}")
        plot(held.curve, teacher_accuracy, out, title)
        out.with_suffix(".json").write_text(json.dumps(
            {"teacher_accuracy": teacher_accuracy, "curve": held.curve, "steps": args.steps, "beta": args.beta,
             "seed": args.seed, "seconds": wall, "trainer": args.trainer,
             **({"lmbda": args.lmbda} if args.trainer in ("gkd", "gold") else {}),
             **({"uld": args.uld, **tokenizer_facts(tokenizer, teacher_tokenizer)} if args.uld else {})},
            indent=1) + "\n")


if __name__ == "__main__":
    main()
