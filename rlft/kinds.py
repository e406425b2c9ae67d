"""The trainer kinds, one row each: its command, config, trainer, script arguments, help and TRL's
module paths.

Everything that names a kind reads it from here: `rlft.__all__` and its lazy imports
(rlft/__init__.py), `rlft <kind>` and its help (rlft/cli/commands.py), the recipe builder
(rlft/cli/recipes.py) and TRL's module paths (`rlft.trainer.grpo_trainer`,
`rlft.experimental.async_grpo`, ...: rlft/paths.py). A new kind is its own module(s) and one row.
Rows hold "module:name" strings, so reading them imports nothing: `rlft --help` lists the commands
without loading torch.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field


def load(target: str):
    """The object a "module:name" string names (imported on first use)."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class Kind:
    name: str  # `rlft <name>` (TRL's `trl <name>`)
    config: str  # "module:Class" of its config (a TrainingArguments subclass)
    trainer: str  # "module:Class" of its trainer
    summary: str  # its line in `rlft --help`
    help: str  # the description `rlft <name> --help` prints
    script_args: str = "rlft.cli.recipes:GRPOScriptArguments"  # the command's script arguments
    # "module:function" building the trainer from a recipe's argument groups (rlft/cli/recipes.py:
    # build_trainer);
    # empty: the trainer from the model and the common arguments alone
    recipe: str = "rlft.cli.recipes:with_rewards"
    command: bool = True  # `rlft <name>` runs it
    trl_paths: tuple[str, ...] = ()  # TRL's modules (after "trl.") holding its config and trainer
    # TRL's deprecated aliases: a FutureWarning on use, as TRL's
    deprecated_paths: tuple[str, ...] = ()
    # more names on those paths: "module:name"
    extra_names: dict[str, str] = field(default_factory=dict)

    @property
    def config_name(self) -> str:
        return self.config.partition(":")[2]

    @property
    def trainer_name(self) -> str:
        return self.trainer.partition(":")[2]

    def names(self) -> dict[str, str]:
        """name -> "module:name" of everything its TRL paths hold."""
        return {self.config_name: self.config, self.trainer_name: self.trainer, **self.extra_names}


_FIELDS = ("Fields of every group below can be in the --config YAML or given here (options win "
           "over the YAML)")

# TRL's self-distillation loss helpers (`trl.experimental.sdft.loss_utils`, sdpo's the same)
_LOSS_UTILS = {name: f"rlft.core.self_distill:{name}" for name in (
    "add_tail_bucket", "apply_importance_sampling_clipping", "compute_divergence",
    "compute_full_logit_self_distillation_loss", "compute_sampled_token_self_distillation_loss",
    "compute_topk_self_distillation_loss")}

