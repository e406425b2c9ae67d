"""The fields a self-distilling config shares (SDFTConfig: rlft/config/distill_configs.py; SDPOConfig
here): the objective against the student's own teacher (rlft/core/self_distill.py) and that teacher
(rlft/train/update/self_teacher.py), each declared once with TRL 1.16's help and checked by
`check_self_distillation`; a config gives its own TRL defaults.
"""

import string
from typing import ClassVar

from rlft.config.common import config_class
from rlft.config.grpo_fields import _GRPOFields
from rlft.config.options import POSITIVE, between, one_of, option
from rlft.core.self_distill import MODES


def alpha(default: float):
    return option(default, check=between(0, 1, note=": 0 is the forward KL, 1 the reverse KL"),
                  help="self-distillation: the divergence's mix (0 forward KL(teacher || student), 1 "
                       "reverse KL, in between the generalized Jensen-Shannon divergence)")


def mode(default: str):
    return option(default, check=one_of(MODES),
                  help="self-distillation: 'topk_logits' (the divergence on the student's top "
                       "distillation_topk tokens), 'full_logits' (over the vocabulary) or "
                       "'sampled_token' (the sampled token's reverse KL estimate; distillation_alpha 1)")


def topk(default: int | None):
    return option(default, "self-distillation: the student's top tokens of topk_logits")


def is_clip():
    return option(2.0, help="self-distillation: the cap of the importance weight of tokens sampled by "
                            "older weights (None: no weight)")


def add_tail():
    return option(False, "self-distillation topk_logits: one more bucket for the mass outside the top "
                         "tokens (else both are renormalised over them)")


def teacher_kind(default: str):
    return option(default, check=one_of(("base", "live", "ema")),
                  help="the self-teacher is the student as loaded ('base'), as it is now ('live') or "
                       "its moving average ('ema')")


def update_rate():
    return option(0.05, check=between(0, 1),
                  help="ema self-teacher: r in theta_t <- (1 - r) theta_t + r theta_s")


def sync_steps():
    return option(1, check=POSITIVE, help="ema self-teacher: optimiser steps between its updates")


def teacher_server():
    return option(False, refused="the self-teacher runs in the trainer's process; a live teacher "
                                 "scored by the vLLM generation server is not built "
                                 "(docs/migration.md)")


def template_fields(template: str) -> set[str] | None:
    """The fields a str.format template names (None: it does not parse, e.g. an unmatched brace)."""
    try:
        return {name for _, name, _, _ in string.Formatter().parse(template) if name}
    except ValueError:
        return None


def check_template(cfg, name: str, allowed: set[str], errors: list[str]) -> None:
    named = template_fields(getattr(cfg, name))
    if named is None or named - allowed:
        fields = ", ".join("{" + f + "}" for f in sorted(allowed))
        errors.append(f"{name}={getattr(cfg, name)!r} may hold only {fields}; write a literal brace as "
                      "{{ or }}")


def check_self_distillation(cfg, errors: list[str]) -> None:
    """The objective's settings that only hold together."""
    if cfg.distillation_mode == "sampled_token" and cfg.distillation_alpha != 1.0:
        errors.append("distillation_mode='sampled_token' estimates the reverse KL only: set "
                      f"distillation_alpha: 1.0 (got {cfg.distillation_alpha})")
    if cfg.distillation_mode == "topk_logits" and (cfg.distillation_topk or 0) < 1:
        errors.append("distillation_mode='topk_logits' needs distillation_topk >= 1, got "
                      f"{cfg.distillation_topk!r}")
    if cfg.distillation_is_clip is not None and cfg.distillation_is_clip <= 0:
        errors.append(f"distillation_is_clip={cfg.distillation_is_clip!r} must be > 0, or None for no "
                      "importance weight")


@config_class
class SDPOConfig(_GRPOFields):
    """Self-distillation policy optimisation (TRL 1.16's experimental SDPOConfig names and defaults;
    Hubotter et al. 2026, "Reinforcement Learning via Self-Distillation"): GRPO's rollouts, rewards
    and policy loss, and the student's own teacher reading each completion after the prompt with a
    successful sibling's completion (and, optionally, the row's feedback) in it; the loss is
    (1 - distillation_weight) x the policy loss + distillation_weight x the self-distillation loss.
    rlft/train/sdpo.py."""

    learning_rate: float = option(5e-5, "peak learning rate (TRL's SDPO default)")
    disable_dropout: bool = True
    max_completion_length: int | None = 256
    max_prompt_length: int | None = 512
    distillation_weight: float = option(
        1.0, check=between(0, 1),
        help="SDPO: the loss is (1 - w) x the policy loss + w x the self-distillation loss")
    distillation_alpha: float = alpha(1.0)
    distillation_mode: str = mode("sampled_token")
    distillation_topk: int | None = topk(None)
    distillation_is_clip: float | None = is_clip()
    distillation_add_tail: bool = add_tail()
    teacher_model_kind: str = teacher_kind("ema")
    teacher_update_rate: float = update_rate()
    teacher_sync_steps: int = sync_steps()
    use_teacher_server: bool = teacher_server()
    use_successful_as_teacher: bool = option(
        True, "SDPO: a successful sibling's completion goes into the teacher's prompt")
    success_reward_threshold: float = option(
        1.0, "SDPO: the least total reward of a successful completion")
    dont_reprompt_on_self_success: bool = option(
        True, "SDPO: a completion's own success is not its demonstration (a sibling's must be)")
    max_reprompt_len: int = option(
        10240, check=POSITIVE, help="SDPO: the teacher's prompt keeps its last this many tokens")
    reprompt_template: str = option(
        "{prompt}{solution}{feedback}\n\nCorrectly solve the original question.\n",
        help="SDPO: the teacher's prompt from the prompt's text, the solution and the feedback")
    solution_template: str = option(
        "\nCorrect solution:\n\n{successful_previous_attempt}\n\n",
        help="SDPO: how a successful sibling's completion is shown")
    feedback_template: str = option(
        "\nThe following is feedback from your unsuccessful earlier attempt:\n\n{feedback_raw}\n\n",
        help="SDPO: how the row's privileged_context (environment feedback) is shown")
    include_environment_feedback: bool = option(
        False, "SDPO: the row's privileged_context goes into the teacher's prompt as feedback")
    environment_feedback_only_without_solution: bool = option(
        False, "SDPO: feedback only where no sibling succeeded")
    remove_thinking_from_demonstration: bool = option(
        False, "SDPO: <think>...</think> blocks are cut from the demonstration")
    diagnostics_warning_interval: int = option(
        10, help="SDPO: warn after this many rollouts in a row with no reprompted row (0: never)")
    diagnostics_flat_tolerance: float = option(
        1e-8, "SDPO: a reprompted-row share at or below this counts as none")
    # (TRL's SDPO takes one completion per prompt: its feedback still teaches, with no group advantage)
    min_generations: ClassVar[int] = 1

    def _check(self, errors: list[str]) -> None:
        super()._check(errors)
        check_self_distillation(self, errors)
        check_template(self, "reprompt_template", {"prompt", "solution", "feedback"}, errors)
        check_template(self, "solution_template", {"successful_previous_attempt"}, errors)
        check_template(self, "feedback_template", {"feedback_raw"}, errors)
        if self.entropy_coef != 0.0 or self.use_adaptive_entropy:
            errors.append("entropy_coef / use_adaptive_entropy: an entropy bonus is not combined with "
                          "SDPO's self-distillation term here; leave them off")
