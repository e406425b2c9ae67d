"""`rlft doctor`: a preflight that finds in seconds what a run would otherwise find after hours.

It builds the real trainer from the config (so every input check runs), then on one or two
prompts/pairs runs generation, every reward function and one forward/backward, and reports
each check as PASS / WARN / FAIL with what to do. Exit code 1 when any check fails.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

import torch
import yaml
from rich.console import Console
from rich.table import Table

from rlft.config import GRPOConfig, RewardConfig

TRAPS_GRPO = [
    ("loss shows 0", "expected with one update per rollout; rlft logs grad_norm and "
                     "frac_reward_zero_std and says which case you are in "
                     "(docs/troubleshooting.md)"),
    ("'element 0 of tensors does not require "
     "grad'", "rlft enables input grads for checkpointing and checks "
                                                     "gradient flow after the first backward"),
    ("loss normalisation", "explicit loss_type; KL added per token before aggregation; normalisers "
                           "global over accumulation and processes (docs/losses.md)"),
    ("curves differ from "
     "docs", "every figure in docs/ is produced by a command written next to it"),
]
TRAPS_REWARD = [
    ("LoRA reward model head "
     "frozen", "rlft sets task_type SEQ_CLS and checks the head is trainable"),
    ("fp16 loss blow-up", "scores and loss in float32; float16 weights get float32 master copies; "
                          "non-finite steps are skipped and counted"),
]


@dataclasses.dataclass
class Report:
    rows: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)

    def add(self, status: str, check: str, detail: str) -> None:
        self.rows.append((status, check, detail))

    @property
    def failed(self) -> bool:
        return any(status == "FAIL" for status, _, _ in self.rows)

    def text(self) -> str:
        return "\n".join(f"{s} {c}: {d}" for s, c, d in self.rows)

    def show(self, console: Console) -> None:
        table = Table(title="rlft doctor", show_lines=False)
        for column in ("status", "check", "detail"):
            table.add_column(column, overflow="fold")
        colours = {"PASS": "green", "WARN": "yellow", "FAIL": "bold red", "INFO": "cyan"}
        for status, check, detail in self.rows:
            table.add_row(f"[{colours[status]}]{status}[/]", check, detail)
        console.print(table)


def detect_kind(config_path: str | None) -> str:
    if config_path is None:
        return "grpo"
    values = yaml.safe_load(Path(config_path).read_text()) or {}
    reward_only = ({f.name for f in dataclasses.fields(RewardConfig)}
                   - {f.name for f in dataclasses.fields(GRPOConfig)})
    if reward_only & set(values) or values.get("lora_task_type") == "SEQ_CLS":
        return "reward"
    # a teacher without GRPO's teacher term or reward functions: a distillation recipe
    teacher = values.get("teacher_model_name_or_path") or values.get("teacher_model_server_url")
    distills = teacher and not values.get("teacher_coef")
    return "distillation" if distills and not values.get("reward_funcs") else "grpo"


@dataclasses.dataclass
class Run:
    """What `rlft grpo` / `rlft reward` would build from the config (rlft/cli/recipes.py), for the
    checks."""

    script: Any
    cfg: Any
    model_args: Any
    mixture: Any

    def dataset(self, given, rows: int):
        from rlft.cli.recipes import recipe_datasets
        from rlft.data.prompts import load_dataset_any

        dataset = load_dataset_any(given if given is not None
                                   else recipe_datasets(self.script, self.cfg, self.mixture)[0])
        return dataset.select(range(min(len(dataset), rows)))

    def small(self, per_device: int):
        """The config for a one-step trial: whole data in one micro-batch, no tracker, a scratch
        folder."""
        from rlft.config.model_config import model_init_kwargs

        return dataclasses.replace(self.cfg, per_device_train_batch_size=per_device,
                                   gradient_accumulation_steps=1, max_steps=1, report_to=[],
                                   disable_tqdm=True,
                                   model_init_kwargs=model_init_kwargs(self.model_args, self.cfg),
                                   output_dir=tempfile.mkdtemp(prefix="rlft-doctor-"))


def _tokenizer_checks(report: Report, source: Any, tokenizer, needs_chat: bool) -> None:
    from transformers import AutoTokenizer

    raw = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(str(source))
    if raw.pad_token is None:
        report.add("FAIL", "pad token", f"the tokenizer has no pad token (eos={raw.eos_token!r}). "
                   "Padding with eos hides where sequences end (a reward model scores the wrong "
                   "token); add a distinct pad token: "
                   "tokenizer.add_special_tokens({'pad_token': '<pad>'}) and resize the embeddings")
    else:
        report.add("PASS", "pad token", f"pad={raw.pad_token!r} eos={raw.eos_token!r}")
    has_template = bool(getattr(raw, "chat_template", None))
    status = "FAIL" if needs_chat and not has_template else ("PASS" if has_template else "INFO")
    report.add(status, "chat template", "present" if has_template else
               "none (BERT-style or base model): plain-text data only" + (
                   "; the dataset is conversational, so this run cannot render "
                   "it" if needs_chat else ""))


def _summarise_trainable(model) -> str:
    groups: dict[str, int] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            key = ".".join(p for p in name.removeprefix("base_model.model.").split(".") if not p.isdigit())
            groups[key] = groups.get(key, 0) + param.numel()
    total = sum(groups.values())
    shown = ", ".join(f"{k} ({v:,})" for k, v in list(groups.items())[:4])
    return f"{total:,} trainable: {shown}{' ...' if len(groups) > 4 else ''}"


def _grad_check(report: Report, model, backward) -> None:
    from rlft.model.loading import GradientFlowError, check_gradient_flow

    try:
        backward()
        check_gradient_flow(model)
        report.add("PASS", "gradient flow", "every trainable parameter got a finite gradient")
    except (GradientFlowError, RuntimeError) as err:
        report.add("FAIL", "gradient flow", str(err))


def doctor_grpo(run: Run, report: Report, model=None, reward_funcs=None, train_dataset=None,
                tokenizer=None) -> None:
    from rlft.config.model_config import get_peft_config
    from rlft.core.losses import policy_loss
    from rlft.data.prompts import is_conversational
    from rlft.train.grpo import GRPOTrainer

    source = model if model is not None else run.model_args.model_name_or_path
    dataset = run.dataset(train_dataset, 2)
    _tokenizer_checks(report, getattr(source, "name_or_path", source), tokenizer,
                      is_conversational(dataset[0].get("prompt")))
    cfg = run.small(run.cfg.num_generations * len(dataset))
    if reward_funcs is None:
        reward_funcs = [*filter(None, [run.script.reward_model_name_or_path]),
                        *(run.script.reward_funcs or [])]
    trainer = GRPOTrainer(source, reward_funcs, cfg, dataset, processing_class=tokenizer,
                          peft_config=get_peft_config(run.model_args))
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    report.add("PASS", "model", f"{type(unwrapped).__name__}, "
                                f"{'LoRA' if trainer.is_peft else 'full'}; "
               + _summarise_trainable(unwrapped))
    dtype = next(unwrapped.parameters()).dtype
    report.add("INFO", "dtype", f"weights {dtype}; log-probs and loss float32")
    batch = trainer._make_rollout(0)
    report.add("INFO", "machine", f"matmul peak {trainer.throughput.peak / 1e9:,.0f} GFLOP/s in "
               f"{dtype} on {trainer.accelerator.device} (measured: a square matmul, best of 5); "
               f"this rollout used {batch.metrics['perf/mfu_generation']:.2g}% of it "
               "(perf/mfu_* metrics are against this peak)")
    sample = batch.samples[0]
    report.add("PASS", "generation",
               f"{len(batch.samples)} completions, e.g. {str(sample['completion'])[:80]!r}")
    zero = batch.metrics["frac_reward_zero_std"]
    spread = ", ".join(f"{n} std {batch.metrics[f'rewards/{n}/std']:.3g}" for n in trainer.reward_names)
    report.add("FAIL" if zero >= 1.0 else ("WARN" if zero > 0.5 else "PASS"), "reward spread",
               f"{zero:.0%} of groups have zero spread ({spread})" + (
                   ": no learning signal at all; advantages and gradients would be 0. Make rewards "
                   "graded, the task easier, or raise "
                   "num_generations/temperature" if zero >= 1.0 else ""))
    signs = torch.tensor([1.0, -1.0]).repeat(batch.advantages.numel() // 2 + 1)[: batch.advantages.numel()]

    def backward():  # synthetic +-1 advantages: tests the wiring whatever the rewards were
        logps = trainer.scorer.forward(trainer.model, batch.rollout, slice(0, None))[0]
        mask = batch.rollout.completion_mask[:, :logps.shape[1]]
        loss, _ = policy_loss(logps, logps.detach(), signs, mask, loss_type=cfg.loss_type)
        loss.backward()

    _grad_check(report, unwrapped, backward)
    _truncation_check(report, cfg)
    _drift_check(report, cfg, dtype, unwrapped.config)
    if cfg.use_vllm:
        _vllm_checks(report, trainer, batch.rollout, unwrapped)
    report.add("INFO", "loss", f"loss_type={cfg.loss_type!r}, beta={cfg.beta}, "
               f"importance_sampling_level={cfg.importance_sampling_level!r} (formulas: "
               "docs/losses.md)")
    for trap, remedy in TRAPS_GRPO:
        report.add("INFO", f"trap: {trap}", remedy)


def _truncation_check(report: Report, cfg) -> None:
    """Sampling that truncates (top_p / top_k / min_p) while the trainer scores the full
    vocabulary."""
    from rlft.config.rules import replay_plan, truncation

    cut, (replayed, why) = truncation(cfg), replay_plan(cfg)
    if not cut.truncates:
        return
    if replayed:
        report.add("PASS", "truncated sampling", f"top_k={cut.top_k}, top_p={cut.top_p}, "
                                                 f"min_p={cut.min_p}: "
                   "the trainer renormalises over the tokens the sampler kept (ratio 1 on-policy)")
        return
    why = why or (f"top_k={cut.top_k}, top_p={cut.top_p}, min_p={cut.min_p} with "
                  "replay_sampling_mask: false: the trainer scores the full vocabulary, so "
                  "importance ratios carry the kept mass")
    report.add("WARN", "truncated sampling", why + "; docs/vllm.md#truncated-sampling")


def _drift_check(report: Report, cfg, trainer_dtype, model_config) -> None:
    """Configurations known to make the sampler a different policy from the trainer with nothing
    correcting it: an engine in another precision without vllm_importance_sampling_correction, and a
    mixture-of-experts policy whose sampler's routes are not replayed (routing_replay: none): the two
    then route tokens to different experts."""
    trainer_name = str(trainer_dtype).split(".")[-1]
    quantized = getattr(cfg, "vllm_quantization", None)
    engine = [f"vllm_dtype={cfg.vllm_dtype}"] * (cfg.vllm_dtype not in ("auto", trainer_name)) + \
        [f"vllm_quantization={quantized}"] * bool(quantized)
    if cfg.use_vllm and engine and not cfg.vllm_importance_sampling_correction:
        report.add("WARN", "sampler precision", f"{' and '.join(engine)} samples from other weights than the "
                   f"{trainer_name} ones the trainer scores, and "
                   "vllm_importance_sampling_correction is off: the rollouts are off-policy by the "
                   "precision gap and nothing weighs it. Set vllm_importance_sampling_correction: "
                   "true (watch sampling/kl_sampler_trainer/k3), or vllm_dtype: auto and no "
                   "vllm_quantization")
    experts = getattr(model_config, "num_experts", None) or getattr(model_config, "num_local_experts", None)
    if experts and getattr(cfg, "routing_replay", "auto") == "none":
        report.add("WARN", "mixture of experts",
                   f"{experts} experts with routing_replay: none: the trainer may route a token to "
                   "other experts than the sampler did; leave routing_replay at auto (docs/moe.md)")


def _engine_mismatch(trainer, rollout) -> float:
    """Max |trainer log-prob - engine log-prob| over the engine's own sampled tokens."""
    trainer.model.eval()
    logps = trainer.scorer.logps(trainer.model, rollout)
    trainer.model.train()
    return (logps - rollout.sampling_logps)[rollout.completion_mask.bool()].abs().max().item()


