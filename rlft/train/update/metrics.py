"""Metric bookkeeping for the GRPO loop: rollout statistics, per-step sums reduced across
processes, and averaging over the steps between two log lines."""

from __future__ import annotations

import logging
import math

import torch

from rlft.model.routing import route_state

# a window shows the latest value, not a mean
LAST_KEYS = ("num_tokens", "steps_skipped", "nonfinite_skipped", "learning_rate", "ref_model/syncs")
TOKEN_MEAN_KEYS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                   "clip_ratio/delta_mean", "ratio_mean", "kl", "sampling/kept_mass/mean",
                   "distill/teacher_entropy", "teacher/reverse_kl",
                   "self_distillation/distillation_loss")
SEQUENCE_MEAN_KEYS = ("off_policy/masked_fraction", "vespo/phi_seq_mean", "aux_loss")
CLIP_MEAN_KEYS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
# parts of the loss, summed over micro-batches like it
SHARE_KEYS = ("kl_loss", "entropy_loss", "router_loss", "teacher_loss", "distill_loss")


def rollout_metrics(rewards: torch.Tensor, total: torch.Tensor, lengths: torch.Tensor,
                    truncated: torch.Tensor, weights: torch.Tensor, names: list[str],
                    stats: dict[str, float]) -> dict[str, float]:
    """Reward (total and per function, weighted as used), spread and completion-length statistics,
    over the rollout of every process. `reward_std` is TRL's: the std of the total reward over the
    batch."""
    valid_total = total[~torch.isnan(total)]
    metrics = {"reward": torch.nanmean(total).item(), "completions/count": float(total.numel()), **stats,
               "reward_std": valid_total.std().item() if valid_total.numel() > 1 else 0.0}
    if not names:  # no reward function (distillation): no reward, spread or advantage to show
        metrics = {"completions/count": float(total.numel())}
    for index, name in enumerate(names):
        weighted = rewards[:, index] * weights[index]
        valid = weighted[~torch.isnan(weighted)]
        metrics[f"rewards/{name}/mean"] = valid.mean().item() if valid.numel() else float("nan")
        metrics[f"rewards/{name}/std"] = valid.std().item() if valid.numel() > 1 else 0.0
    metrics.update({
        "completions/mean_length": lengths.mean().item(),
        "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
        "completions/clipped_ratio": truncated.float().mean().item(),
    })
    # TRL logs 0 when none ended
    terminated = lengths[~truncated] if (~truncated).any() else lengths.new_zeros(1)
    metrics.update({"completions/mean_terminated_length": terminated.mean().item(),
                    "completions/min_terminated_length": terminated.min().item(),
                    "completions/max_terminated_length": terminated.max().item()})
    return metrics


def tool_metrics(stats: dict[str, torch.Tensor], accelerator) -> dict[str, float]:
    """Tool-calling rollouts, over every process: calls per completion and the failed share of calls
    (TRL's tools/call_frequency and tools/failure_frequency), turns per completion, and the share of
    completions that stopped with a tool call unanswered (max_tool_calling_iterations or the
    completion budget reached)."""
    if not stats:
        return {}
    local = torch.tensor([stats[k].sum().item()
                          for k in ("tool_calls", "tool_failures", "turns", "hit_limit")]
                         + [float(stats["turns"].numel())], dtype=torch.float64, device=accelerator.device)
    calls, failures, turns, limited, rows = (accelerator.reduce(local, "sum") if accelerator.num_processes > 1
                                             else local).tolist()
    return {"tools/call_frequency": calls / rows,
            "tools/failure_frequency": failures / calls if calls else 0.0,
            "tools/turns_mean": turns / rows, "tools/hit_limit_fraction": limited / rows}


