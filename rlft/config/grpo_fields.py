"""The GRPO family's fields, with their defaults (TRL 1.16's GRPOConfig) and help: `_GRPOFields`, the base of
GRPOConfig, RLOOConfig and AsyncGRPOConfig (rlft/config/classes.py), which are siblings, as in TRL.

The help of `loss_type` and `advantage_estimator` lists the registries' keys (rlft/core).
"""

from dataclasses import field
from typing import ClassVar

from rlft.config.checks import check_grpo, normalize_grpo
from rlft.config.common import _BaseConfig, config_class
from rlft.core.advantages import ADVANTAGE_ESTIMATORS
from rlft.core.losses import LOSSES


@config_class
class _GRPOFields(_BaseConfig):
    """GRPO run. `per_device_train_batch_size` counts completions, as in TRL."""

    learning_rate: float = field(default=1e-6, metadata={"help": "peak learning rate"})
    remove_unused_columns: bool | None = field(
        default=False, metadata={"help": "no effect: every extra dataset column reaches the reward "
                                         "functions (TRL's False)"})
    # TRL 1.16 GRPOConfig: model, generation
    router_aux_loss_coef: float | None = field(
        default=None, metadata={"help": "MoE policies: weight of the router load-balancing loss (None: the "
                                        "model's own)"})
    cast_lm_head_to_fp32: bool = field(
        default=False, metadata={"help": "keep the LM head in float32 when the model is bfloat16"})
    num_generations: int | None = field(
        default=8, metadata={"help": "completions per prompt (the group size G)"})
    num_generations_eval: int | None = field(
        default=None, metadata={"help": "sampled completions per eval prompt (default: one greedy "
                                        "completion)"})
    max_completion_length: int | None = field(default=512, metadata={"help": "longest completion in tokens"})
    ds3_gather_for_generation: bool = field(
        default=True, metadata={"help": "no effect: under ZeRO-3 rlft gathers each layer in turn while "
                                        "generating"})
    shuffle_dataset: bool | None = field(
        default=True, metadata={"help": "shuffle prompts each epoch (seeded; resumable)"})
    generation_batch_size: int | None = field(
        default=None, metadata={"help": "completions per generation across processes (alternative to "
                                        "steps_per_generation)"})
    steps_per_generation: int | None = field(
        default=None, metadata={"help": "micro-steps fed by one generation batch (default "
                                        "gradient_accumulation_steps)"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature (log-probs use it too)"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling"})
    top_k: int = field(default=0, metadata={"help": "top-k sampling (0 or null: off)"})
    min_p: float | None = field(default=None, metadata={"help": "min-p sampling"})
    generation_kwargs: dict | str | None = field(
        default=None, metadata={"help": "extra generation arguments (generate or vLLM sampling fields)"})
    chat_template_kwargs: dict | str | None = field(
        default=None, metadata={"help": "extra arguments for the chat template (e.g. enable_thinking: "
                                        "false)"})
    repetition_penalty: float = field(default=1.0, metadata={"help": "generation repetition penalty"})
    cache_implementation: str | None = field(
        default=None, metadata={"help": "transformers' KV cache for generate: dynamic (default) or static, "
                                        "..."})
    # vLLM
    use_vllm: bool = field(
        default=False, metadata={"help": "generate with vLLM instead of transformers' generate"})
    vllm_mode: str = field(
        default="colocate", metadata={"help": "colocate (an engine in each training process) or server "
                                              "(rlft vllm-serve)"})
    vllm_model_impl: str = field(
        default="vllm", metadata={"help": "vLLM's model implementation: vllm or transformers"})
    vllm_enable_sleep_mode: bool = field(
        default=False, metadata={"help": "colocate: free the engine's memory while training (a no-op on "
                                         "CPU)"})
    vllm_structured_outputs_regex: str | None = field(
        default=None, metadata={"help": "not supported: guided decoding by a regular expression"})
    vllm_server_base_url: str | None = field(
        default=None, metadata={"help": "server mode: the server's URL (wins over host/port)"})
    vllm_server_host: str = field(
        default="0.0.0.0", metadata={"help": "server mode: host (0.0.0.0 means this machine)"})
    vllm_server_port: int = field(default=8000, metadata={"help": "server mode: port"})
    vllm_server_timeout: float = field(
        default=240.0, metadata={"help": "server mode: seconds to wait for the server and for each request"})
    vllm_group_port: int = field(
        default=51216, metadata={"help": "no effect: rlft's server mode sends weights over HTTP"})
    vllm_gpu_memory_utilization: float = field(
        default=0.3, metadata={"help": "colocate: fraction of GPU memory for the engine"})
    vllm_max_model_length: int | None = field(
        default=None, metadata={"help": "the engine's context (default: max_prompt_length + "
                                        "max_completion_length)"})
    vllm_tensor_parallel_size: int = field(
        default=1, metadata={"help": "tensor parallelism (server mode only, for now)"})
    # loss and advantages
    beta: float = field(
        default=0.0, metadata={"help": "KL coefficient against the reference policy (0: no reference model)"})
    num_iterations: int = field(default=1, metadata={"help": "policy updates per generation batch (mu)"})
    epsilon: float = field(
        default=0.2, metadata={"help": "lower clip range of the ratio (and upper unless epsilon_high)"})
    delta: float | None = field(
        default=None, metadata={"help": "INTELLECT-2 two-sided clipping: cap the ratio at delta (> 1 + "
                                        "epsilon_high) for A < 0"})
    epsilon_high: float | None = field(
        default=None, metadata={"help": "upper clip range (DAPO's clip-higher)"})
    sapo_temperature_neg: float = field(
        default=1.05, metadata={"help": "SAPO gate temperature for negative advantages"})
    sapo_temperature_pos: float = field(
        default=1.0, metadata={"help": "SAPO gate temperature for positive advantages"})
    vespo_k_pos: float = field(
        default=2.0, metadata={"help": "VESPO: power k of the gamma weight for positive advantages"})
    vespo_lambda_pos: float = field(
        default=3.0, metadata={"help": "VESPO: decay lambda of the gamma weight for positive advantages"})
    vespo_k_neg: float = field(
        default=3.0, metadata={"help": "VESPO: power k of the gamma weight for negative advantages"})
    vespo_lambda_neg: float = field(
        default=2.0, metadata={"help": "VESPO: decay lambda of the gamma weight for negative advantages"})
    importance_sampling_level: str = field(
        default="token", metadata={"help": "token or sequence (GSPO) ratios"})
    reward_weights: list[float] | None = field(
        default=None, metadata={"help": "one weight per reward function (default 1 each)"})
    multi_objective_aggregation: str = field(
        default="sum_then_normalize", metadata={"help": "sum_then_normalize or normalize_then_sum (GDPO) "
                                                        "over reward functions"})
    scale_rewards: str = field(
        default="group", metadata={"help": "group, batch, or none: divide advantages by the reward std "
                                           "over that set"})
    advantage_estimator: str = field(
        default="grpo", metadata={"help": f"{', '.join(ADVANTAGE_ESTIMATORS)} (rlft/core/advantages.py)"})
    kl_in_reward: bool | None = field(
        default=None, metadata={"help": "put beta's KL penalty in the sequence reward (clipped to "
                                        "reward_clip_range first) instead of a KL term in the loss (null: "
                                        "the trainer's way: RLOOTrainer the reward, GRPOTrainer the loss)"})
    rollout_source: str | None = field(
        default=None, metadata={"help": "where rollouts come from: generate (each when its step comes), "
                                        "producer (a process sampling ahead), or a registered source "
                                        "(rlft/train/sources/rollout_source.py); null: the trainer's "
                                        "(AsyncGRPOTrainer: producer, else generate)"})
    dynamic_sampling: bool = field(
        default=False, metadata={"help": "DAPO: drop groups whose rewards are all equal and sample more "
                                         "prompts until the batch is full of groups with a learning signal"})
    max_num_gen_batches: int = field(
        default=10, metadata={"help": "dynamic sampling: at most this many generation rounds per rollout "
                                      "(0: no limit); then the batch is filled with zero-spread groups"})
    loss_type: str = field(default="dapo", metadata={"help": f"{', '.join(LOSSES)} (docs/losses.md)"})
    mask_truncated_completions: bool = field(
        default=False, metadata={"help": "exclude completions cut at max_completion_length from the loss"})
    sync_ref_model: bool = field(
        default=False, metadata={"help": "TR-DPO: move the reference toward the policy every "
                                         "ref_model_sync_steps (beta > 0, full)"})
    ref_model_mixup_alpha: float = field(
        default=0.6, metadata={"help": "TR-DPO: ref <- alpha * policy + (1 - alpha) * ref"})
    ref_model_sync_steps: int = field(
        default=512, metadata={"help": "TR-DPO: optimiser steps between reference updates"})
    top_entropy_quantile: float = field(
        default=1.0, metadata={"help": "train only the top-rho entropy tokens of each step (0.2 in the "
                                       "80/20 paper; 1: all)"})
    entropy_coef: float = field(
        default=0.0, metadata={"help": "entropy bonus coefficient (loss -= coef * mean token entropy); "
                                       "adaptive: its start"})
    use_adaptive_entropy: bool = field(
        default=False, metadata={"help": "Skywork-OR1: move entropy_coef by entropy_coef_delta toward "
                                         "entropy_target"})
    entropy_coef_min: float = field(
        default=0.0, metadata={"help": "adaptive entropy: lower bound of the coefficient"})
    entropy_coef_max: float = field(
        default=1.0, metadata={"help": "adaptive entropy: upper bound of the coefficient"})
    entropy_coef_delta: float = field(
        default=0.005, metadata={"help": "adaptive entropy: change of the coefficient per step"})
    entropy_target: float = field(
        default=0.2, metadata={"help": "adaptive entropy: the bonus applies while mean token entropy "
                                       "(nats) <= this"})
    max_tool_calling_iterations: int | None = field(
        default=None, metadata={"help": "rounds of tool results per completion (null: until no call or the "
                                        "budget ends)"})
    vllm_importance_sampling_correction: bool = field(
        default=True, metadata={"help": "weight the policy term by pi_old / pi_sampler"})
    vllm_importance_sampling_mode: str = field(
        default="sequence_mask", metadata={"help": "token_truncate, token_mask, sequence_truncate, "
                                                   "sequence_mask"})
    vllm_importance_sampling_clip_max: float | None = field(
        default=3.0, metadata={"help": "upper bound of the correction weight"})
    vllm_importance_sampling_clip_min: float | None = field(
        default=None, metadata={"help": "lower bound of the correction weight"})
    off_policy_mask_threshold: float | None = field(
        default=None, metadata={"help": "DeepSeek-V3.2: drop A < 0 completions whose sampler/policy KL "
                                        "exceeds this"})
    use_bias_correction_kl: bool = field(
        default=True, metadata={"help": "weight the KL term by the importance ratio (TRL's default)"})
    # logging
    log_completions: bool = field(
        default=False, metadata={"help": "write sampled completions to completions.jsonl at each log step"})
    log_multimodal: bool = field(default=True, metadata={"help": "no effect in rlft (no multimodal inputs)"})
    num_completions_to_print: int | None = field(
        default=None, metadata={"help": "TRL's console table size; rlft writes num_completions_to_log to a "
                                        "file"})
    log_unique_prompts: bool = field(
        default=False, metadata={"help": "no effect in rlft (completions.jsonl keeps every logged row)"})
    log_completions_hub_repo: str | None = field(
        default=None, metadata={"help": "not supported: completions.jsonl in output_dir holds them"})
    use_transformers_continuous_batching: bool = field(
        default=False, metadata={"help": "no effect in rlft (generate or vLLM)"})
    transformers_continuous_batching_config: dict | str | None = field(
        default=None, metadata={"help": "no effect in rlft (generate or vLLM)"})
    use_transformers_paged: bool = field(
        default=False, metadata={"help": "TRL's deprecated name for use_transformers_continuous_batching; "
                                         "no effect"})
    vllm_importance_sampling_cap: float | None = field(
        default=None, metadata={"help": "TRL's deprecated name for vllm_importance_sampling_clip_max"})
    # rlft's own (RLFT_FIELDS)
    teacher_model_name_or_path: str | None = field(
        default=None, metadata={"help": "a teacher (hub id or folder; the trainer's teacher_model wins) "
                                        "whose per-token reverse KL joins the loss, weighted by "
                                        "teacher_coef"})
    teacher_model_revision: str | None = field(
        default=None, metadata={"help": "the teacher's revision (branch, tag or commit)"})
    teacher_model_init_kwargs: dict | str | None = field(
        default=None, metadata={"help": "from_pretrained keyword arguments for the teacher (e.g. dtype)"})
    teacher_coef: float = field(
        default=0.0, metadata={"help": "GRPO with a teacher: the weight of the token-mean reverse KL(policy "
                                       "|| teacher) added to the policy loss (0: no teacher term)"})
    teacher_model_server_url: str | None = field(
        default=None, metadata={"help": "a teacher served by `rlft vllm-serve` (e.g. http://127.0.0.1:8001) "
                                        "instead of a local one: the divergence uses its top-k log-probs "
                                        "(docs/distillation.md); needs temperature 1"})
    loss_top_k: int = field(
        default=20, metadata={"help": "served teacher: the teacher's most likely tokens per position the "
                                      "divergence sees (plus the sampled one); TRL's experimental default "
                                      "is 1 (docs/migration.md)"})
    loss_add_tail: bool = field(
        default=True, metadata={"help": "served teacher: the rest of the vocabulary as one more bucket (a "
                                        "lower bound of the exact divergence); false: renormalise over the "
                                        "top-k"})
    max_prompt_length: int | None = field(
        default=None, metadata={"help": "longest prompt in tokens; a longer one is an error naming its row"})
    kl_estimator: str = field(default="k3", metadata={"help": "k1, k2, or k3 (Schulman's estimators)"})
    shared_prompt_prefill: bool = field(
        default=True, metadata={"help": "dynamic cache: prefill each prompt once for its whole group"})
    logprob_chunk_size: int | None = field(
        default=None, metadata={"help": "positions per tile of the fused LM head (float32 logits of one "
                                        "tile at a time); null: sized to the vocabulary (~16M logits per "
                                        "tile)"})
    token_budget: int | None = field(
        default=None, metadata={"help": "fill micro-batches by prompt + completion tokens (at most this "
                                        "many each; a longer row alone) instead of "
                                        "per_device_train_batch_size rows (null or <= 0: by rows)"})
    padding_free: bool | None = field(
        default=None, metadata={"help": "score each micro-batch packed into one sequence, no padding (null: "
                                        "where that computes at most half the tokens a padded one would "
                                        "and, where attention loops over the rows (a CPU), rows average 32 "
                                        "tokens or more; true: always; false: never); used once a check "
                                        "shows it exact for the model"})
    shared_prefix_scoring: bool = field(
        default=True, metadata={"help": "packed scoring holds a prompt several completions share once, each "
                                        "completion attending to it (false: every row whole)"})
    allow_nan_rewards: bool = field(
        default=False, metadata={"help": "a reward function may return None/NaN for rows it does not score"})
    reward_timeout: float | None = field(
        default=None, metadata={"help": "seconds the reward functions may take on one rollout; then the run "
                                        "stops naming the one still running (null: no limit; a line names it "
                                        "every minute it runs)"})
    replay_sampling_mask: bool | None = field(
        default=None, metadata={"help": "score the distribution the sampler drew from when top_p / top_k / "
                                        "min_p truncate it: log-probs renormalised over the tokens it kept "
                                        "(null: on whenever sampling truncates; false: the full vocabulary)"})
    num_completions_to_log: int = field(default=8, metadata={"help": "completions written per log step"})
    zero_signal_warning_steps: int = field(
        default=5, metadata={"help": "warn after this many steps in a row where every group had equal "
                                     "rewards"})
    vllm_dtype: str = field(
        default="auto", metadata={"help": "the engine's weights: auto (the trainer's), bfloat16 (~2x "
                                          "faster), float32"})
    vllm_enforce_eager: bool | None = field(
        default=None, metadata={"help": "no compilation (default: eager on CPU, compiled on GPU)"})
    vllm_lora_sync: str = field(
        default="auto", metadata={"help": "LoRA: auto (push the adapter when vLLM can serve it, else "
                                          "merged), adapter, merged"})
    vllm_sync_bucket_mb: float = field(
        default=256.0, metadata={"help": "full weights are pushed (and gathered under FSDP2/ZeRO-3) in "
                                         "buckets of this size (MiB)"})
    tools: list[str] = field(
        default_factory=list, metadata={"help": "functions the policy may call, as module.path:function "
                                                "(the trainer also takes callables)"})
    tool_call_timeout: float = field(
        default=30.0, metadata={"help": "seconds one tool call may run; then the policy reads a timeout "
                                        "error"})

    min_generations: ClassVar[int] = 2  # group-relative advantages need two completions of a prompt

    @property
    def kl_coef(self) -> float:
        """The weight of the KL to the reference policy (GRPO's `beta`; DistillationConfig's beta is not)."""
        return self.beta

    def _normalize(self) -> None:
        super()._normalize()
        normalize_grpo(self)

    def _check(self, errors: list[str]) -> None:
        super()._check(errors)
        check_grpo(self, errors)
