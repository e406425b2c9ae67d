"""The distillation family's configs: `DistillationConfig` (TRL 1.16's), and TRL's experimental
`GKDConfig`, `ServerDistillationConfig`, `SDFTConfig` and `GOLDConfig`, each a GRPO-family config
(generation, vLLM, packing fields) whose loss is a divergence to a teacher (rlft/train/distillation.py,
gkd.py, sdft.py). Declared as rlft/config/classes.py declares GRPO's (`option`: help, checks, facts).
"""

from typing import ClassVar

from rlft.config import self_teaching as fields
from rlft.config.common import config_class
from rlft.config.grpo_fields import _GRPOFields
from rlft.config.options import NON_NEGATIVE, POSITIVE, between, one_of, option

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
class SDFTConfig(DistillationConfig):
    """Self-distillation fine-tuning (TRL 1.16's experimental SDFTConfig names and defaults; Shenfeld
    et al. 2026, arXiv:2601.19897): the student samples completions of each prompt, and learns on
    them what it predicts when its prompt also holds the row's `privileged_context`
    (`teacher_prompt_template`); the teacher is the student itself (`teacher_model_kind`).
    rlft/train/sdft.py, rlft/core/self_distill.py."""

    num_generations: int | None = 8
    max_completion_length: int | None = 256
    max_prompt_length: int | None = 512  # the student's and the teacher's prompts (TRL's default)
    gradient_checkpointing: bool = True
    logging_steps: float = 10
    distillation_alpha: float = fields.alpha(0.5)
    distillation_mode: str = fields.mode("topk_logits")
    distillation_topk: int | None = fields.topk(100)
    distillation_is_clip: float | None = fields.is_clip()
    distillation_add_tail: bool = fields.add_tail()
    num_loss_tokens_to_skip: int = option(
        0, check=NON_NEGATIVE, help="SDFT: the first completion tokens left out of the loss")
    teacher_model_kind: str = fields.teacher_kind("base")
    teacher_update_rate: float = fields.update_rate()
    teacher_sync_steps: int = fields.sync_steps()
    generate_from_teacher: bool = option(
        False, "SDFT: sample the completions from the teacher's prompt (with the privileged context)")
    teacher_prompt_template: str = option(
        "{prompt}\n\n{privileged_context}",
        help="SDFT: the teacher's prompt from the student's (a chat prompt: its last user message's "
             "text) and the row's privileged_context")
    use_teacher_server: bool = fields.teacher_server()

    def _check(self, errors: list[str]) -> None:
        super()._check(errors)
        if self.beta != 1.0:
            errors.append(f"beta={self.beta!r} is not an SDFT setting: the divergence's mix is "
                          "distillation_alpha (TRL's name)")
        for name in ("teacher_model_name_or_path", "teacher_model_server_url", "teacher_models",
                     "teacher_server_urls"):
            if getattr(self, name):
                errors.append(f"{name} is set, but SDFT's teacher is the student itself "
                              "(teacher_model_kind); distil from another model with "
                              "DistillationTrainer")
        fields.check_self_distillation(self, errors)
        named = fields.template_fields(self.teacher_prompt_template) or set()
        if named - {"prompt", "privileged_context"} or "privileged_context" not in named:
            errors.append(f"teacher_prompt_template={self.teacher_prompt_template!r} must hold "
                          "{privileged_context} (and may hold {prompt}), no other field; write a "
                          "literal brace as {{ or }}")


_SFT_DATA = "SFTTrainer's data field: GOLD reads 'messages' or 'prompt' + 'completion' rows itself"


