"""The GRPO family's fields, with their defaults (TRL 1.16's GRPOConfig) and help: `_GRPOFields`,
the base of GRPOConfig, RLOOConfig and AsyncGRPOConfig (rlft/config/classes.py), which are siblings,
as in TRL.

The help of `loss_type` and `advantage_estimator` lists the registries' keys (rlft/core).
"""

from typing import ClassVar

from rlft.config.checks import check_grpo, normalize_grpo
from rlft.config.common import _BaseConfig, config_class
from rlft.config.options import NON_NEGATIVE, POSITIVE, Facts, above, between, one_of, option
from rlft.core.advantages import ADVANTAGE_ESTIMATORS
from rlft.core.importance import CORRECTIONS
from rlft.core.losses import KL_ESTIMATORS, LOSSES

SCALE_REWARDS = ("group", "batch", "none")
# transformers' names
CACHE_IMPLEMENTATIONS = (None, "dynamic", "static", "offloaded", "offloaded_static")
IS_LEVELS = ("token", "sequence")
ROUTING_REPLAY = ("auto", "rollout", "none")
VLLM_MODES = ("colocate", "server")
VLLM_MODEL_IMPLS = ("vllm", "transformers", "auto")
LORA_SYNC_MODES = ("auto", "adapter", "merged")  # rlft/rollout/weight_sync.py
DTYPES = ("auto", "float32", "bfloat16", "float16")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