def _vllm_checks(report: Report, trainer, rollout, unwrapped) -> None:
    """The engine started and generated (above); its log-probs match the trainer's before and after
    one real optimiser step (the gradients of the gradient-flow check), i.e. the weight sync
    works."""
    # inside a tool loop
    args, generator = trainer.args, getattr(trainer.generator, "engine", trainer.generator)
    exact = generator.dtype == next(unwrapped.parameters()).dtype == torch.float32
    report.add("PASS", "vLLM engine",
               f"{args.vllm_mode} mode, engine dtype {str(generator.dtype).split('.')[-1]}")
    before = _engine_mismatch(trainer, rollout)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad()
    generator.on_weights_changed()
    prompts = trainer.train_prompts.batch([0])["prompt_ids"]
    after = _engine_mismatch(trainer, generator(unwrapped, prompts, args.num_generations))
    detail = (f"max |trainer - engine| log-prob: {before:.2g} at the start, "
              f"{after:.2g} after one optimiser step")
    if not exact:
        report.add("INFO", "vLLM weight sync", detail + " (engine and trainer dtypes differ: "
                   "expected; vllm_importance_sampling_correction weighs it)")
    elif max(before, after) < 1e-4:
        report.add("PASS", "vLLM weight sync", detail)
    else:
        report.add("FAIL", "vLLM weight sync", detail + ": the engine does not hold the trainer's "
                   "weights (with dropout on, set disable_dropout: true; else report it with this "
                   "output)")