@config_class
class GOLDConfig(DistillationConfig):
    """TRL 1.16's experimental GOLDConfig names and defaults (GKD's mix of on-policy and fixed
    completions, rlft/train/gkd.py, with the generalized JSD taken at the sampling `temperature`), and,
    with `use_uld_loss`, cross-tokenizer distillation by the Universal Logit Distillation loss
    (rlft/core/uld.py, rlft/train/update/cross_tokenizer.py). SFTTrainer's data fields are accepted and
    change nothing (docs/migration.md)."""

    learning_rate: float = option(1e-7, "peak learning rate (TRL's GOLD default)")
    temperature: float = option(
        0.9, help="GOLD: sampling temperature, and the one both distributions are compared at")
    top_p: float = 0.95
    beta: float = option(
        0.5, help="GOLD: 0 forward KL(teacher || student), 1 reverse KL, in between the generalized "
                  "Jensen-Shannon divergence")
    max_completion_length: int | None = 128
    lmbda: float = option(
        0.5, check=between(0, 1, note=": the probability of a step on the student's own completions"),
        help="GOLD: the probability that a step trains on the student's own completions")
    seq_kd: bool = option(False, "GOLD: the fixed completions are the teacher's own")
    shuffle_dataset: bool = False
    vllm_server_port: int = 8001
    vllm_gpu_memory_utilization: float = 0.9
    teacher_tokenizer_name_or_path: str | None = option(
        None, "GOLD with use_uld_loss: the teacher's tokenizer (hub id or folder; default: the teacher's "
              "own folder)")
    use_uld_loss: bool = option(
        False, "GOLD: cross-tokenizer distillation by the Universal Logit Distillation loss "
               "(rlft/core/uld.py) instead of the generalized JSD: the teacher may have another tokenizer")
    use_extended_uld: bool = option(
        True, "ULD: align the two tokenizations by the bytes each token covers and merge split tokens "
              "(ByteLevel BPE tokenizers); false: pair tokens by position, as the ULD paper")
    uld_token_merge_strategy: str = option(
        "observed", check=one_of(("observed", "bayesian")),
        help="ULD: a group of tokens is the first token's distribution times the later tokens' "
             "probabilities (observed) or the last token's times the earlier ones' (bayesian)")
    uld_use_hybrid_loss: bool = option(
        False, "ULD: token strings both vocabularies hold compared entry by entry (generalized JSD at "
               "beta), the rest by sorted probabilities")
    uld_hybrid_matched_weight: float | None = option(
        None, "ULD hybrid: the matched part's weight (None with the unmatched one: the matched share "
              "of the teacher's vocabulary)")
    uld_hybrid_unmatched_weight: float | None = option(
        None, "ULD hybrid: the unmatched part's weight (set with uld_hybrid_matched_weight)")
    uld_crossentropy_weight: float = option(
        0.0, check=NON_NEGATIVE, help="ULD: weight of the student's cross-entropy on its completion tokens")
    uld_distillation_weight: float = option(
        1.0, check=NON_NEGATIVE, help="ULD: weight of the distillation term")
    uld_student_temperature: float = option(
        1.0, check=POSITIVE, help="ULD: the student's softmax temperature")
    uld_teacher_temperature: float = option(
        1.0, check=POSITIVE, help="ULD: the teacher's softmax temperature")
    uld_skip_student_eos: bool = option(True, "ULD: leave the student's EOS token out of the comparison")
    uld_skip_teacher_eos: bool = option(True, "ULD: leave the teacher's EOS token out of the comparison")
    vllm_sync_frequency: int = option(
        1, refused="rlft syncs a vLLM engine's weights after every applied optimiser step")
    log_completions_steps: int = option(
        100, no_effect="completions are logged at every logging step (log_completions, "
                       "num_completions_to_log)")
    wandb_log_unique_prompts: bool = option(True, no_effect="rlft logs every completion row")
    callbacks: list[str] = option(
        default_factory=list,
        refused="callbacks by name are not looked up: pass callback objects to the trainer's "
                "callbacks=")
    dataset_text_field: str = option("text", no_effect=_SFT_DATA)
    dataset_kwargs: dict | str | None = option(None, no_effect=_SFT_DATA)
    dataset_num_proc: int | None = option(None, no_effect=_SFT_DATA)
    max_length: int | None = option(1024, no_effect=_SFT_DATA + " (max_completion_length caps completions)")
    truncation_mode: str = option("keep_start", no_effect=_SFT_DATA)
    packing: bool = option(False, no_effect=_SFT_DATA + " (padding_free packs scoring forwards)")
    packing_strategy: str = option("bfd", no_effect=_SFT_DATA)
    eval_packing: bool | None = option(None, no_effect=_SFT_DATA)
    completion_only_loss: bool | None = option(None, no_effect=_SFT_DATA + " (the loss is over completions)")
    assistant_only_loss: bool = option(False, no_effect=_SFT_DATA + " (the loss is over completions)")

    def _check(self, errors: list[str]) -> None:
        super()._check(errors)
        self._check_uld(errors)
        if self.num_generations != 1:
            errors.append(f"num_generations={self.num_generations!r}: GOLD here trains one completion "
                          "per prompt (the dataset's and the teacher's are one each); leave it at 1")
        if self.seq_kd and self.teacher_model_server_url:
            errors.append("seq_kd=True generates with the teacher, which a served teacher does not do "
                          "here: load the teacher locally, or set seq_kd: false")

    def _check_uld(self, errors: list[str]) -> None:
        matched, unmatched = self.uld_hybrid_matched_weight, self.uld_hybrid_unmatched_weight
        if (matched is None) != (unmatched is None):
            errors.append("uld_hybrid_matched_weight and uld_hybrid_unmatched_weight are set together "
                          f"(both numbers) or both left None (weights from the vocabularies' overlap); got "
                          f"{matched!r} and {unmatched!r}")
        elif matched is not None and min(matched, unmatched) < 0:
            errors.append("uld_hybrid_matched_weight / uld_hybrid_unmatched_weight must be >= 0")
        if not self.use_uld_loss:
            return
        for name, why in (("seq_kd", "the teacher's completions are in its own tokens"),
                          ("teacher_model_server_url", "ULD needs the teacher's whole distribution"),
                          ("teacher_models", "one teacher and one tokenizer"),
                          ("teacher_server_urls", "one teacher and one tokenizer")):
            if getattr(self, name):
                errors.append(f"{name} is set with use_uld_loss: {why}; leave {name} out")