class StepSums:
    """Loss shares summed over micro-batches; token-mean metrics weighted by token counts,
    sequence-mean metrics by completion counts."""

    def __init__(self, sequence_keys: tuple[str, ...] = ()):
        # token-mean keys this loss reports per sequence (RLOO's clips)
        self.sequence_keys = sequence_keys
        self.loss = 0.0
        self.shares = dict.fromkeys(SHARE_KEYS, 0.0)
        self.tokens = 0.0
        self.sequences = 0.0
        self.weighted: dict[str, float] = {}
        # over micro-batches (and processes, in reduce)
        self.low_min, self.high_max = math.inf, -math.inf

    def add(self, loss: torch.Tensor, metrics: dict[str, torch.Tensor], entropy: torch.Tensor | None,
            mask: torch.Tensor) -> None:
        tokens, sequences = mask.sum().item(), float(mask.shape[0])
        self.loss += loss.item()
        for key in SHARE_KEYS:
            self.shares[key] += metrics[key].item() if key in metrics else 0.0
        self.tokens += tokens
        self.sequences += sequences
        values = {k: metrics[k].item() for k in TOKEN_MEAN_KEYS
                  if k in metrics and k not in self.sequence_keys}
        # over completions, so independent of how the step is split
        if "clip_ratio/low_min" in metrics:
            self.low_min = min(self.low_min, metrics["clip_ratio/low_min"].item())
            self.high_max = max(self.high_max, metrics["clip_ratio/high_max"].item())
        if entropy is not None:
            values["entropy"] = ((entropy * mask).sum() / mask.sum().clamp(min=1)).item()
        for key, value in values.items():
            self.weighted[key] = self.weighted.get(key, 0.0) + value * tokens
        for key in (*SEQUENCE_MEAN_KEYS, *self.sequence_keys):
            if key in metrics:
                self.weighted["seq:" + key] = (self.weighted.get("seq:" + key, 0.0)
                                               + float(metrics[key]) * sequences)

    def reduce(self, accelerator) -> dict[str, float]:
        keys = sorted(self.weighted)
        local = torch.tensor([self.loss, self.tokens, self.sequences] + [self.shares[k] for k in SHARE_KEYS]
                             + [self.weighted[k] for k in keys], dtype=torch.float64,
                             device=accelerator.device)
        summed = accelerator.reduce(local, "sum") if accelerator.num_processes > 1 else local
        loss, tokens, sequences, *rest = summed.tolist()
        shares, weighted = dict(zip(SHARE_KEYS, rest[:len(SHARE_KEYS)])), rest[len(SHARE_KEYS):]
        # TRL's policy_loss: the loss before the entropy bonus and the MoE router term (the KL term
        # included); rlft's teacher term is outside it too
        out = {"loss": loss, "policy_loss": loss - shares["entropy_loss"] - shares["router_loss"]
               - shares["teacher_loss"] - shares["distill_loss"]}
        for key in ("entropy_loss", "teacher_loss", "distill_loss"):
            if shares[key]:
                out[key] = shares[key]
        for key, value in zip(keys, weighted):
            if key.startswith("seq:"):
                out[key[4:]] = value / max(sequences, 1.0)
            else:
                out[key] = value / max(tokens, 1.0)
        extremes = torch.tensor([self.low_min, -self.high_max], dtype=torch.float64,
                                device=accelerator.device)
        if accelerator.num_processes > 1:
            import torch.distributed as dist

            dist.all_reduce(extremes, op=dist.ReduceOp.MIN)
        if math.isfinite(extremes[0].item()):
            out["clip_ratio/low_min"], out["clip_ratio/high_max"] = extremes[0].item(), -extremes[1].item()
        return out