def doctor_reward(run: Run, report: Report, model=None, train_dataset=None, tokenizer=None) -> None:
    from rlft.config.model_config import get_peft_config
    from rlft.data.prompts import is_conversational
    from rlft.train.reward import RewardTrainer

    source = model if model is not None else run.model_args.model_name_or_path
    dataset = run.dataset(train_dataset, 4)
    _tokenizer_checks(report, getattr(source, "name_or_path", source), tokenizer,
                      is_conversational(dataset[0].get("chosen")))
    model_args = run.model_args
    if model_args.use_peft and model_args.lora_task_type != "SEQ_CLS":
        report.add("FAIL", "LoRA task type", f"lora_task_type={model_args.lora_task_type!r}: "
                   "with peft alone the score head would stay frozen at its random init. "
                   "rlft sets SEQ_CLS when training, but make the config say so: lora_task_type: "
                   "SEQ_CLS")
    trainer = RewardTrainer(source, run.small(len(dataset)), train_dataset=dataset,
                            processing_class=tokenizer, peft_config=get_peft_config(model_args))
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    report.add("PASS", "score head trainable", ", ".join(trainer.head_parameters[:3]))
    report.add("PASS", "model", _summarise_trainable(unwrapped))
    report.add("INFO", "dtype", f"weights {next(unwrapped.parameters()).dtype}; scores and loss "
                                "float32")
    batch = trainer.train_pairs.batch(list(range(len(trainer.train_pairs))), trainer.tokenizer.pad_token_id)
    _grad_check(report, unwrapped, lambda: trainer._pair_loss(batch)[0].backward())
    for trap, remedy in TRAPS_REWARD:
        report.add("INFO", f"trap: {trap}", remedy)


