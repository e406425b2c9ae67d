"""Run configuration: `GRPOConfig` and `RewardConfig`, real `transformers.TrainingArguments` subclasses.

Field names, types and defaults are TRL 1.16's (which include TrainingArguments'), so a TRL recipe's
arguments, YAML and `HfArgumentParser` / `TrlParser` code carry over; the model, data and LoRA fields
live where TRL keeps them (`ModelConfig`, `ScriptArguments`: rlft/script_args.py). rlft's own
additions are listed in `RLFT_FIELDS`. Configs validate on construction: an error names the field,
the value and what is allowed. docs/migration.md lists every deliberate difference with its reason.
"""

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property

import torch
from transformers import TrainingArguments

from rlft.config_checks import field_types, normalize_before, to_dict, validate  # noqa: F401 (public names)
from rlft.config_help import FIELD_HELP
from rlft.errors import ConfigError  # noqa: F401 (rlft.config.ConfigError, as before)


@dataclass
class _BaseConfig(TrainingArguments):
    """What both rlft configs change in TrainingArguments (TRL's defaults) and add to it."""

    logging_steps: float = 10
    gradient_checkpointing: bool | None = True
    activation_checkpointing: bool | None = None
    activation_checkpointing_kwargs: dict | str | None = None
    bf16: bool | None = None
    lr_scheduler_kwargs: dict | str | None = None
    model_init_kwargs: dict | str | None = None
    trust_remote_code: bool = False
    disable_dropout: bool = False
    pad_to_multiple_of: int | str | None = "auto"
    # rlft's own (RLFT_FIELDS)
    overwrite_output_dir: bool = False
    warmup_ratio: float = 0.0
    max_nonfinite_steps: int = 3
    chat_template_path: str | None = None
    pad_token: str | None = None
    eos_token: str | None = None

    def __post_init__(self):
        normalize_before(self)
        validate(self)  # rlft's checks first: they name the field where transformers' would not
        # transformers refuses bf16 and tf32 without a GPU; rlft trains bf16 weights on a CPU, notes tf32
        cuda = torch.cuda.is_available()
        bf16, tf32, self.tf32 = self.bf16, self.tf32, self.tf32 if cuda else None
        self.bf16 = bf16 and (cuda or self.use_cpu)
        super().__post_init__()
        self.bf16, self.tf32 = bf16, tf32
        if self.activation_checkpointing is not None:  # transformers < 5.2x has no activation_* mirror
            self.gradient_checkpointing = self.activation_checkpointing
            self.gradient_checkpointing_kwargs = self.activation_checkpointing_kwargs

    @cached_property
    def _setup_devices(self):
        """The process state, built as rlft's Accelerator will use it (a gloo group for several processes on
        a machine without CUDA; the ddp_timeout on CPUs of rlft/launch.py), never resetting a state that a
        trainer in this process already runs on."""
        from accelerate.state import PartialState

        from rlft.launch import partial_state_kwargs

        self.distributed_state = PartialState(**partial_state_kwargs(self))
        device = self.distributed_state.device
        self._n_gpu = 1 if device.type == "cuda" else 0
        return device


