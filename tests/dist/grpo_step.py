"""One GRPO optimiser step on a fixed off-policy rollout, per loss_type and per loss option, in 1 or N
processes (torchrun).

Generation is replaced by a deterministic stand-in so every launch sees the same
completions for the same prompt; everything after it (rewards, gathered advantages, global
normalisers, DDP, the optimiser) is the library's own path. Writes the trained parameters
and the logged step metrics of each loss_type to OUT (main process only). The model trains in DTYPE, float64
unless given (tests/helpers.py: SAME_STEP); DeepSpeed's engines train float32 only.

    torchrun --nproc_per_node 2 --standalone tests/dist/grpo_step.py MODEL_DIR OUT GLOBAL_ACCUMULATION [DTYPE [RUNS]]

RUNS: comma-separated names of the runs to take (loss types and options; default all).

DTYPE "routes": MODEL_DIR is a Mixture-of-Experts policy; padded and packed steps replaying fixed routes.
    accelerate launch --config_file ENGINE.yaml tests/dist/grpo_step.py ...   (FSDP2, ZeRO-2, ZeRO-3)
"""

from __future__ import annotations

import sys

import torch

from rlft import GRPOConfig, GRPOTrainer
from rlft.core.losses import LOSS_TYPES
from rlft.data.prompts import left_pad
from rlft.rollout.hf import Rollout, completion_mask_from
from rlft.train.state import release_processes
from tests.helpers import addition_rows

GROUP, PROMPTS, PER_DEVICE = 4, 4, 4


class FixedGenerator:
    """Completions that depend only on the prompt and their index in the group; with `kept`, each token comes
    with a kept set as a truncating sampler's would (the token and 5 others, fixed by the row's tokens); with
    `routes` (a Mixture-of-Experts policy under routing replay), each token comes with experts chosen at random,
    fixed by the row, which the trainer then replays instead of routing itself."""

    def __init__(self, tokenizer, kept: bool = False, routes: bool = False):
        self.tokenizer, self.kept, self.routes = tokenizer, kept, routes

    def __call__(self, model, prompt_ids, num_generations, greedy=False):
        repeated = [ids for ids in prompt_ids for _ in range(num_generations)]
        ids, mask = left_pad(repeated, self.tokenizer.pad_token_id)
        completions = []
        for row, prompt in enumerate(repeated):
            g = torch.Generator().manual_seed(sum(prompt) * 31 + row % num_generations)
            length = int(torch.randint(2, 7, (1,), generator=g))
            tokens = torch.randint(5, 300, (length,), generator=g).tolist() + [self.tokenizer.eos_token_id]
            completions.append(tokens + [self.tokenizer.pad_token_id] * (8 - len(tokens)))
        completion_ids = torch.tensor(completions)
        completion_mask, truncated = completion_mask_from(completion_ids, [self.tokenizer.eos_token_id])
        kept = None
        if self.kept:
            kept = torch.full((*completion_ids.shape, 6), -1, dtype=torch.int32)
            for row, tokens in enumerate(completion_ids.tolist()):
                for t, token in enumerate(tokens[:int(completion_mask[row].sum())]):
                    others = [i for i in torch.randperm(300, generator=torch.Generator().manual_seed(token * 7 + t))
                              .tolist() if i != token][:5]
                    kept[row, t] = torch.tensor([token, *others], dtype=torch.int32)
        rollout = Rollout(ids, mask, completion_ids, completion_mask, truncated, sampling_kept=kept)
        if self.routes:
            self._add_routes(model, rollout, repeated, num_generations)
        return rollout

    @staticmethod
    def _add_routes(model, rollout, repeated, num_generations) -> None:
        from rlft.model.routing import route_state

        state = route_state(model)
        experts = model.config.num_experts
        prompts = torch.full((*rollout.prompt_ids.shape, state.layers, state.top_k), -1, dtype=torch.int16)
        completions = torch.full((*rollout.completion_ids.shape, state.layers, state.top_k), -1, dtype=torch.int16)
        def draw(seed: int, width: int) -> torch.Tensor:
            g = torch.Generator().manual_seed(seed)
            return torch.stack([torch.randperm(experts, generator=g)[:state.top_k]
                                for _ in range(width * state.layers)]).reshape(width, state.layers, -1)

        for row, prompt in enumerate(repeated):  # a prompt's routes as a shared prefill records them: one per group
            prompts[row, prompts.shape[1] - len(prompt):] = draw(sum(prompt) * 17, len(prompt))
            completions[row] = draw(sum(prompt) * 17 + 1 + row % num_generations, completions.shape[1])
        rollout.prompt_routes, rollout.completion_routes = prompts, completions


def off_policy(trainer, batch, scale: float = 0.3) -> None:
    """Make the step off-policy, the same way whatever the split: old log-probs = the current ones + noise
    seeded by each row's own tokens (ratios ~exp(+-0.3): clipping, delta, VESPO's weight and the off-policy
    mask all act)."""
    rollout = batch.rollout
    current = trainer.scorer.logps(trainer.model, rollout)
    noise = torch.zeros_like(current)
    for row, ids in enumerate(rollout.completion_ids.tolist()):
        g = torch.Generator().manual_seed(sum(i * (k + 1) for k, i in enumerate(ids)))
        noise[row] = (torch.rand(current.shape[1], generator=g, dtype=torch.float64) * 2 - 1).float() * scale
    batch.old_logps = (current + noise) * rollout.completion_mask