def correction_metrics(parts: list[dict[str, torch.Tensor]], accelerator) -> dict[str, float]:
    """The sampler/trainer mismatch of one optimiser step, over every micro-batch and process, with
    TRL's names (`sampling/...`), plus the fraction of weights a *_mask mode set to zero."""
    device = accelerator.device
    sums = torch.stack([torch.stack([p[k].to(device).float() for k in (
        "delta_sum", "delta_count", "ratio_sum", "ratio_count", "zeroed", "outside", "kl_k1_sum", "kl_k3_sum",
        "rho_squared_sum", "clipped")]) for p in parts])
    highs = torch.stack([torch.stack([p["delta_max"].to(device).float(), p["ratio_max"].to(device).float(),
                                      -p["ratio_min"].to(device).float()]) for p in parts]).max(dim=0).values
    sums = sums.sum(dim=0)
    if accelerator.num_processes > 1:
        sums = accelerator.reduce(sums, "sum")
        highs = accelerator.gather(highs[None]).max(dim=0).values
    delta_sum, delta_count, ratio_sum, ratio_count, zeroed, outside, k1, k3, rho2, clipped = sums.tolist()
    tokens = max(delta_count, 1)
    return {"sampling/sampling_logp_difference/mean": delta_sum / max(delta_count, 1),
            "sampling/sampling_logp_difference/max": highs[0].item(),
            "sampling/importance_sampling_ratio/min": -highs[2].item(),
            "sampling/importance_sampling_ratio/mean": ratio_sum / max(ratio_count, 1),
            "sampling/importance_sampling_ratio/max": highs[1].item(),
            "sampling/importance_sampling_zeroed_fraction": zeroed / max(ratio_count, 1),
            # weights (tokens, or sequences for a per-sequence mode) a truncating bound moved
            "sampling/importance_sampling_clipped_fraction": clipped / max(ratio_count, 1),
            # per token, before any bound: how far the trainer's distribution is from the sampler's
            "sampling/importance_sampling_ratio/outside_fraction": outside / tokens,
            # KL(sampler || trainer) per token (k1, k3) and the chi-square divergence:
            # rlft/core/importance.py
            "sampling/kl_sampler_trainer/k1": k1 / tokens, "sampling/kl_sampler_trainer/k3": k3 / tokens,
            "sampling/chi2_token": rho2 / tokens - 1.0 if delta_count else 0.0}


class MetricWindow:
    """Averages numeric metrics over the steps since the last flush (what one log line shows)."""

    def __init__(self):
        self.rows: list[dict[str, float]] = []
        self.last: dict[str, float] = {}

    def add(self, metrics: dict[str, float]) -> None:
        self.rows.append(metrics)
        self.last = metrics

    def flush(self) -> dict[str, float]:
        keys = {k for row in self.rows for k in row}
        out = {}
        for key in sorted(keys):
            values = [row[key] for row in self.rows if key in row and not _is_nan(row[key])]
            if key in LAST_KEYS:
                out[key] = values[-1] if values else float("nan")
            elif "/min_" in key or key.endswith("_min"):
                out[key] = min(values) if values else float("nan")
            elif "/max_" in key or key.endswith("_max"):
                out[key] = max(values) if values else float("nan")
            else:
                out[key] = sum(values) / len(values) if values else float("nan")
        self.rows = []
        return out


def _is_nan(value) -> bool:
    return isinstance(value, float) and math.isnan(value)


def route_metrics(model, accelerator, rollout=None) -> dict[str, float]:
    """Routing replay (rlft/model/routing.py), over every process: the share of replayed (token, layer)
    expert choices the trainer's router would have made itself this step, and the share of the
    sampler-fed completion tokens (each row's last one is never fed) whose route the sampler reported
    (`rollout`'s). {} for a model that replays nothing. A sampler that reports fewer than 99% is warned
    about once: the others route freely."""
    state = route_state(model)
    if state is None:
        return {}
    recorded = expected = 0.0
    if rollout is not None and rollout.completion_routes is not None:
        fed = rollout.completion_mask.bool().clone()
        fed[torch.arange(fed.shape[0]), fed.sum(1).clamp(min=1) - 1] = False
        routes = rollout.completion_routes[:, :fed.shape[1], 0, 0].to(fed.device)
        recorded, expected = float((fed[:, :routes.shape[1]] & (routes >= 0)).sum()), float(fed.sum())
    counts = torch.tensor([*state.take_counts(), recorded, expected], dtype=torch.float64,
                          device=accelerator.device)
    if accelerator.num_processes > 1:
        counts = accelerator.reduce(counts, "sum")
    agree, compared, recorded, expected = counts.tolist()
    out = {"sampling/route_agreement": agree / compared} if compared else {}
    if expected:
        out["sampling/routes_recorded"] = recorded / expected
        if recorded / expected < 0.99 and not state.said_missing:
            state.said_missing = True
            logging.getLogger("rlft").warning(
                "routing replay: the sampler reported routes for %.1f%% of the completion tokens it fed; "
                "the trainer routes the others freely. A vLLM engine on a GPU replaying CUDA graphs skips "
                "rlft's route recorder: set vllm_enforce_eager: true, or start `rlft vllm-serve` with "
                "--enforce-eager (docs/moe.md#vllm)", 100 * recorded / expected)
    return out