@dataclass
class _GRPOFields(_BaseConfig):
    """GRPO run. `per_device_train_batch_size` counts completions, as in TRL."""

    learning_rate: float = 1e-6
    remove_unused_columns: bool | None = False
    # TRL 1.16 GRPOConfig: model, generation
    router_aux_loss_coef: float | None = None
    cast_lm_head_to_fp32: bool = False
    num_generations: int | None = 8
    num_generations_eval: int | None = None
    max_completion_length: int | None = 512
    ds3_gather_for_generation: bool = True
    shuffle_dataset: bool | None = True
    generation_batch_size: int | None = None
    steps_per_generation: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    generation_kwargs: dict | str | None = None
    chat_template_kwargs: dict | str | None = None
    repetition_penalty: float = 1.0
    cache_implementation: str | None = None
    # vLLM
    use_vllm: bool = False
    vllm_mode: str = "colocate"
    vllm_model_impl: str = "vllm"
    vllm_enable_sleep_mode: bool = False
    vllm_structured_outputs_regex: str | None = None
    vllm_server_base_url: str | None = None
    vllm_server_host: str = "0.0.0.0"
    vllm_server_port: int = 8000
    vllm_server_timeout: float = 240.0
    vllm_group_port: int = 51216
    vllm_gpu_memory_utilization: float = 0.3
    vllm_max_model_length: int | None = None
    vllm_tensor_parallel_size: int = 1
    # loss and advantages
    beta: float = 0.0
    num_iterations: int = 1
    epsilon: float = 0.2
    delta: float | None = None
    epsilon_high: float | None = None
    sapo_temperature_neg: float = 1.05
    sapo_temperature_pos: float = 1.0
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    importance_sampling_level: str = "token"
    reward_weights: list[float] | None = None
    multi_objective_aggregation: str = "sum_then_normalize"
    scale_rewards: str = "group"
    advantage_estimator: str = "grpo"
    dynamic_sampling: bool = False
    max_num_gen_batches: int = 10
    loss_type: str = "dapo"
    mask_truncated_completions: bool = False
    sync_ref_model: bool = False
    ref_model_mixup_alpha: float = 0.6
    ref_model_sync_steps: int = 512
    top_entropy_quantile: float = 1.0
    entropy_coef: float = 0.0
    use_adaptive_entropy: bool = False
    entropy_coef_min: float = 0.0
    entropy_coef_max: float = 1.0
    entropy_coef_delta: float = 0.005
    entropy_target: float = 0.2
    max_tool_calling_iterations: int | None = None
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_mode: str = "sequence_mask"
    vllm_importance_sampling_clip_max: float | None = 3.0
    vllm_importance_sampling_clip_min: float | None = None
    off_policy_mask_threshold: float | None = None
    use_bias_correction_kl: bool = True
    # logging
    log_completions: bool = False
    log_multimodal: bool = True
    num_completions_to_print: int | None = None
    log_unique_prompts: bool = False
    log_completions_hub_repo: str | None = None
    use_transformers_continuous_batching: bool = False
    transformers_continuous_batching_config: dict | str | None = None
    use_transformers_paged: bool = False
    vllm_importance_sampling_cap: float | None = None
    # rlft's own (RLFT_FIELDS)
    max_prompt_length: int | None = None
    kl_estimator: str = "k3"
    shared_prompt_prefill: bool = True
    logprob_chunk_size: int | None = None
    token_budget: int | None = None
    allow_nan_rewards: bool = False
    num_completions_to_log: int = 8
    zero_signal_warning_steps: int = 5
    vllm_dtype: str = "auto"
    vllm_enforce_eager: bool | None = None
    vllm_lora_sync: str = "auto"
    vllm_sync_bucket_mb: float = 256.0
    tools: list[str] = field(default_factory=list)
    tool_call_timeout: float = 30.0


@dataclass
class _RewardFields(_BaseConfig):
    """Bradley-Terry reward-model run on chosen/rejected pairs."""

    learning_rate: float = 1e-4
    disable_dropout: bool = True
    dataset_num_proc: int | None = None
    max_length: int | None = 1024
    center_rewards_coefficient: float | None = None
    activation_offloading: bool = False
    # rlft's own (RLFT_FIELDS)
    truncation: str = "keep_start"


@dataclass
class _SFTFields(_BaseConfig):
    """TRL's SFTConfig fields and defaults, so a recipe package that defines SFT and GRPO configs side by side
    (open-r1's `configs.py`) imports and parses. rlft trains no SFT: there is no SFTTrainer."""

    learning_rate: float = 2e-5
    router_aux_loss_coef: float | None = None
    dataset_text_field: str = "text"
    dataset_kwargs: dict | str | None = None
    dataset_num_proc: int | None = None
    max_length: int | None = 1024
    truncation_mode: str = "keep_start"
    shuffle_dataset: bool = False
    packing: bool = False
    packing_strategy: str = "bfd"
    padding_free: bool = False
    eval_packing: bool | None = None
    completion_only_loss: bool | None = None
    assistant_only_loss: bool = False
    loss_type: str = "nll"
    activation_offloading: bool = False


