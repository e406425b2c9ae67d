"""Self-distillation policy optimisation under TRL 1.16's experimental names (`SDPOTrainer`,
`SDPOConfig`; Hubotter et al. 2026, "Reinforcement Learning via Self-Distillation").

Each rollout is GRPO's: completions, reward functions, group advantages. Then each completion gets a
teacher's prompt (TRL's rule):
- its demonstration: in its group (the prompt's num_generations completions), the first other
  completion (or, with `dont_reprompt_on_self_success: false`, the first one, itself included) whose
  total reward (weighted by `reward_weights`, NaN as 0) reaches `success_reward_threshold`, decoded
  without special tokens (`<think>` blocks cut with `remove_thinking_from_demonstration`) and shown
  by `solution_template`; none with `use_successful_as_teacher: false`;
- its feedback, with `include_environment_feedback`: the row's `privileged_context`, a non-empty
  string, shown by `feedback_template` (only where no demonstration was found, with
  `environment_feedback_only_without_solution`);
- with either, `reprompt_template` filled with the prompt's text, the solution and the feedback (a
  chat prompt's last user message rewritten), cut to its last `max_reprompt_len` tokens; with
  neither, the row keeps its own prompt and is left out of the self-distillation loss
  (`Rollout.teacher_rows`).
The teacher is the student (`teacher_model_kind`, ema by default: rlft/train/update/self_teacher.py);
the loss is SDPOObjective's (rlft/train/update/self_distill_objective.py).
"""

from __future__ import annotations

import re

import torch

from rlft.config import SDPOConfig
from rlft.data.prompts import left_pad
from rlft.errors import ConfigError
from rlft.train.grpo import GRPOTrainer, default_output_dir
from rlft.train.sdft import CONTEXT, SelfTeacherSource, rewritten, teacher_inputs
from rlft.train.update.rollout_batch import ScoredRollout
from rlft.train.update.self_distill_objective import SDPOObjective


def demonstrations(totals: torch.Tensor, group: int, threshold: float, self_excluded: bool) -> list:
    """Each row's demonstration row (None: no sibling succeeded), groups of `group` consecutive rows."""
    out = []
    for i in range(len(totals)):
        start = i - i % group
        found = [j for j in range(start, start + group)
                 if not (self_excluded and j == i) and float(totals[j]) >= threshold]
        out.append(found[0] if found else None)
    return out


