"""Run configuration: `GRPOConfig`, `RLOOConfig`, `AsyncGRPOConfig`, `RewardConfig` and `SFTConfig`,
real `transformers.TrainingArguments` subclasses (the distillation family's: rlft/config/distill_configs.py).

Field names, types and defaults are TRL 1.16's (which include TrainingArguments'), so a TRL recipe's
arguments, YAML and `HfArgumentParser` / `TrlParser` code carry over; the model, data and LoRA
fields live where TRL keeps them (`ModelConfig`, `ScriptArguments`: rlft/config/script_args.py).
rlft's own additions are listed in `RLFT_FIELDS`. Each field's help sits beside its default (the
fields every config shares: rlft/config/common.py; GRPO's: rlft/config/grpo_fields.py). Configs
validate on construction, each class checking its own fields (`_check`, chained with super()): an
error names the field, the value and what is allowed. docs/migration.md lists every deliberate
difference with its reason.
"""

from typing import ClassVar

from rlft.config.checks import (  # noqa: F401 (public names)
    check_async,
    check_rloo,
    normalize_before,
    read_dict_value,
    to_dict,
    validate,
)
from rlft.config.common import _BaseConfig, config_class
from rlft.config.distill_configs import (  # noqa: F401 (public names)
    GRPO_ONLY,
    DistillationConfig,
    GKDConfig,
    GOLDConfig,
    SDFTConfig,
    ServerDistillationConfig,
)
from rlft.config.grpo_fields import _GRPOFields
from rlft.config.options import (  # noqa: F401 (field_types: a public name)
    NON_NEGATIVE,
    POSITIVE,
    between,
    field_types,
    may_change,
    one_of,
    option,
    rlft_fields,
)
from rlft.config.rules import GenerationBatch, generation_batch, staleness  # noqa: F401 (public names)
from rlft.config.self_teaching import SDPOConfig  # noqa: F401 (a public name)
from rlft.core.losses import LOSSES
from rlft.errors import ConfigError  # noqa: F401 (rlft.config.ConfigError, as before)

TRUNCATION = ("keep_start", "keep_end", "error")


@config_class
class GRPOConfig(_GRPOFields):
    """GRPO run. `per_device_train_batch_size` counts completions, as in TRL."""


@config_class
class RLOOConfig(_GRPOFields):
    """RLOO run (TRL 1.16's RLOOConfig): GRPO's machinery with the leave-one-out baseline, the KL
    penalty in the reward (beta * sum of per-token log-ratios old/reference), a sequence-level PPO
    clip, and TRL's defaults."""

    # a field given only a new default keeps GRPOConfig's help (config_class copies it)
    num_generations: int | None = 2
    beta: float = 0.05
    normalize_advantages: bool = option(False, "RLOO: whiten the advantages over the batch")
    # (min, max); a list so `--reward_clip_range -1 1` parses
    reward_clip_range: list[float] | None = option(
        None, "RLOO: clip each total reward to [min, max] before the KL penalty")
    advantage_estimator: str = "rloo"
    loss_type: str = "rloo"
    # TRL's RLOOTrainer asks vLLM for no log-probs and corrects nothing; rlft can (set it to true)
    vllm_importance_sampling_correction: bool = False

    def _check(self, errors: list[str]) -> None:
        super()._check(errors)
        check_rloo(self, errors)


