"""Run configuration: `GRPOConfig`, `RLOOConfig`, `AsyncGRPOConfig`, `RewardConfig` and `SFTConfig`,
real `transformers.TrainingArguments` subclasses.

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
             "bounds rollout_lag + N), each corrected per token (docs/async.md)")
    inflight_switch_tokens: int | None = option(
        None, check=POSITIVE, rlft=True,
        help="async, in-flight weight updates: load newer weights only after this many tokens of a "
             "rollout, waiting there for the trainer's next message, so the same seed gives the "
             "same run (null: whenever weights arrive)")

    def _check(self, errors: list[str]) -> None:
        super()._check(errors)
        check_async(self, errors)


# GRPO fields a distillation run refuses away from these values: they would act on rewards or a
# reference it does not have, or add a term its loss does not take.
GRPO_ONLY = {"teacher_coef": 0.0, "dynamic_sampling": False, "sync_ref_model": False, "entropy_coef": 0.0,
             "use_adaptive_entropy": False, "multi_objective_aggregation": "sum_then_normalize",
             "kl_in_reward": None}


@config_class
class DistillationConfig(_GRPOFields):
    """On-policy distillation (TRL 1.16's DistillationConfig names and defaults, on top of GRPO's
    generation, vLLM, tool and packing fields): the student samples completions, a teacher scores
    every completion token, and the loss is the generalized Jensen-Shannon divergence at `beta`
    (rlft/core/distill.py). No rewards, no reference model: `beta` is the divergence's, not a KL
    coefficient."""

    num_generations: int | None = option(
        1, "distillation: completions per prompt (TRL samples 1; more is allowed)")
    beta: float = option(
        1.0, check=between(0, 1, note=": 0 is the forward KL, 1 the reverse KL, values in between "
                                      "the generalized Jensen-Shannon divergence"),
        help="distillation: 0 forward KL(teacher || student), 1 reverse KL(student || teacher), in "
             "between the generalized Jensen-Shannon divergence")
    teacher_model_name_or_path: str | None = option(
        None, "distillation: the teacher (hub id or folder; the trainer's teacher_model wins)")
    teacher_model_revision: str | None = option(
        None, "distillation: the teacher's revision (branch, tag or commit)")
    teacher_model_init_kwargs: dict | str | None = option(
        None, "distillation: from_pretrained keyword arguments for the teacher (e.g. dtype)")
    teacher_models: dict | str | None = option(
        None, rlft=True,
        help="several teachers: id -> hub id or folder; each row is distilled from the one its "
             "'teacher_id' column names (docs/distillation.md)")
    teacher_server_urls: dict | str | None = option(
        None,
        help="several served teachers (TRL's name): id -> URL of `rlft vllm-serve`; each row's "
             "'teacher_id' column picks one")
    # no group statistics: one completion per prompt is the usual
    min_generations: ClassVar[int] = 1

    @property
    def kl_coef(self) -> float:
        """No KL to a reference: `beta` is the divergence's mix."""
        return 0.0

    @property
    def divergence_temperature(self) -> float:
        """The temperature both distributions are compared at: the sampling one (TRL's
        DistillationTrainer)."""
        return self.temperature

    def _check(self, errors: list[str]) -> None:
        super()._check(errors)
        for name, value in GRPO_ONLY.items():
            if getattr(self, name) != value:
                errors.append(f"{name}={getattr(self, name)!r} is a GRPO setting with no meaning "
                              "in distillation (no reward, no reference, the loss is the "
                              f"divergence itself): leave it at {value!r}")
        for name in ("teacher_models", "teacher_server_urls"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, dict):
                errors.append(f"{name}={value!r} must be a mapping of teacher id -> "
                              + ("hub id or folder" if name == "teacher_models" else "server URL"))
        for key, url in (self.teacher_server_urls or {}).items() if isinstance(self.teacher_server_urls,
                                                                                dict) else ():
            if not str(url).startswith(("http://", "https://")):
                errors.append(f"teacher_server_urls[{key!r}]={url!r} is not an http(s) URL")
        kwargs = self.teacher_model_init_kwargs
        if kwargs is not None and not isinstance(kwargs, dict):
            errors.append(f"teacher_model_init_kwargs={kwargs!r} must be a mapping of "
                          "from_pretrained arguments (or its JSON string), e.g. {\"dtype\": "
                          "\"bfloat16\"}")