@config_class
class _GRPOFields(_BaseConfig):
    """GRPO run. `per_device_train_batch_size` counts completions, as in TRL."""

    inherited_facts = {"auto_find_batch_size": Facts(refused=(
        "GRPO's generation batch must hold whole groups of num_generations completions; shrinking "
        "it on out-of-memory breaks that (TRL refuses it too); lower per_device_train_batch_size "
        "instead"))}

    learning_rate: float = option(1e-6, "peak learning rate")
    remove_unused_columns: bool | None = option(
        False, "no effect: every extra dataset column reaches the reward functions (TRL's False)")
    # TRL 1.16 GRPOConfig: model, generation
    router_aux_loss_coef: float | None = option(
        None, check=NON_NEGATIVE,
        help="MoE policies: weight of the router load-balancing loss (None: the model's own)")
    routing_replay: str = option(
        "auto", check=one_of(ROUTING_REPLAY), rlft=True,
        help="Mixture-of-Experts policies: the trainer routes each token to the experts the "
             "sampler chose (rollout routing replay). auto: on where the engine records routes "
             "(transformers' generate, also in the async producer), else off with a note; rollout: "
             "on, an error where it cannot be; none: off. Dense models record nothing "
             "(rlft/model/routing.py)")
    cast_lm_head_to_fp32: bool = option(False, "keep the LM head in float32 when the model is "
                                               "bfloat16")
    num_generations: int | None = option(8, "completions per prompt (the group size G)")
    num_generations_eval: int | None = option(
        None, check=POSITIVE, resume=True,
        help="sampled completions per eval prompt (default: one greedy completion)")
    max_completion_length: int | None = option(512, "longest completion in tokens", check=POSITIVE)
    ds3_gather_for_generation: bool = option(
        True, no_effect="under ZeRO-3 rlft gathers each layer in turn while generating")
    shuffle_dataset: bool | None = option(True, "shuffle prompts each epoch (seeded; resumable)")
    generation_batch_size: int | None = option(
        None, check=POSITIVE,
        help="completions per generation across processes (alternative to steps_per_generation)")
    steps_per_generation: int | None = option(
        None, "micro-steps fed by one generation batch (default "
              "gradient_accumulation_steps)", check=POSITIVE)
    temperature: float = option(1.0, "sampling temperature (log-probs use it too)", check=POSITIVE)
    top_p: float = option(1.0, "nucleus sampling", check=between(0, 1, open_low=True))
    top_k: int = option(0, "top-k sampling (0 or null: off)", check=NON_NEGATIVE)
    min_p: float | None = option(None, "min-p sampling", check=NON_NEGATIVE)
    generation_kwargs: dict | str | None = option(
        None, "extra generation arguments (generate or vLLM sampling fields)")
    chat_template_kwargs: dict | str | None = option(
        None, "extra arguments for the chat template (e.g. enable_thinking: false)")
    repetition_penalty: float = option(1.0, "generation repetition penalty")
    cache_implementation: str | None = option(
        None, check=one_of(CACHE_IMPLEMENTATIONS),
        help="transformers' KV cache for generate: dynamic (default) or static, ...")
    # vLLM
    use_vllm: bool = option(False, "generate with vLLM instead of transformers' generate")
    vllm_mode: str = option(
        "colocate", check=one_of(VLLM_MODES),
        help="colocate (an engine in each training process) or server (rlft vllm-serve)")
    vllm_model_impl: str = option(
        "vllm", "vLLM's model implementation: vllm or transformers", check=one_of(VLLM_MODEL_IMPLS))
    vllm_enable_sleep_mode: bool = option(
        False, "colocate: free the engine's memory while training (a no-op on CPU)")
    vllm_structured_outputs_regex: str | None = option(
        None, refused="guided decoding is not implemented in rlft's rollouts")
    vllm_server_base_url: str | None = option(None, "server mode: the server's URL (wins over "
                                                    "host/port)")
    vllm_server_host: str = option("0.0.0.0", "server mode: host (0.0.0.0 means this machine)")
    vllm_server_port: int = option(8000, "server mode: port")
    vllm_server_timeout: float = option(
        240.0, "server mode: seconds to wait for the server and for each request", check=POSITIVE)
    vllm_group_port: int = option(
        51216, no_effect="rlft's server mode sends weights over HTTP, not an NCCL group")
    vllm_gpu_memory_utilization: float = option(
        0.3, "colocate: fraction of GPU memory for the engine", check=between(0, 1, open_low=True))
    vllm_max_model_length: int | None = option(
        None, "the engine's context (default: max_prompt_length + "
              "max_completion_length)", check=POSITIVE)
    vllm_tensor_parallel_size: int = option(
        1, "tensor parallelism (server mode only, for now)", check=POSITIVE)
    # loss and advantages
    beta: float = option(
        0.0, "KL coefficient against the reference policy (0: no reference "
             "model)", check=NON_NEGATIVE)
    num_iterations: int = option(1, "policy updates per generation batch (mu)", check=POSITIVE)
    epsilon: float = option(
        0.2, "lower clip range of the ratio (and upper unless epsilon_high)", check=NON_NEGATIVE)
    delta: float | None = option(
        None,
        check=above(1, note=" (INTELLECT-2 caps the ratio of negative-advantage tokens from above; "
                            "it should exceed 1 + epsilon_high)"),
        help="INTELLECT-2 two-sided clipping: cap the ratio at delta (> 1 + epsilon_high) for A < "
             "0")
    epsilon_high: float | None = option(None, "upper clip range (DAPO's "
                                              "clip-higher)", check=NON_NEGATIVE)
    sapo_temperature_neg: float = option(
        1.05, "SAPO gate temperature for negative advantages", check=POSITIVE)
    sapo_temperature_pos: float = option(1.0, "SAPO gate temperature for positive "
                                              "advantages", check=POSITIVE)
    vespo_k_pos: float = option(2.0, "VESPO: power k of the gamma weight for positive advantages")
    vespo_lambda_pos: float = option(
        3.0, "VESPO: decay lambda of the gamma weight for positive advantages", check=NON_NEGATIVE)
    vespo_k_neg: float = option(3.0, "VESPO: power k of the gamma weight for negative advantages")
    vespo_lambda_neg: float = option(
        2.0, "VESPO: decay lambda of the gamma weight for negative advantages", check=NON_NEGATIVE)
    importance_sampling_level: str = option(
        "token", "token or sequence (GSPO) ratios", check=one_of(IS_LEVELS))
    reward_weights: list[float] | None = option(None, "one weight per reward function (default 1 "
                                                      "each)")
    multi_objective_aggregation: str = option(
        "sum_then_normalize", check=one_of(AGGREGATIONS),
        help="sum_then_normalize or normalize_then_sum (GDPO) over reward functions")
    scale_rewards: str = option(
        "group", check=one_of(SCALE_REWARDS),
        help="group, batch, or none: divide advantages by the reward std over that set")
    advantage_estimator: str = option(
        "grpo", check=one_of(ADVANTAGE_ESTIMATORS), rlft=True,
        help=f"{', '.join(ADVANTAGE_ESTIMATORS)} (rlft/core/advantages.py)")
    kl_in_reward: bool | None = option(
        None, rlft=True,
        help="put beta's KL penalty in the sequence reward (clipped to reward_clip_range first) "
             "instead of a KL term in the loss (null: the trainer's way: RLOOTrainer the reward, "
             "GRPOTrainer the loss)")
    rollout_source: str | None = option(
        None, rlft=True,
        help="where rollouts come from: generate (each when its step comes), producer (a process "
             "sampling ahead), or a registered source (rlft/train/sources/rollout_source.py); "
             "null: the trainer's (AsyncGRPOTrainer: producer, else generate)")
    dynamic_sampling: bool = option(
        False, rlft=True,
        help="DAPO: drop groups whose rewards are all equal and sample more prompts until the "
             "batch is full of groups with a learning signal")
    max_num_gen_batches: int = option(
        10, check=NON_NEGATIVE, rlft=True,
        help="dynamic sampling: at most this many generation rounds per rollout (0: no limit); "
             "then the batch is filled with zero-spread groups")
    loss_type: str = option("dapo", f"{', '.join(LOSSES)} (docs/losses.md)", check=one_of(LOSSES))
    mask_truncated_completions: bool = option(
        False, "exclude completions cut at max_completion_length from the loss")
    sync_ref_model: bool = option(
        False, "TR-DPO: move the reference toward the policy every ref_model_sync_steps (beta > 0, "
               "full)")
    ref_model_mixup_alpha: float = option(
        0.6, "TR-DPO: ref <- alpha * policy + (1 - alpha) * ref", check=between(0, 1))
    ref_model_sync_steps: int = option(
        512, "TR-DPO: optimiser steps between reference updates", check=POSITIVE)
    top_entropy_quantile: float = option(
        1.0, check=between(0, 1, note=" (1 keeps every token)"),
        help="train only the top-rho entropy tokens of each step (0.2 in the 80/20 paper; 1: all)")
    entropy_coef: float = option(
        0.0, check=NON_NEGATIVE,
        help="entropy bonus coefficient (loss -= coef * mean token entropy); adaptive: its start")
    use_adaptive_entropy: bool = option(
        False, "Skywork-OR1: move entropy_coef by entropy_coef_delta toward entropy_target")
    entropy_coef_min: float = option(
        0.0, "adaptive entropy: lower bound of the coefficient", check=NON_NEGATIVE)
    entropy_coef_max: float = option(
        1.0, "adaptive entropy: upper bound of the coefficient", check=NON_NEGATIVE)
    entropy_coef_delta: float = option(
        0.005, "adaptive entropy: change of the coefficient per step", check=NON_NEGATIVE)
    entropy_target: float = option(
        0.2, check=NON_NEGATIVE,
        help="adaptive entropy: the bonus applies while mean token entropy (nats) <= this")
    max_tool_calling_iterations: int | None = option(
        None, check=NON_NEGATIVE,
        help="rounds of tool results per completion (null: until no call or the budget ends)")
    vllm_importance_sampling_correction: bool = option(True, "weight the policy term by pi_old / "
                                                             "pi_sampler")
    vllm_importance_sampling_mode: str = option(
        "sequence_mask", check=one_of(CORRECTIONS),
        help="how the correction bounds pi_old / pi_sampler: TRL's token_truncate, token_mask, "
             "sequence_truncate, sequence_mask; icepop (two-sided token mask), "
             "sequence_geometric_mask (a sequence dropped when its geometric-mean ratio leaves the "
             "bounds); rlft/core/importance.py")
    vllm_importance_sampling_clip_max: float | None = option(
        3.0, "upper bound of the correction weight", check=POSITIVE)
    vllm_importance_sampling_clip_min: float | None = option(
        None, "lower bound of the correction weight (icepop, sequence_geometric_mask: null is 1 / "
              "the upper)")
    rollout_correction_bypass: bool = option(
        False, rlft=True,
        help="verl's bypass mode: the sampler's log-probs are pi_old, so the clipped ratio is pi_theta / "
             "pi_sampler, no pi_old / pi_sampler weight is applied and no forward computes pi_old "
             "(engines that return log-probs: vLLM, the async producer)")
    off_policy_mask_threshold: float | None = option(
        None, check=NON_NEGATIVE,
        help="DeepSeek-V3.2: drop A < 0 completions whose sampler/policy KL exceeds this")
    use_bias_correction_kl: bool = option(True, "weight the KL term by the importance ratio (TRL's "
                                                "default)")
    # logging
    log_completions: bool = option(
        False, "write sampled completions to completions.jsonl at each log step", resume=True)
    log_multimodal: bool = option(True, no_effect="rlft has no multimodal inputs")
    num_completions_to_print: int | None = option(
        None, no_effect="rlft writes num_completions_to_log completions to completions.jsonl "
                        "instead")
    log_unique_prompts: bool = option(
        False, no_effect="rlft writes num_completions_to_log completions to completions.jsonl")
    log_completions_hub_repo: str | None = option(
        None, refused="rlft writes completions.jsonl in output_dir; push that file yourself")
    use_transformers_continuous_batching: bool = option(
        False, no_effect="rlft generates with model.generate (or vLLM with use_vllm)")
    transformers_continuous_batching_config: dict | str | None = option(
        None, no_effect="rlft generates with model.generate (or vLLM with use_vllm)")
    use_transformers_paged: bool = option(
        False, no_effect="rlft generates with model.generate (or vLLM with use_vllm)")
    vllm_importance_sampling_cap: float | None = option(
        None, "TRL's deprecated name for vllm_importance_sampling_clip_max", check=POSITIVE)
    # rlft's own (RLFT_FIELDS)
    teacher_model_name_or_path: str | None = option(
        None, rlft=True,
        help="a teacher (hub id or folder; the trainer's teacher_model wins) whose per-token "
             "reverse KL joins the loss, weighted by teacher_coef")
    teacher_model_revision: str | None = option(
        None, "the teacher's revision (branch, tag or commit)", rlft=True)
    teacher_model_init_kwargs: dict | str | None = option(
        None, "from_pretrained keyword arguments for the teacher (e.g. dtype)", rlft=True)
    teacher_coef: float = option(
        0.0, check=NON_NEGATIVE, rlft=True,
        help="GRPO with a teacher: the weight of the token-mean reverse KL(policy || teacher) "
             "added to the policy loss (0: no teacher term)")
    teacher_model_server_url: str | None = option(
        None, resume=True, rlft=True,
        help="a teacher served by `rlft vllm-serve` (e.g. http://127.0.0.1:8001) instead of a "
             "local one: the divergence uses its top-k log-probs (docs/distillation.md); needs "
             "temperature 1")
    loss_top_k: int = option(
        20, check=POSITIVE, rlft=True,
        help="served teacher: the teacher's most likely tokens per position the divergence sees "
             "(plus the sampled one); TRL's experimental default is 1 (docs/migration.md)")
    loss_add_tail: bool = option(
        True, rlft=True,
        help="served teacher: the rest of the vocabulary as one more bucket (a lower bound of the "
             "exact divergence); false: renormalise over the top-k")
    max_prompt_length: int | None = option(
        None, "longest prompt in tokens; a longer one is an error naming its "
              "row", check=POSITIVE, rlft=True)
    kl_estimator: str = option(
        "k3", "k1, k2, or k3 (Schulman's estimators)", check=one_of(KL_ESTIMATORS), rlft=True)
    shared_prompt_prefill: bool = option(
        True, "dynamic cache: prefill each prompt once for its whole group", rlft=True)
    logprob_chunk_size: int | None = option(
        None, check=POSITIVE, resume=True, rlft=True,
        help="positions per tile of the fused LM head (float32 logits of one tile at a time); "
             "null: sized to the vocabulary (~16M logits per tile)")
    token_budget: int | None = option(
        None, check=POSITIVE, resume=True, rlft=True,
        help="fill micro-batches by prompt + completion tokens (at most this many each; a longer "
             "row alone) instead of per_device_train_batch_size rows (null or <= 0: by rows)")
    padding_free: bool | None = option(
        None, resume=True, rlft=True,
        help="score each micro-batch packed into one sequence, no padding (null: where that "
             "computes at most half the tokens a padded one would and, where attention loops over "
             "the rows (a CPU), rows average 32 tokens or more; true: always; false: never); used "
             "once a check shows it exact for the model")
    shared_prefix_scoring: bool = option(
        True, resume=True, rlft=True,
        help="packed scoring holds a prompt several completions share once, each completion "
             "attending to it (false: every row whole)")
    allow_nan_rewards: bool = option(
        False, "a reward function may return None/NaN for rows it does not score", rlft=True)
    reward_timeout: float | None = option(
        None, check=POSITIVE, rlft=True,
        help="seconds the reward functions may take on one rollout; then the run stops naming the "
             "one still running (null: no limit; a line names it every minute it runs)")
    replay_sampling_mask: bool | None = option(
        None, rlft=True,
        help="score the distribution the sampler drew from when top_p / top_k / min_p truncate it: "
             "log-probs renormalised over the tokens it kept (null: on whenever sampling "
             "truncates; false: the full vocabulary)")
    num_completions_to_log: int = option(
        8, "completions written per log step", check=POSITIVE, resume=True, rlft=True)
    zero_signal_warning_steps: int = option(
        5, "warn after this many steps in a row where every group had equal "
           "rewards", resume=True, rlft=True)
    vllm_dtype: str = option(
        "auto", check=one_of(DTYPES), rlft=True,
        help="the engine's weights: auto (the trainer's), bfloat16 (~2x faster), float32")
    vllm_quantization: str | None = option(
        None, rlft=True,
        help="the colocated engine's quantization, vLLM's own (e.g. fp8_per_tensor on a GPU, "
             "int8_per_channel_weight_only on a CPU; null: none): weights are pushed in the trainer's "
             "precision and quantized as vLLM loads them, so the sampler is another policy, measured "
             "under sampling/ and weighed by vllm_importance_sampling_mode. A server is started with "
             "its own --quantization (docs/vllm.md)")
    vllm_enforce_eager: bool | None = option(
        None, "no compilation or CUDA graphs (default: eager on CPU and for a MoE policy under routing "
        "replay, whose routes a graph replay would not report; compiled on GPU)", rlft=True)
    vllm_lora_sync: str = option(
        "auto", check=one_of(LORA_SYNC_MODES), rlft=True,
        help="LoRA: auto (push the adapter when vLLM can serve it, else merged), adapter, merged")
    vllm_sync_bucket_mb: float = option(
        256.0, check=POSITIVE, resume=True, rlft=True,
        help="full weights are pushed (and gathered under FSDP2/ZeRO-3) in buckets of this size "
             "(MiB)")
    tools: list[str] = option(
        default_factory=list, rlft=True,
        help="functions the policy may call, as module.path:function (the trainer also takes "
             "callables)")
    tool_call_timeout: float = option(
        30.0, check=POSITIVE, rlft=True,
        help="seconds one tool call may run; then the policy reads a timeout error")

    min_generations: ClassVar[int] = 2  # group-relative advantages need two completions of a prompt
    # the rollouts carry their sampler's log-probs without vLLM (the async producer records them)
    producer_logps: ClassVar[bool] = False

    @property
    def kl_coef(self) -> float:
        """The weight of the KL to the reference policy (GRPO's `beta`; DistillationConfig's beta is
        not)."""
        return self.beta

    def _normalize(self) -> None:
        super()._normalize()
        normalize_grpo(self)

    def _check(self, errors: list[str]) -> None:
        super()._check(errors)
        check_grpo(self, errors)