# Options that touch the loss, each run on top of loss_type grpo (name -> GRPOConfig fields)
OPTIONS = {
    "delta": dict(delta=1.1),
    "top_entropy_quantile": dict(loss_type="dapo", top_entropy_quantile=0.3),
    "entropy_coef": dict(entropy_coef=0.05),
    "adaptive_entropy": dict(use_adaptive_entropy=True, entropy_coef=0.05, entropy_target=100.0),
    "off_policy_mask": dict(off_policy_mask_threshold=0.02),
    "luspo_sequence": dict(loss_type="luspo", importance_sampling_level="sequence"),
    "reinforce_pp": dict(advantage_estimator="reinforce_pp"),  # token-level, whitened over both processes
    "rloo_estimator": dict(advantage_estimator="rloo"),
    "all_together": dict(loss_type="dapo", delta=1.1, top_entropy_quantile=0.5, entropy_coef=0.05,
                         off_policy_mask_threshold=0.02),
    "replayed_kept_sets": dict(top_p=0.8),  # log-probs renormalised over each token's kept ids
    "padded": dict(padding_free=False),  # the others: packed where that halves the tokens (auto)
    "packed_prompts": dict(padding_free=True),  # packed, each group's prompt once
    "packed_rows": dict(padding_free=True, shared_prefix_scoring=False),
}


# transformers' grouped-matmul experts take no float64: the loop over experts does
EAGER_EXPERTS = {"experts_implementation": "eager"}


def token_sum_reward(completion_ids, **kwargs):
    return [float(sum(ids) % 7) for ids in completion_ids]


def count_module_tiles() -> list:
    """Counts the scoring forwards that called the LM head as a module (rlft/model/scoring.py: _module_scores)
    instead of reading its weight into the fused head."""
    from rlft.model import scoring

    calls, module_scores = [], scoring._module_scores

    def counted(*args, **kwargs):
        calls.append(1)
        return module_scores(*args, **kwargs)
    scoring._module_scores = counted
    return calls


def main() -> None:
    model_dir, out, global_accumulation = sys.argv[1], sys.argv[2], int(sys.argv[3])
    module_tiles = count_module_tiles()
    dtype = sys.argv[4] if len(sys.argv) > 4 else "float64"
    results = {}
    routes = dtype == "routes"  # a MoE policy replaying fixed routes, padded and packed, in float64
    dtype = "float64" if routes else dtype
    # (the router's load-balancing loss is a statistic of each micro-batch's tokens, not a sum over them: off)
    runs = {k: {**OPTIONS[k], "router_aux_loss_coef": 0.0} for k in ("padded", "packed_prompts", "packed_rows")} \
        if routes else \
        {loss_type: dict(loss_type=loss_type) for loss_type in LOSS_TYPES} | OPTIONS
    if len(sys.argv) > 5:
        runs = {name: runs[name] for name in sys.argv[5].split(",")}
    for name, fields in runs.items():
        trainer = None
        world = int(__import__("os").environ.get("WORLD_SIZE", "1"))
        cfg = GRPOConfig(output_dir=f"{out}-run", optim="sgd", learning_rate=1.0, max_grad_norm=1e9, seed=0,
                         num_generations=GROUP, per_device_train_batch_size=PER_DEVICE,
                         gradient_accumulation_steps=global_accumulation // world, max_steps=1, beta=0.04,
                         max_completion_length=8, report_to=["none"], disable_tqdm=True,
                         scale_rewards="batch", gradient_checkpointing=False, model_init_kwargs={"dtype": dtype, **(EAGER_EXPERTS if routes else {})},
                         **{"loss_type": "grpo", **fields})
        trainer = GRPOTrainer(model_dir, [token_sum_reward], cfg, addition_rows(PROMPTS))
        trainer.generator = FixedGenerator(trainer.tokenizer, kept=fields.get("top_p", 1.0) < 1.0, routes=routes)
        batch = trainer._make_rollout(0)
        off_policy(trainer, batch)
        trainer.last_entropy = 0.0  # adaptive entropy: as if the previous step was below the target
        metrics = {**batch.metrics, **trainer.updater.step(batch)}
        tokens = trainer.scorer.tally()  # how micro-batches fall (and so their padding) depends on the split
        params = trainer.accelerator.get_state_dict(trainer.model) or {}  # every process gathers; ZeRO-3: rank 0 gets it
        results[name] = {"params": {k: v.detach().clone() for k, v in params.items()}, "engine": trainer.engine.name,
                         "tokens": tokens, "module_tiles": len(module_tiles),
                         "metrics": {k: v for k, v in metrics.items()
                                     if "time" not in k and k != "tokens_per_second" and not k.startswith("perf/")}}
    if trainer.accelerator.is_main_process:
        torch.save(results, out)
    accelerator = trainer.accelerator
    trainer = batch = None
    release_processes(accelerator)


if __name__ == "__main__":
    main()