@config_class
class GKDConfig(DistillationConfig):
    """Generalized knowledge distillation (TRL 1.16's experimental GKDConfig names and defaults;
    Agarwal et al. 2024, arXiv:2306.13649): each step trains on the student's own completions with
    probability `lmbda`, else on the teacher's (`seq_kd`) or the dataset's; the loss is the
    generalized JSD at `beta`, at temperature 1 (`temperature` is the sampling one).
    rlft/train/gkd.py."""

    learning_rate: float = option(2e-5, "peak learning rate")
    logging_steps: float = 10
    disable_dropout: bool = True
    temperature: float = option(
        0.9,
        help="GKD: sampling temperature of generated completions (the loss compares the two "
             "distributions at temperature 1)")
    beta: float = option(
        0.5,
        help="GKD: 0 forward KL(teacher || student), 1 reverse KL(student || teacher), in between "
             "the generalized Jensen-Shannon divergence")
    lmbda: float = option(
        0.5,
        check=between(0, 1, note=": the probability of a step on the student's own completions"),
        help="GKD: the probability that a step trains on the student's own completions (on-policy) "
             "instead of fixed ones")
    seq_kd: bool = option(
        False,
        help="GKD: the fixed completions are the teacher's own (sequence-level KD) instead of the "
             "dataset's")
    max_new_tokens: int = option(
        128, check=POSITIVE,
        help="GKD: the longest completion in tokens (generated ones stop there, the dataset's are "
             "cut there); sets max_completion_length")

    @property
    def divergence_temperature(self) -> float:
        return 1.0  # TRL's GKD: `temperature` shapes sampling only

    def _normalize(self) -> None:
        super()._normalize()
        self.max_completion_length = self.max_new_tokens

    def _check(self, errors: list[str]) -> None:
        super()._check(errors)
        if self.num_generations != 1:
            errors.append(f"num_generations={self.num_generations!r}: GKD trains one completion "
                          "per prompt (the dataset's and the teacher's are one each); leave it at "
                          "1")
        if self.seq_kd and self.teacher_model_server_url:
            errors.append("seq_kd=True generates with the teacher, which a served teacher "
                          "(teacher_model_server_url) does not do here: load the teacher locally, "
                          "or set seq_kd: false")


@config_class
class ServerDistillationConfig(DistillationConfig):
    """TRL 1.16's experimental ServerDistillationConfig: distillation from a teacher behind a server
    (`rlft vllm-serve`, or TRL's `trl vllm-serve`) at `teacher_model_server_url`, its
    top-`loss_top_k` log-probs per position with TRL's defaults (rlft/rollout/teacher_server.py,
    docs/distillation.md)."""

    vllm_server_port: int = 8001
    loss_top_k: int = option(
        1,
        help="served teacher: the teacher's most likely tokens per position the divergence sees "
             "(plus the sampled one; TRL's default 1)")
    reverse_kl_top_1_mode: str = option(
        "sampled", check=one_of(("sampled", "argmax")),
        help="served teacher, beta > 0: the token whose reverse term is taken: 'sampled' (the "
             "completion's own); TRL's 'argmax' needs the teacher's log-prob of a token the server "
             "did not return, and is refused as TRL refuses it")

    def _check(self, errors: list[str]) -> None:
        super()._check(errors)
        if self.reverse_kl_top_1_mode == "argmax":
            errors.append("reverse_kl_top_1_mode='argmax' is not supported with a served teacher: "
                          "the server cannot provide teacher log-probs for arbitrary "
                          "student-selected tokens (as in TRL); use 'sampled'")
        if not (self.teacher_model_server_url or "").strip():
            errors.append("teacher_model_server_url must be set for ServerDistillationTrainer (the "
                          "teacher's server, e.g. http://127.0.0.1:8001 from `rlft vllm-serve`)")


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
                  ServerDistillationConfig, RewardConfig)
# rlft's additions to TRL's fields (docs/migration.md says why each exists), and the fields a
# resumed run may change: queries of the fields' declarations.
RLFT_FIELDS = frozenset().union(*map(rlft_fields, CONFIG_CLASSES))
MAY_CHANGE = frozenset().union(*map(may_change, CONFIG_CLASSES))