@config_class
class AsyncGRPOConfig(_GRPOFields):
    """Async GRPO (TRL 1.16's experimental AsyncGRPOConfig names and defaults, on top of everything
    GRPOConfig has): a producer process generates the rollouts of later steps while the trainer
    trains; the rollouts of step t are sampled from the weights of step t - rollout_lag
    (reproducible, exactly resumable: docs/async.md)."""

    producer_logps: ClassVar[bool] = True  # (rollout_correction_bypass takes them)
    # a field given only a new default keeps GRPOConfig's help (config_class copies it)
    logging_steps: float = 1
    lr_scheduler_type: str = option(
        "constant", "transformers' schedule name: linear, cosine, constant, constant_with_warmup, "
                    "...")
    max_completion_length: int | None = 2048
    max_staleness: int = option(
        4, check=NON_NEGATIVE,
        help="async: the most optimiser steps a rollout's weights may lag behind the trainer's "
             "(rollout_lag x steps per rollout + weight_sync_steps - 1 must not exceed it)")
    weight_sync_steps: int = option(
        1, "async: optimiser steps between weight pushes to the producer", check=POSITIVE)
    max_inflight_tasks: int = option(
        -1, no_effect="rlft's producer runs one rollout request at a time, in the trainer's order")
    queue_maxsize: int = option(
        1024, no_effect="at most rollout_lag + 1 rollouts are ever requested ahead (docs/async.md)")
    heartbeat_stale_after_s: float = option(
        300.0, check=POSITIVE,
        help="async: stop with an error when the producer has not signalled for this long (dead, "
             "stopped, or hung)")
    request_timeout: int = option(
        600, "async: stop with an error when one rollout takes the producer longer than this", check=POSITIVE)
    weight_sync_timeout: int = option(
        1800, no_effect="weights reach the producer as a file it reads, not over NCCL")
    fork_threshold_tokens: int = option(
        1024, no_effect="a multi-turn (tool) completion trains as one row: prompt and every turn, not forked")
    # a stale rollout's tokens are weighed by pi_trainer / pi_sampler per token, truncated
    # (decoupled PPO)
    vllm_importance_sampling_mode: str = "token_truncate"
    # rlft's own (RLFT_FIELDS)
    rollout_lag: int = option(
        1, check=NON_NEGATIVE, rlft=True,
        help="async: the rollouts of step t are sampled from the weights of step t - rollout_lag "
             "(0: synchronous, on the producer; 1: one-step-off-policy)")
    producer_cpus: list[int] | None = option(
        None, "async: CPU cores the producer process runs on (Linux affinity), e.g. [1]", rlft=True)
    producer_threads: int | None = option(
        None, "async: torch threads in the producer process (default: its cores)", check=POSITIVE, rlft=True)
    producer_restarts: int = option(
        0, check=NON_NEGATIVE, resume=True, rlft=True,
        help="async: restart a failed producer from the current weights, at most this many times a "
             "run (0: stop with the error); the run then differs from an uninterrupted one")

    inflight_weight_updates: bool = option(
        False, rlft=True,
        help="async: weights pushed while the producer is sampling a rollout are loaded between two "
             "of its decode steps, so the rest of it samples from them; each token records its "
             "version and behaviour log-prob. Fresher tokens, but when the weights arrive depends "
             "on timing: a seed no longer fixes the run unless inflight_switch_tokens is set "
             "(docs/async.md)")
    partial_rollouts: int = option(
        0, check=NON_NEGATIVE, rlft=True,
        help="async: while the producer samples rollout k it also samples the next N rollouts; its "
             "generate window ends when rollout k is done, and the others' unfinished completions "
             "are carried over and continued in the next window (0: off). A rollout's long tail no "
             "longer sets its step's time; its tokens are up to N rollouts older (max_staleness "
             "bounds rollout_lag + N), each corrected per token; with tools the trainer's tool-loop "
             "driver holds the carried rows (docs/async.md)")
    inflight_switch_tokens: int | None = option(
        None, check=POSITIVE, rlft=True,
        help="async, in-flight weight updates: load newer weights only after this many tokens of a "
             "rollout, waiting there for the trainer's next message, so the same seed gives the "
             "same run (null: whenever weights arrive)")

    def _check(self, errors: list[str]) -> None:
        super()._check(errors)
        check_async(self, errors)


@config_class
class AsyncDistillationConfig(DistillationConfig, AsyncGRPOConfig):
    """TRL 1.16's experimental AsyncDistillationConfig names and defaults: distillation's loss with
    async GRPO's producer (a process sampling later steps' completions while the trainer trains:
    docs/async.md) and teachers behind servers (`teacher_server_urls`, one per `teacher_id`; MOPD);
    `teacher_top_k` and `add_tail_bucket` are the served support's (loss_top_k, loss_add_tail),
    `teacher_temperature` the divergence's. rlft/train/distillation.py."""

    logging_steps: float = 1
    max_completion_length: int | None = 2048
    beta: float = 0.0
    dtype: str | None = option(
        "float32", help="async distillation: the student's dtype where model_init_kwargs names none")
    teacher_temperature: float = option(
        1.0, check=POSITIVE, help="async distillation: the temperature of both sides of the divergence "
                                  "(a served teacher answers at 1)")
    teacher_top_k: int = option(
        8, check=POSITIVE, help="async distillation: the served teacher's most likely tokens per position "
                                "(plus the sampled one) the divergence sees; sets loss_top_k")
    add_tail_bucket: bool = option(
        True, "async distillation: the rest of the vocabulary as one more bucket; sets loss_add_tail")
    log_completions_steps: int = option(
        100, no_effect="completions are logged at every logging step (log_completions)")

    @property
    def divergence_temperature(self) -> float:
        return self.teacher_temperature

    def _normalize(self) -> None:
        super()._normalize()
        self.loss_top_k, self.loss_add_tail = self.teacher_top_k, self.add_tail_bucket
        if self.dtype is not None and "dtype" not in (self.model_init_kwargs or {}) \
                and isinstance(self.model_init_kwargs, dict | None):
            self.model_init_kwargs = {**(self.model_init_kwargs or {}), "dtype": self.dtype}


