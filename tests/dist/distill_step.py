"""One DistillationTrainer optimiser step per beta (and with LoRA, with two teachers; GKD's on the dataset's
and the student's completions; GOLD's ULD with the teacher's own tokenizer; SDFT's and SDPO's with the student as its own teacher), in 1 or N processes (torchrun), on the fixed completions of tests/dist/grpo_step.py's stand-in
generator; writes the trained parameters and the step's metrics to OUT (main process only).

    torchrun --nproc_per_node 2 --standalone tests/dist/distill_step.py STUDENT_DIR TEACHER_DIR OUT [URL]

With URL (a teacher served there: tests/teacher_stub.py), also a step with the served teacher (k = 5).
"""

from __future__ import annotations

import os
import sys

import torch

from rlft import DistillationConfig, DistillationTrainer
from rlft.train.state import release_processes
from tests.dist.grpo_step import FixedGenerator
from tests.helpers import addition_rows

RUNS = {"forward_kl": dict(beta=0.0), "jsd": dict(beta=0.5), "reverse_kl": dict(beta=1.0),
        "micro_batches": dict(beta=1.0),
        "lora": dict(beta=0.5),
        "gkd_dataset": dict(beta=0.5, lmbda=0.0),  # GKD on the dataset's completions
        "gkd_student": dict(beta=0.5, lmbda=1.0),  # and on the student's
        # GOLD's ULD: the teacher reads the completions in its own tokenizer (hybrid, with cross-entropy)
        "gold_uld": dict(lmbda=1.0, use_uld_loss=True, uld_use_hybrid_loss=True, uld_crossentropy_weight=0.1),
        "teachers": dict(beta=0.5),  # two teachers, each row routed by its teacher_id
        "sdft": dict(distillation_topk=5),  # SDFT: the student's own teacher reading the answer, top-5
        "sdpo": dict(distillation_weight=0.5)}  # SDPO: half GRPO, half the student shown its group's successes


def even_length(completions, **kwargs):
    return [float(len(c[-1]["content"]) % 2 == 0) for c in completions]


def make_trainer(name: str, student: str, teacher: str | None, values: dict, peft):
    """The run's trainer: GKD for the gkd_* runs (on messages rows), distillation for the others."""
    common = dict(output_dir=f"{values.pop('out')}-run", optim="sgd", learning_rate=1.0, max_grad_norm=1e9,
                  seed=0, max_steps=1, report_to=["none"], disable_tqdm=True, gradient_checkpointing=False,
                  model_init_kwargs={"dtype": "float64"})  # compared to rounding: tests/helpers.py SAME_STEP
    if name == "sdft":
        from rlft.experimental.sdft import SDFTConfig, SDFTTrainer

        rows = [dict(r, privileged_context=f"The answer is {r['answer']}.") for r in addition_rows(8)]
        return SDFTTrainer(student, SDFTConfig(**common, num_generations=4, max_completion_length=8, **values),
                           train_dataset=rows)
    if name == "sdpo":
        from rlft.experimental.sdpo import SDPOConfig, SDPOTrainer

        cfg = SDPOConfig(**common, num_generations=4, max_completion_length=8, **values)
        return SDPOTrainer(student, even_length, cfg, train_dataset=addition_rows(8))
    if name.startswith(("gkd", "gold")):
        from rlft.experimental.gkd import GKDConfig, GKDTrainer
        from rlft.experimental.gold import GOLDConfig, GOLDTrainer

        rows = [{"messages": r["prompt"] + [{"role": "assistant", "content": f"<answer>{r['answer']}</answer>"}]}
                for r in addition_rows(8)]
        if name.startswith("gold"):
            cfg = GOLDConfig(**common, max_completion_length=8, **values)
            return GOLDTrainer(student, teacher, cfg, train_dataset=rows)
        return GKDTrainer(student, teacher, GKDConfig(**common, max_new_tokens=8, **values), train_dataset=rows)
    cfg = DistillationConfig(**common, max_completion_length=8, **values)
    rows = addition_rows(8)
    if name == "teachers":
        teacher = {"far": teacher, "self": student}
        rows = [{**row, "teacher_id": ("far", "self")[i % 2]} for i, row in enumerate(rows)]
    return DistillationTrainer(student, teacher, cfg, rows, peft_config=peft)


def main() -> None:
    student, teacher, out = sys.argv[1:4]
    runs = dict(RUNS)
    if len(sys.argv) > 4:
        runs["served"] = dict(beta=0.5, teacher_model_server_url=sys.argv[4], loss_top_k=5)
    world, results, trainer = int(os.environ.get("WORLD_SIZE", "1")), {}, None
    for name, fields in runs.items():
        values = dict(per_device_train_batch_size=8 // world, gradient_accumulation_steps=1, **fields)
        if name == "micro_batches":  # 8 rows in 4 micro-batches of 2 over the processes
            values.update(per_device_train_batch_size=2, gradient_accumulation_steps=4 // world)
        peft = None
        if name == "lora":
            from peft import LoraConfig

            peft = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM",
                              init_lora_weights=False)  # B != 0: the step is not at the base model
        trainer = make_trainer(name, student, None if name == "served" else teacher, {**values, "out": out}, peft)
        trainer.generator = FixedGenerator(trainer.tokenizer)
        batch = trainer._make_rollout(0)
        metrics = {}
        for part in range(trainer.steps_per_rollout):
            metrics = trainer.updater.step(batch.part(part, trainer.rows_per_step))
        params = trainer.accelerator.get_state_dict(trainer.model) or {}
        results[name] = {"params": {k: v.detach().clone() for k, v in params.items()},
                         "metrics": {k: v for k, v in metrics.items() if "time" not in k and not k.startswith("perf/")}}
    if trainer.accelerator.is_main_process:
        torch.save(results, out)
    accelerator = trainer.accelerator
    trainer = None
    release_processes(accelerator)


if __name__ == "__main__":
    main()
