"""`rlft demo`: GRPO with LoRA on the shipped warm-started addition policy, on a CPU, in minutes.

Held-out problems are never trained on; held-out greedy accuracy is measured before
training, every `eval_every` steps, and after. Two rewards: correctness (the answer in
`<answer>` tags equals a+b) and format (the whole completion is `<answer>...</answer>`).

`rlft demo --task calculator`: the same problems with an `add` tool the policy calls (multi-turn
rollouts, docs/agents.md), on the shipped tiny-calculator policy; rewards: the final answer is
right, and the tool was called and worked.
"""

from __future__ import annotations

import time

from rlft.config import GRPOConfig
from rlft.data.addition import rows, split_problems
from rlft.model.loading import shipped_policy_path

DEMO_STEPS = 1000
HELDOUT_KEY = "eval_rewards/exact_match_reward/mean"
EVAL_EVERY = 100
CALCULATOR_STEPS, CALCULATOR_EVAL_EVERY = 300, 50
CALCULATOR_KEY = "eval_rewards/answer_reward/mean"


def demo_config(output_dir: str, steps: int, lora: bool, seed: int, use_vllm: bool = False,
                config_class=GRPOConfig, **extra) -> GRPOConfig:
    """The demo's hyperparameters, in one place (docs/quickstart.md quotes them). The learning rate
    warms up over the first 5% of `steps` to its peak (1.5e-3 LoRA, 6e-5 full fine-tuning) and
    decays to 0 along a cosine by the last step, so a run of any length ends converged instead of on
    a noisy plateau; `config_class` and `extra`: the same run as an AsyncGRPOConfig
    (benchmarks/async_grpo.py)."""
    return config_class(
        output_dir=output_dir, overwrite_output_dir=True, seed=seed, max_steps=steps,
        learning_rate=1.5e-3 if lora else 6e-5, lr_scheduler_type="cosine", warmup_ratio=0.05,
        num_generations=8, per_device_train_batch_size=64,
        max_completion_length=8, temperature=0.7, loss_type="dapo", beta=0.0,
        logging_steps=20, logging_first_step=True, eval_strategy="steps", eval_steps=EVAL_EVERY,
        eval_on_start=True, save_steps=steps,
        report_to="none", gradient_checkpointing=False, log_completions=True, use_vllm=use_vllm, **extra,
    )


def demo_lora(lora: bool):
    """LoRA r16 on every linear layer (None: full fine-tuning)."""
    if not lora:
        return None
    from peft import LoraConfig

    return LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear",
                      task_type="CAUSAL_LM")


def calculator_config(output_dir: str, steps: int, lora: bool, seed: int, use_vllm: bool = False,
                      config_class=GRPOConfig, **extra) -> GRPOConfig:
    """The tool demo: completions hold a tool call, its result and the answer (~45 tokens, up to
    64), at the constant learning rate docs/agents.md measured it with (5e-4 LoRA, 3e-5 full), not
    the addition demo's cosine."""
    cfg = demo_config(output_dir, steps, lora, seed, use_vllm, config_class, **extra)
    cfg.learning_rate, cfg.lr_scheduler_type, cfg.warmup_ratio = (5e-4 if lora else 3e-5), "constant", 0.0
    cfg.max_completion_length, cfg.max_tool_calling_iterations, cfg.reward_weights = 64, 2, [1.0, 0.2]
    cfg.eval_steps, cfg.logging_steps = CALCULATOR_EVAL_EVERY, 10
    return cfg


def run_demo(steps: int | None = None, lora: bool = True, seed: int = 0, output_dir: str = "runs/demo",
             use_vllm: bool = False, task: str = "addition") -> int:
    started = time.perf_counter()
    from rlft.rewards.builtins import exact_match_reward, format_reward
    from rlft.telemetry.plots import plot_run
    from rlft.train.grpo import GRPOTrainer

    train, heldout = split_problems()
    if task == "calculator":
        from rlft.data import calculator

        cfg = calculator_config(output_dir, steps or CALCULATOR_STEPS, lora, seed, use_vllm)
        trainer = GRPOTrainer(str(shipped_policy_path("tiny-calculator")),
                              [calculator.answer_reward, calculator.tool_use_reward], cfg,
                              train_dataset=rows(train), eval_dataset=rows(heldout), tools=calculator.TOOLS,
                              peft_config=demo_lora(lora))
        key = CALCULATOR_KEY
    else:
        cfg = demo_config(output_dir, steps or DEMO_STEPS, lora, seed, use_vllm)
        trainer = GRPOTrainer(str(shipped_policy_path()), [exact_match_reward, format_reward], cfg,
                              train_dataset=rows(train), eval_dataset=rows(heldout),
                              peft_config=demo_lora(lora))
        key = HELDOUT_KEY
    trainer.train()
    accuracy = [h[key] for h in trainer.state.log_history if key in h]
    before, after = accuracy[0], accuracy[-1]
    trainer.save_model(output_dir)  # beside its checkpoints, as `rlft grpo` saves
    policy = "tiny-calculator (add tool)" if task == "calculator" else "tiny-adder"
    png = plot_run(output_dir, title=f"rlft demo: GRPO {'LoRA' if lora else 'full'} on {policy}")
    wall = time.perf_counter() - started
    print(
        "\nrlft demo summary\n"
        f"  held-out greedy accuracy: {before:.1%} -> {after:.1%}  "
        f"({len(heldout)} problems never trained on)\n"
        f"  steps: {cfg.max_steps} ({'LoRA r16' if lora else 'full fine-tuning'}, "
        f"{cfg.num_generations} completions x "
        f"{cfg.per_device_train_batch_size // cfg.num_generations} prompts per step, "
        f"{'vLLM' if use_vllm else 'transformers generate'})\n"
        f"  wall time: {wall:.0f} s including start-up\n"
        f"  metrics: {output_dir}/metrics.jsonl  samples: {output_dir}/completions.jsonl\n"
        f"  curves: {png}\n"
        f"  model: {output_dir}"
    )
    return 0