class SDPOSource(SelfTeacherSource):
    """GRPO's rollouts, each row with its teacher's prompt (module docstring)."""

    trainer = "SDPOTrainer"

    def __init__(self, parts):
        super().__init__(parts)
        self.weights, self.messages = parts.reward_weights, parts.messages
        self.quiet: dict[str, int] = {}  # diagnostic -> rollouts in a row it held (_watch)
        self.feedback: list | None = None  # per row, the privileged_context of the last rollout's prompts

    def rollout(self, index: int) -> ScoredRollout:
        return self.round(index, 0)

    def round(self, index: int, round_index: int) -> ScoredRollout:
        scored = self.generated.round(index, round_index)
        feedback = self.schedule.batch(index, round_index).get(CONTEXT)
        self.generation_prompts = scored.prompts
        self.feedback = None if feedback is None else [f for f in feedback for _ in range(self.group)]
        totals = self._totals(scored.rewards)
        shares = self.reprompt(scored.rollout, totals, scored.prompts, self.feedback, self.group)
        shares.update(self._watch(shares, totals))
        scored.scalars.update({key: [value] for key, value in shares.items()})
        return scored

    def generate(self, prompts: dict, count: int, greedy: bool = False):
        """Evaluation's completions; their prompts and feedback are kept for `reprompt` once they are
        scored (`eval_scored`)."""
        self.generation_prompts = [p for p in prompts["prompts"] for _ in range(count)]
        self.feedback = [f for f in prompts[CONTEXT] for _ in range(count)] if CONTEXT in prompts else None
        return self.generated.generate(prompts, count, greedy)

    def eval_scored(self, rollout, rewards: torch.Tensor, group: int) -> None:
        """Evaluation completions once scored: their teacher prompts built from their own rewards in
        groups of num_generations_eval (TRL's), reported to the callbacks; the objective's eval_loss
        then takes both terms on them."""
        self.reprompt(rollout, self._totals(rewards), self.generation_prompts, self.feedback, group)
        ids, mask = teacher_inputs(rollout)
        self.events("on_teacher_context_built", teacher_input_ids=ids, teacher_attention_mask=mask,
                    completion_mask=rollout.completion_mask, self_distillation_mask=rollout.teacher_rows)

    def reprompt(self, rollout, totals: torch.Tensor, prompts: list, feedback: list | None,
                 group: int) -> dict[str, float]:
        """Each row's teacher prompt and whether it adds anything (module docstring), on `rollout`;
        TRL's metrics of how many did."""
        args = self.args
        demos = [None] * len(totals) if not args.use_successful_as_teacher else \
            demonstrations(totals, group, args.success_reward_threshold, args.dont_reprompt_on_self_success)
        said = [isinstance(f, str) and f.strip() != "" for f in feedback or [None] * len(totals)]
        written, taught, used, reprompt = [], [], 0, args.reprompt_template
        for row, prompt in enumerate(prompts):
            use = args.include_environment_feedback and said[row] and not (
                args.environment_feedback_only_without_solution and demos[row] is not None)
            used += use
            if demos[row] is None and not use:
                written.append(prompt)
                taught.append(0.0)
                continue
            solution = "" if demos[row] is None else args.solution_template.format(
                successful_previous_attempt=self._demo(rollout, demos[row]))
            shown = args.feedback_template.format(feedback_raw=feedback[row]) if use else ""
            written.append(rewritten(prompt, row, lambda text, s=solution, f=shown: reprompt.format(
                prompt=text, solution=s, feedback=f)))
            taught.append(1.0)
        ids, mask = left_pad(self.tokenized(written, args.max_reprompt_len, keep_end=True),
                             self.tokenizer.pad_token_id)
        rollout.teacher_prompt_ids, rollout.teacher_prompt_mask = ids.to(self.device), mask.to(self.device)
        rollout.teacher_rows = torch.tensor(taught, device=self.device)
        n, succeeded = len(totals), totals >= args.success_reward_threshold
        groups = [bool(succeeded[s:s + group].any()) for s in range(0, n, group)]
        return {f"self_distillation/{key}": value for key, value in (
            ("success_group_fraction", sum(groups) / len(groups)),
            ("success_sample_fraction", sum(d is not None for d in demos) / n),
            ("feedback_available_fraction", sum(said) / n), ("feedback_used_fraction", used / n),
            ("reprompt_sample_fraction", sum(taught) / n))}

    def _totals(self, rewards: torch.Tensor) -> torch.Tensor:
        """Each row's total reward [N]: the functions' rewards weighted, NaN as 0 (TRL's nansum)."""
        weights = torch.ones(rewards.shape[1]) if self.weights is None else self.weights.cpu()
        return (rewards.float().cpu() * weights).nansum(dim=1)

    def _demo(self, rollout, row: int) -> str:
        tokens = rollout.completion_ids[row][rollout.completion_mask[row].bool()]
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        if self.args.remove_thinking_from_demonstration:
            text = re.sub(r"<think>.*?</think>", "", text, flags=re.DOTALL).strip()
        return text

    def _watch(self, shares: dict[str, float], totals: torch.Tensor) -> dict[str, float]:
        """TRL's diagnostics of a training rollout: its reward statistics, and a warning (at the first
        and every diagnostics_warning_interval-th rollout in a row) while the rewards are flat, nothing
        was reprompted, or no group succeeded."""
        args, tol, g = self.args, self.args.diagnostics_flat_tolerance, self.group
        spread = totals.view(-1, g).std(dim=1) if g > 1 else torch.zeros(len(totals) // g)
        std = float(totals.std()) if len(totals) > 1 else 0.0
        flat = float((spread <= tol).float().mean()) if len(spread) else 1.0
        states = {"flat_rewards": std <= tol and flat >= 1.0 - tol,
                  "inactive_self_distillation": shares["self_distillation/reprompt_sample_fraction"] <= tol,
                  "no_successful_rollouts": shares["self_distillation/success_group_fraction"] <= tol}
        interval = args.diagnostics_warning_interval if args.distillation_weight > 0 else 0
        for key, degenerate in states.items():
            self.quiet[key] = self.quiet.get(key, 0) + 1 if degenerate else 0
            count = self.quiet[key]
            if interval and count and (count == 1 or count % interval == 0):
                self.messages.warn(f"{DIAGNOSTICS[key]} Consecutive degenerate steps: {count}.")
        stats = {"reward_mean": float(totals.mean()), "reward_std": std, "reward_min": float(totals.min()),
                 "reward_max": float(totals.max()), "flat_group_fraction": flat,
                 "group_reward_std_mean": float(spread.mean()) if len(spread) else std}
        return {f"self_distillation/{key}": value for key, value in stats.items()}


# TRL's diagnostic messages (SDPOSource._watch)
DIAGNOSTICS = {
    "flat_rewards":
        "Observed flat SDPO rewards across all sampled generations. Policy advantages will collapse to zero, "
        "and SDPO will not learn. Check reward density, reward shaping, or `success_reward_threshold`.",
    "inactive_self_distillation":
        "SDPO self-distillation is inactive because no reprompted samples were constructed. This "
        "usually means no rollout exceeded `success_reward_threshold` and no usable privileged feedback was "
        "available.",
    "no_successful_rollouts":
        "SDPO did not find any successful rollouts in the current generation groups. If this persists, "
        "reduce task difficulty, adjust reward shaping, or lower `success_reward_threshold`."}


class SDPOTrainer(GRPOTrainer):
    """TRL-compatible SDPO: `SDPOTrainer(model, reward_funcs, args, train_dataset=...).train()`."""

    _tag_names = ["trl", "sdpo", "rlft"]
    _name = "SDPO"
    default_rollout_source = "sdpo"
    objective = SDPOObjective

    def __init__(self, model, reward_funcs=None, args: SDPOConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, reward_processing_classes=None, callbacks=None,
                 optimizers=(None, None), peft_config=None, quantization_config=None):
        args = args or SDPOConfig(output_dir=default_output_dir(model, "SDPO"))
        if not isinstance(args, SDPOConfig):
            raise ConfigError(f"SDPOTrainer takes an SDPOConfig, got {type(args).__name__}")
        if not reward_funcs:
            raise ConfigError("SDPOTrainer needs reward_funcs: SDPO scores rollouts to find the "
                              "successful ones its teacher is shown")
        super().__init__(model, reward_funcs, args, train_dataset, eval_dataset, processing_class,
                         reward_processing_classes, callbacks, optimizers, quantization_config, peft_config)