@dataclass
class _RLOOFields(_GRPOFields):
    """RLOO run (TRL 1.16's RLOOConfig): GRPO's machinery with the leave-one-out baseline, the KL penalty in
    the reward (beta * sum of per-token log-ratios old/reference), a sequence-level PPO clip, and TRL's
    defaults."""

    num_generations: int | None = 2
    beta: float = 0.05
    normalize_advantages: bool = False
    reward_clip_range: list[float] | None = None  # (min, max); a list so `--reward_clip_range -1 1` parses
    advantage_estimator: str = "rloo"
    loss_type: str = "rloo"
    # TRL's RLOOTrainer asks vLLM for no log-probs and corrects nothing; rlft can (set it to true)
    vllm_importance_sampling_correction: bool = False


@dataclass
class _AsyncGRPOFields(_GRPOFields):
    """Async GRPO (TRL 1.16's experimental AsyncGRPOConfig names and defaults, on top of everything GRPOConfig
    has): a producer process generates the rollouts of later steps while the trainer trains; the rollouts of
    step t are sampled from the weights of step t - rollout_lag (reproducible, exactly resumable:
    docs/async.md)."""

    logging_steps: float = 1
    lr_scheduler_type: str = "constant"
    max_completion_length: int | None = 2048
    max_staleness: int = 4
    weight_sync_steps: int = 1
    max_inflight_tasks: int = -1
    queue_maxsize: int = 1024
    heartbeat_stale_after_s: float = 300.0
    request_timeout: int = 600
    weight_sync_timeout: int = 1800
    fork_threshold_tokens: int = 1024
    # a stale rollout's tokens are weighed by pi_trainer / pi_sampler per token, truncated (decoupled PPO)
    vllm_importance_sampling_mode: str = "token_truncate"
    # rlft's own (RLFT_FIELDS)
    rollout_lag: int = 1
    producer_cpus: list[int] | None = None
    producer_threads: int | None = None
    producer_restarts: int = 0


def _with_help(cls: type, name: str) -> type:
    """The class under its public name, with rlft's one-line help on every field it declares (argparse
    shows it; transformers' fields keep transformers' help)."""
    public = dataclass(type(name, (cls,), {"__doc__": cls.__doc__, "__module__": __name__}))
    for f in dataclasses.fields(public):
        if f.name in FIELD_HELP and not f.metadata.get("help"):
            f.metadata = {**f.metadata, "help": FIELD_HELP[f.name].replace("%", "%%")}
    return public


GRPOConfig = _with_help(_GRPOFields, "GRPOConfig")
RewardConfig = _with_help(_RewardFields, "RewardConfig")
SFTConfig = _with_help(_SFTFields, "SFTConfig")
RLOOConfig = _with_help(_RLOOFields, "RLOOConfig")
AsyncGRPOConfig = _with_help(_AsyncGRPOFields, "AsyncGRPOConfig")
TrainConfig = _BaseConfig

# rlft's additions to TRL's fields (docs/migration.md says why each exists).
RLFT_FIELDS = frozenset(
    {
        "overwrite_output_dir",
        "warmup_ratio",
        "max_nonfinite_steps",
        "chat_template_path",
        "pad_token",
        "eos_token",
        "max_prompt_length",
        "kl_estimator",
        "shared_prompt_prefill",
        "logprob_chunk_size",
        "allow_nan_rewards",
        "num_completions_to_log",
        "zero_signal_warning_steps",
        "vllm_dtype",
        "vllm_enforce_eager",
        "vllm_lora_sync",
        "vllm_sync_bucket_mb",
        "tools",
        "tool_call_timeout",
        "truncation",
        "token_budget",
        "advantage_estimator",
        "dynamic_sampling",
        "max_num_gen_batches",
        "rollout_lag",
        "producer_cpus",
        "producer_threads",
        "producer_restarts",
    }
)