@config_class
class RewardConfig(_BaseConfig):
    """Bradley-Terry reward-model run on chosen/rejected pairs."""

    learning_rate: float = option(1e-4, "peak learning rate")
    disable_dropout: bool = option(True, "set every dropout probability to 0 (LoRA's included)")
    dataset_num_proc: int | None = option(None, no_effect="rlft tokenizes pairs in the main "
                                                          "process")
    max_length: int | None = option(
        1024, check=POSITIVE,
        help="reward model: longest chosen/rejected sequence in tokens (longer ones truncated)")
    center_rewards_coefficient: float | None = option(
        None, "add coef * (r_chosen + r_rejected)^2 to keep scores centred")
    # rlft's own (RLFT_FIELDS)
    truncation: str = option(
        "keep_start", check=one_of(TRUNCATION), rlft=True,
        help="reward model: keep_start, keep_end, or error when a pair exceeds max_length")
    padding_free: bool | None = option(
        None, resume=True, rlft=True,
        help="score each micro-batch's chosen and rejected sequences packed into one sequence, no "
             "padding (null: where that computes at most half the tokens a padded batch would and, "
             "where attention loops over the sequences (a CPU), they average 32 tokens or more; "
             "true: always; false: never); used once a check shows it exact for the model")
    shared_prefix_scoring: bool = option(
        True, resume=True, rlft=True,
        help="packed pair scoring holds the tokens a pair's two sequences begin with (the prompt) "
             "once, both attending to them (false: each whole)")



@config_class
class SFTConfig(_BaseConfig):
    """TRL's SFTConfig fields and defaults, so a recipe package that defines SFT and GRPO configs
    side by side (open-r1's `configs.py`) imports and parses. rlft trains no SFT: there is no
    SFTTrainer."""

    learning_rate: float = option(2e-5, "peak learning rate")
    router_aux_loss_coef: float | None = option(
        None, "MoE policies: weight of the router load-balancing loss (None: the model's own)")
    dataset_text_field: str = "text"
    dataset_kwargs: dict | str | None = None
    dataset_num_proc: int | None = option(None, "no effect in rlft (pairs are tokenized in the "
                                                "main process)")
    max_length: int | None = option(
        1024, "reward model: longest chosen/rejected sequence in tokens (longer ones truncated)")
    truncation_mode: str = "keep_start"
    shuffle_dataset: bool = option(False, "shuffle prompts each epoch (seeded; resumable)")
    packing: bool = False
    packing_strategy: str = "bfd"
    padding_free: bool = False
    eval_packing: bool | None = None
    completion_only_loss: bool | None = None
    assistant_only_loss: bool = False
    loss_type: str = option("nll", f"{', '.join(LOSSES)} (docs/losses.md)")
    activation_offloading: bool = option(False, "no effect in rlft (activations stay on the "
                                                "device)")


TrainConfig = _BaseConfig

CONFIG_CLASSES = (GRPOConfig, RLOOConfig, AsyncGRPOConfig, DistillationConfig, GKDConfig,
                  ServerDistillationConfig, SDFTConfig, GOLDConfig, SDPOConfig, AsyncDistillationConfig,
                  RewardConfig)
# rlft's additions to TRL's fields (docs/migration.md says why each exists), and the fields a
# resumed run may change: queries of the fields' declarations.
RLFT_FIELDS = frozenset().union(*map(rlft_fields, CONFIG_CLASSES))
MAY_CHANGE = frozenset().union(*map(may_change, CONFIG_CLASSES))