KINDS: dict[str, Kind] = {kind.name: kind for kind in (
    Kind("grpo", "rlft.config:GRPOConfig", "rlft.train.grpo:GRPOTrainer", "GRPO training",
         f"GRPO training. {_FIELDS}; TRL's `trl grpo` arguments are accepted; examples/configs/ "
         "holds runnable configs.",
         trl_paths=("trainer.grpo_trainer", "trainer.grpo_config")),
    Kind("rloo", "rlft.config:RLOOConfig", "rlft.train.rloo:RLOOTrainer", "RLOO training (TRL's RLOOTrainer)",
         "RLOO training (TRL's RLOOTrainer: leave-one-out baseline, KL in the reward). "
         f"{_FIELDS}; TRL's `trl rloo` arguments are accepted.",
         trl_paths=("trainer.rloo_trainer", "trainer.rloo_config")),
    Kind("reward", "rlft.config:RewardConfig", "rlft.train.reward:RewardTrainer",
         "Bradley-Terry reward-model training",
         f"Bradley-Terry reward-model training. {_FIELDS}; TRL's `trl reward` arguments are "
         "accepted.",
         script_args="rlft.cli.recipes:RewardScriptArguments", recipe="",
         trl_paths=("trainer.reward_trainer", "trainer.reward_config"),
         extra_names={"DataCollatorForPreference": "rlft.data.preference_pairs:DataCollatorForPreference"}),
    Kind("distillation", "rlft.config:DistillationConfig", "rlft.train.distillation:DistillationTrainer",
         "On-policy distillation (TRL's DistillationTrainer)",
         "On-policy distillation (TRL's DistillationTrainer: the student samples, the teacher "
         f"scores every token, generalized JSD at beta). {_FIELDS}; TRL's `trl distillation` "
         "arguments are accepted; teacher_model_name_or_path names the teacher.",
         script_args="rlft.cli.recipes:RewardScriptArguments", recipe="rlft.cli.recipes:with_teacher",
         trl_paths=("trainer.distillation_trainer", "trainer.distillation_config"),
         deprecated_paths=("experimental.distillation",)),
    Kind("gkd", "rlft.config:GKDConfig", "rlft.train.gkd:GKDTrainer",
         "Generalized knowledge distillation (TRL's experimental GKDTrainer)",
         "GKD: each step on the student's own completions with probability lmbda, else on the "
         f"dataset's (or the teacher's: seq_kd); the generalized JSD at beta. {_FIELDS}; "
         "`messages` datasets as TRL's.",
         script_args="rlft.cli.recipes:RewardScriptArguments", recipe="rlft.cli.recipes:with_teacher",
         trl_paths=("experimental.gkd", "experimental.gkd.gkd_config", "experimental.gkd.gkd_trainer")),
    Kind("gold", "rlft.config:GOLDConfig", "rlft.train.gkd:GOLDTrainer",
         "GOLD with a same-tokenizer teacher (TRL's experimental GOLDTrainer)",
         "GOLD: GKD's rollouts and divergence at the sampling temperature, TRL's GOLDConfig fields.",
         command=False, trl_paths=("experimental.gold", "experimental.gold.gold_config",
                                   "experimental.gold.gold_trainer")),
    Kind("sdft", "rlft.config:SDFTConfig", "rlft.train.sdft:SDFTTrainer",
         "Self-distillation fine-tuning (TRL's experimental SDFTTrainer)",
         "SDFT: the student samples, and learns to predict without each row's privileged_context what "
         f"it predicts with it (the teacher is the student: teacher_model_kind). {_FIELDS}; "
         "datasets have 'prompt' and 'privileged_context' columns.",
         script_args="rlft.cli.recipes:RewardScriptArguments", recipe="",
         trl_paths=("experimental.sdft", "experimental.sdft.sdft_config", "experimental.sdft.sdft_trainer",
                    "experimental.sdft.loss_utils"),
         extra_names=_LOSS_UTILS),
    Kind("sdpo", "rlft.config:SDPOConfig", "rlft.train.sdpo:SDPOTrainer",
         "Self-distillation policy optimisation (TRL's experimental SDPOTrainer)",
         "SDPO: GRPO whose student also learns from itself shown a successful sibling's completion. "
         f"{_FIELDS}; TRL's reward_funcs are required.",
         trl_paths=("experimental.sdpo", "experimental.sdpo.sdpo_config", "experimental.sdpo.sdpo_trainer",
                    "experimental.sdpo.loss_utils"),
         extra_names=_LOSS_UTILS),
    Kind("server_distillation", "rlft.config:ServerDistillationConfig",
         "rlft.train.distillation:ServerDistillationTrainer",
         "Distillation from a served teacher (TRL's experimental ServerDistillationTrainer)",
         "On-policy distillation from a teacher behind teacher_model_server_url (its top-k "
         "log-probs).",
         command=False, trl_paths=("experimental.server_distillation",)),
    Kind("async_distillation", "rlft.config:AsyncDistillationConfig",
         "rlft.train.distillation:AsyncDistillationTrainer",
         "Async distillation (TRL's experimental AsyncDistillationTrainer)",
         "Async on-policy distillation: the producer samples while the trainer trains; served teachers.",
         command=False, trl_paths=("experimental.async_distillation",
                                   "experimental.async_distillation.async_distillation_config",
                                   "experimental.async_distillation.async_distillation_trainer")),
    Kind("async_grpo", "rlft.config:AsyncGRPOConfig", "rlft.train.async_grpo:AsyncGRPOTrainer",
         "Async GRPO (TRL's experimental AsyncGRPOTrainer)",
         "Async GRPO: a producer process samples later steps' rollouts while the trainer trains.",
         command=False, trl_paths=("experimental.async_grpo", "experimental.async_grpo.async_rollout_worker",
                                   "experimental.async_grpo.async_grpo_trainer"),
         extra_names={name: f"rlft.train.sources.worker_source:{name}" for name in (
             "RolloutSample", "RolloutWorkerProtocol", "WeightTransferProtocol")}),
)}


def command_kinds() -> tuple[str, ...]:
    """The kinds `rlft <kind>` trains."""
    return tuple(name for name, kind in KINDS.items() if kind.command)
