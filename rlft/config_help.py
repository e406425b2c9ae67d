"""One line of help per field rlft declares (its configs, ModelConfig, the script arguments),
grouped by topic.

The single source for field descriptions: the dataclasses' argparse help (`rlft grpo --help`) reads it,
and `tests/test_cli.py` fails when a field rlft declares has no line here (or a line names no field).
Types and defaults come from the dataclasses; transformers' own fields keep transformers' help.
"""

from __future__ import annotations

from rlft.core.advantages import ADVANTAGE_ESTIMATORS
from rlft.core.losses import LOSSES

SECTIONS: dict[str, dict[str, str]] = {
    "model and data": {
        "model_name_or_path": "policy (GRPO) or reward model: a local folder or a hub id",
        "train_dataset": "training data: a .jsonl/.json/.csv/.parquet file, a dataset folder, or a hub id",
        "eval_dataset": "evaluation data, same forms as train_dataset; a mapping name: data evaluates each",
        "dataset_name": "TRL's script argument: a hub dataset id or a local dataset folder "
                        "(datasets.load_dataset)",
        "dataset_config": "the dataset's configuration (subset) name, with dataset_name",
        "dataset_train_split": "the split of dataset_name to train on",
        "dataset_test_split": "the split of dataset_name to evaluate on (when eval_strategy is not no)",
        "dataset_streaming": "stream dataset_name instead of downloading it whole (needs max_steps)",
        "reward_model_name_or_path": "a reward model (folder or hub id) used as the first reward function",
        "model_revision": "the model's hub revision (branch, tag or commit)",
        "attn_implementation": "transformers' attention implementation (eager, sdpa, flash_attention_2, ...)",
        "dtype": "weights dtype: auto (bf16/fp16 when set, else bfloat16 on a GPU that has it, else "
                 "float32), float32, bfloat16, float16",
        "bf16": "train in bfloat16 weights (default: where the device has bfloat16; a CPU: false)",
        "fp16": "load float16 weights (LoRA only; full fine-tuning refused)",
        "trust_remote_code": "allow model code from the hub repository (transformers' flag)",
        "model_init_kwargs": "extra keyword arguments for from_pretrained (e.g. attn_implementation)",
        "chat_template_path": "a Jinja chat template file (or a tokenizer folder) to use instead of the "
                              "model's",
        "pad_token": "set the tokenizer's pad token (must differ from eos for reward models)",
        "eos_token": "set the tokenizer's eos token (generation stops there)",
        "pad_to_multiple_of": "pad each micro-batch's completion length to a multiple of N (auto, null: no "
                              "padding)",
        "max_length": "reward model: longest chosen/rejected sequence in tokens (longer ones truncated)",
        "truncation": "reward model: keep_start, keep_end, or error when a pair exceeds max_length",
        "shuffle_dataset": "shuffle prompts each epoch (seeded; resumable)",
        "dataloader_num_workers": "accepted for TRL compatibility; rlft tokenises up front",
    },
    "LoRA (TRL's ModelConfig names)": {
        "use_peft": "train LoRA adapters instead of all weights",
        "lora_r": "LoRA rank",
        "lora_alpha": "LoRA scaling numerator (scale = alpha / r)",
        "lora_dropout": "dropout on the LoRA path (set 0 with use_vllm: see disable_dropout)",
        "lora_target_modules": "module names to adapt, or all-linear (default: peft's per-architecture "
                               "choice)",
        "lora_target_parameters": "parameter names to adapt (peft's target_parameters, e.g. MoE experts)",
        "lora_modules_to_save": "modules trained in full beside the adapters",
        "lora_task_type": "peft task type; rlft sets CAUSAL_LM (GRPO) / SEQ_CLS (reward, trains the head)",
        "use_rslora": "rank-stabilised LoRA: scale alpha / sqrt(r)",
        "use_dora": "DoRA: weight-decomposed LoRA",
        "load_in_8bit": "bitsandbytes 8-bit base weights (LoRA only; needs a CUDA GPU)",
        "load_in_4bit": "bitsandbytes 4-bit base weights, QLoRA (LoRA only; needs a CUDA GPU)",
        "bnb_4bit_quant_type": "4-bit quantisation type: nf4 or fp4",
        "use_bnb_nested_quant": "nested (double) quantisation of the 4-bit constants",
        "bnb_4bit_quant_storage": "storage dtype of the 4-bit weights",
    },
    "training": {
        "output_dir": "run folder: checkpoints, metrics.jsonl, completions.jsonl, final model",
        "overwrite_output_dir": "replace an earlier run's checkpoints and logs in output_dir (else refused)",
        "seed": "seeds Python, NumPy and torch (and LoRA init); in every checkpoint",
        "learning_rate": "peak learning rate",
        "lr_scheduler_type": "transformers' schedule name: linear, cosine, constant, "
                             "constant_with_warmup, ...",
        "lr_scheduler_kwargs": "extra arguments for the schedule (e.g. min_lr for cosine_with_min_lr)",
        "warmup_steps": "warmup optimiser steps; below 1, a fraction of all steps",
        "warmup_ratio": "warmup as a fraction of all steps (when warmup_steps is 0)",
        "weight_decay": "AdamW weight decay",
        "adam_beta1": "AdamW beta1",
        "adam_beta2": "AdamW beta2",
        "adam_epsilon": "AdamW epsilon",
        "optim": "adamw_torch, adamw_torch_fused (fused on GPU), or sgd",
        "max_grad_norm": "clip the global gradient norm to this (0: no clipping)",
        "max_steps": "optimiser steps to run (> 0 overrides num_train_epochs)",
        "num_train_epochs": "passes over the training data when max_steps is not set",
        "per_device_train_batch_size": "per process and micro-step: completions (GRPO, as TRL) or pairs "
                                       "(reward)",
        "per_device_eval_batch_size": "per process: evaluation batch size",
        "gradient_accumulation_steps": "micro-steps per optimiser step",
        "gradient_checkpointing": "recompute activations in backward to save memory",
        "gradient_checkpointing_kwargs": "passed to gradient_checkpointing_enable (e.g. use_reentrant: "
                                         "false)",
        "activation_checkpointing": "transformers 5's name for gradient_checkpointing; wins when set",
        "activation_checkpointing_kwargs": "transformers 5's name for gradient_checkpointing_kwargs",
        "disable_dropout": "set every dropout probability to 0 (LoRA's included)",
        "max_nonfinite_steps": "stop after this many non-finite steps in a row (each is skipped, never "
                               "applied)",
        "remove_unused_columns": "no effect: every extra dataset column reaches the reward functions (TRL's "
                                 "False)",
        "router_aux_loss_coef": "MoE policies: weight of the router load-balancing loss (None: the model's "
                                "own)",
        "activation_offloading": "no effect in rlft (activations stay on the device)",
        "dataset_num_proc": "no effect in rlft (pairs are tokenized in the main process)",
        "ddp_timeout": "seconds a collective may wait for another process (600 on CPU when left at 1800)",
    },
    "logging, saving, evaluation": {
        "logging_steps": "log every N optimiser steps (below 1: a fraction of all steps)",
        "logging_strategy": "steps, epoch, or no",
        "logging_first_step": "also log step 1",
        "save_steps": "checkpoint every N optimiser steps (below 1: a fraction of all steps)",
        "save_strategy": "steps, epoch, or no",
        "save_total_limit": "keep only the newest N checkpoints",
        "eval_strategy": "steps, epoch, or no",
        "eval_steps": "evaluate every N steps (default: logging_steps)",
        "eval_delay": "no evaluation before this step",
        "eval_on_start": "evaluate once before training",
        "report_to": "trackers: none, all, or names (tensorboard, trackio, wandb, mlflow, ...)",
        "run_name": "the run's name in trackers",
        "disable_tqdm": "no progress bar on a terminal (plain log lines still appear)",
        "log_completions": "write sampled completions to completions.jsonl at each log step",
        "num_completions_to_log": "completions written per log step",
        "num_completions_to_print": "TRL's console table size; rlft writes num_completions_to_log to a file",
        "log_unique_prompts": "no effect in rlft (completions.jsonl keeps every logged row)",
        "log_multimodal": "no effect in rlft (no multimodal inputs)",
        "log_completions_hub_repo": "not supported: completions.jsonl in output_dir holds them",
        "zero_signal_warning_steps": "warn after this many steps in a row where every group had equal "
                                     "rewards",
    },
    "GRPO: generation": {
        "reward_funcs": "reward functions: built-in names, module:function, or a reward model folder",
        "reward_weights": "one weight per reward function (default 1 each)",
        "num_generations": "completions per prompt (the group size G)",
        "num_generations_eval": "sampled completions per eval prompt (default: one greedy completion)",
        "steps_per_generation": "micro-steps fed by one generation batch (default "
                                "gradient_accumulation_steps)",
        "generation_batch_size": "completions per generation across processes (alternative to "
                                 "steps_per_generation)",
        "max_prompt_length": "longest prompt in tokens; a longer one is an error naming its row",
        "max_completion_length": "longest completion in tokens",
        "temperature": "sampling temperature (log-probs use it too)",
        "top_p": "nucleus sampling",
        "top_k": "top-k sampling (0 or null: off)",
        "min_p": "min-p sampling",
        "repetition_penalty": "generation repetition penalty",
        "generation_kwargs": "extra generation arguments (generate or vLLM sampling fields)",
        "chat_template_kwargs": "extra arguments for the chat template (e.g. enable_thinking: false)",
        "cache_implementation": "transformers' KV cache for generate: dynamic (default) or static, ...",
        "use_transformers_continuous_batching": "no effect in rlft (generate or vLLM)",
        "transformers_continuous_batching_config": "no effect in rlft (generate or vLLM)",
        "use_transformers_paged": "TRL's deprecated name for use_transformers_continuous_batching; no effect",
        "ds3_gather_for_generation": "no effect: under ZeRO-3 rlft gathers each layer in turn while "
                                     "generating",
        "shared_prompt_prefill": "dynamic cache: prefill each prompt once for its whole group",
        "token_budget": "fill micro-batches by prompt + completion tokens (at most this many each; a longer "
                        "row alone) instead of per_device_train_batch_size rows",
        "logprob_chunk_size": "positions per tile of the fused LM head (float32 logits of one tile at a "
                              "time); null: sized to the vocabulary (~16M logits per tile)",
    },
    "GRPO: loss and advantages": {
        "loss_type": f"{', '.join(LOSSES)} (docs/losses.md)",
        "advantage_estimator": f"{', '.join(ADVANTAGE_ESTIMATORS)} (rlft/core/advantages.py)",
        "dynamic_sampling": "DAPO: drop groups whose rewards are all equal and sample more prompts until the "
                            "batch is full of groups with a learning signal",
        "max_num_gen_batches": "dynamic sampling: at most this many generation rounds per rollout (0: no "
                               "limit); then the batch is filled with zero-spread groups",
        "rollout_lag": "async: the rollouts of step t are sampled from the weights of step t - rollout_lag "
                       "(0: synchronous, on the producer; 1: one-step-off-policy)",
        "max_staleness": "async: the most optimiser steps a rollout's weights may lag behind the trainer's "
                         "(rollout_lag + weight_sync_steps - 1 must not exceed it)",
        "weight_sync_steps": "async: optimiser steps between weight pushes to the producer",
        "max_inflight_tasks": "async: no effect in rlft (the producer runs one rollout at a time, in order)",
        "queue_maxsize": "async: no effect in rlft (at most rollout_lag + 1 rollouts are ever queued)",
        "heartbeat_stale_after_s": "async: stop with an error when the producer has not signalled for this "
                                   "long (dead, stopped, or hung)",
        "request_timeout": "async: stop with an error when one rollout takes the producer longer than this",
        "weight_sync_timeout": "async: no effect in rlft (weights are a file the producer reads)",
        "fork_threshold_tokens": "async: no effect in rlft (multi-turn rollouts are not built for async)",
        "producer_cpus": "async: CPU cores the producer process runs on (Linux affinity), e.g. [1]",
        "producer_threads": "async: torch threads in the producer process (default: its cores)",
        "producer_restarts": "async: restart a failed producer from the current weights, at most this "
                             "many times a run (0: stop with the error); the run then differs from an "
                             "uninterrupted one",
        "normalize_advantages": "RLOO: whiten the advantages over the batch",
        "reward_clip_range": "RLOO: clip each total reward to [min, max] before the KL penalty",
        "beta": "KL coefficient against the reference policy (0: no reference model)",
        "kl_estimator": "k1, k2, or k3 (Schulman's estimators)",
        "use_bias_correction_kl": "weight the KL term by the importance ratio (TRL's default)",
        "epsilon": "lower clip range of the ratio (and upper unless epsilon_high)",
        "epsilon_high": "upper clip range (DAPO's clip-higher)",
        "importance_sampling_level": "token or sequence (GSPO) ratios",
        "scale_rewards": "group, batch, or none: divide advantages by the reward std over that set",
        "multi_objective_aggregation": "sum_then_normalize or normalize_then_sum (GDPO) over reward "
                                       "functions",
        "num_iterations": "policy updates per generation batch (mu)",
        "mask_truncated_completions": "exclude completions cut at max_completion_length from the loss",
        "allow_nan_rewards": "a reward function may return None/NaN for rows it does not score",
        "sapo_temperature_pos": "SAPO gate temperature for positive advantages",
        "sapo_temperature_neg": "SAPO gate temperature for negative advantages",
        "cast_lm_head_to_fp32": "keep the LM head in float32 when the model is bfloat16",
        "vespo_k_pos": "VESPO: power k of the gamma weight for positive advantages",
        "vespo_lambda_pos": "VESPO: decay lambda of the gamma weight for positive advantages",
        "vespo_k_neg": "VESPO: power k of the gamma weight for negative advantages",
        "vespo_lambda_neg": "VESPO: decay lambda of the gamma weight for negative advantages",
        "delta": "INTELLECT-2 two-sided clipping: cap the ratio at delta (> 1 + epsilon_high) for A < 0",
        "top_entropy_quantile": "train only the top-rho entropy tokens of each step (0.2 in the 80/20 paper; "
                                "1: all)",
        "entropy_coef": "entropy bonus coefficient (loss -= coef * mean token entropy); adaptive: its start",
        "use_adaptive_entropy": "Skywork-OR1: move entropy_coef by entropy_coef_delta toward entropy_target",
        "entropy_coef_min": "adaptive entropy: lower bound of the coefficient",
        "entropy_coef_max": "adaptive entropy: upper bound of the coefficient",
        "entropy_coef_delta": "adaptive entropy: change of the coefficient per step",
        "entropy_target": "adaptive entropy: the bonus applies while mean token entropy (nats) <= this",
        "off_policy_mask_threshold": "DeepSeek-V3.2: drop A < 0 completions whose sampler/policy KL exceeds "
                                     "this",
        "sync_ref_model": "TR-DPO: move the reference toward the policy every ref_model_sync_steps "
                          "(beta > 0, full)",
        "ref_model_mixup_alpha": "TR-DPO: ref <- alpha * policy + (1 - alpha) * ref",
        "ref_model_sync_steps": "TR-DPO: optimiser steps between reference updates",
    },
    "GRPO: tools (docs/agents.md)": {
        "tools": "functions the policy may call, as module.path:function (the trainer also takes callables)",
        "max_tool_calling_iterations": "rounds of tool results per completion (null: until no call or the "
                                       "budget ends)",
        "tool_call_timeout": "seconds one tool call may run; then the policy reads a timeout error",
    },
    "GRPO: vLLM rollouts (docs/vllm.md)": {
        "use_vllm": "generate with vLLM instead of transformers' generate",
        "vllm_mode": "colocate (an engine in each training process) or server (rlft vllm-serve)",
        "vllm_model_impl": "vLLM's model implementation: vllm or transformers",
        "vllm_structured_outputs_regex": "not supported: guided decoding by a regular expression",
        "vllm_group_port": "no effect: rlft's server mode sends weights over HTTP",
        "vllm_dtype": "the engine's weights: auto (the trainer's), bfloat16 (~2x faster), float32",
        "vllm_enforce_eager": "no compilation (default: eager on CPU, compiled on GPU)",
        "vllm_lora_sync": "LoRA: auto (push the adapter when vLLM can serve it, else merged), "
                          "adapter, merged",
        "vllm_sync_bucket_mb": "full weights are pushed (and gathered under FSDP2/ZeRO-3) in buckets "
                               "of this size (MiB)",
        "vllm_server_base_url": "server mode: the server's URL (wins over host/port)",
        "vllm_server_host": "server mode: host (0.0.0.0 means this machine)",
        "vllm_server_port": "server mode: port",
        "vllm_server_timeout": "server mode: seconds to wait for the server and for each request",
        "vllm_gpu_memory_utilization": "colocate: fraction of GPU memory for the engine",
        "vllm_max_model_length": "the engine's context (default: max_prompt_length + max_completion_length)",
        "vllm_tensor_parallel_size": "tensor parallelism (server mode only, for now)",
        "vllm_enable_sleep_mode": "colocate: free the engine's memory while training (a no-op on CPU)",
        "vllm_importance_sampling_correction": "weight the policy term by pi_old / pi_sampler",
        "vllm_importance_sampling_mode": "token_truncate, token_mask, sequence_truncate, sequence_mask",
        "vllm_importance_sampling_clip_min": "lower bound of the correction weight",
        "vllm_importance_sampling_clip_max": "upper bound of the correction weight",
        "vllm_importance_sampling_cap": "TRL's deprecated name for vllm_importance_sampling_clip_max",
    },
    "reward model": {
        "center_rewards_coefficient": "add coef * (r_chosen + r_rejected)^2 to keep scores centred",
    },
}

FIELD_HELP: dict[str, str] = {name: text for fields in SECTIONS.values() for name, text in fields.items()}