def doctor_distillation(run: Run, report: Report, model=None, train_dataset=None, tokenizer=None,
                        teacher_model=None) -> None:
    """What `rlft distillation` would build: student and teacher load and share a vocabulary, one
    rollout, and the divergence's gradient reaches every trainable parameter."""
    from rlft.config.model_config import get_peft_config, teacher_init_kwargs
    from rlft.data.prompts import is_conversational
    from rlft.train.distillation import DistillationTrainer

    source = model if model is not None else run.model_args.model_name_or_path
    dataset = run.dataset(train_dataset, 2)
    _tokenizer_checks(report, getattr(source, "name_or_path", source), tokenizer,
                      is_conversational(dataset[0].get("prompt")))
    cfg = run.small(len(dataset) * run.cfg.num_generations)
    cfg.teacher_model_init_kwargs = teacher_init_kwargs(run.model_args, cfg)
    trainer = DistillationTrainer(source, teacher_model, cfg, dataset, processing_class=tokenizer,
                                  peft_config=get_peft_config(run.model_args))
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    teacher = trainer.teacher_model
    kind = "LoRA" if trainer.is_peft else "full"
    report.add("PASS", "models", f"student {type(unwrapped).__name__} ({kind}; "
               f"{_summarise_trainable(unwrapped)}), teacher {type(teacher).__name__}, one "
               "vocabulary")
    batch = trainer._make_rollout(0)
    report.add("PASS", "generation", f"{len(batch.samples)} completions, e.g. "
               f"{str(batch.samples[0]['completion'])[:80]!r}")

    def backward():
        rollout = batch.rollout
        divergence = trainer.scorer.divergence(rollout, slice(0, None), cfg.beta)[0]
        (divergence * rollout.loss_mask[:, :divergence.shape[1]]).sum().backward()

    _grad_check(report, unwrapped, backward)
    report.add("INFO", "loss", f"beta={cfg.beta} (0 forward KL, 1 reverse KL, between: generalized "
               f"JSD), temperature={cfg.temperature} (docs/distillation.md)")


DOCTORS = {"grpo": doctor_grpo, "rloo": doctor_grpo, "reward": doctor_reward,
           "distillation": doctor_distillation}


def run_doctor(config_path: str | None = None, kind: str = "auto", argv: list[str] | None = None,
               console: Console | None = None, overrides: dict | None = None,
               **objects) -> tuple[int, Report]:
    """Run every check; `argv` holds --field value options, `overrides` a dict of them; objects
    (model=, reward_funcs=, train_dataset=, tokenizer=) replace the config's."""
    from rlft.cli.recipes import parse_run

    kind = detect_kind(config_path) if kind == "auto" else kind
    report = Report()
    try:
        *parsed, notes = parse_run(kind, argv or [], config_path, overrides)
        report.add("PASS", "config", f"{kind} config is valid" + "".join(f"; {n}" for n in notes))
        DOCTORS[kind](Run(*parsed), report, **objects)
    except Exception as err:  # every failure becomes a report row, never a traceback
        report.add("FAIL", type(err).__name__, str(err))
    report.show(console or Console())
    return (1 if report.failed else 0), report
