"""A trained sequence-classification reward model used as a GRPO reward function.

It scores prompt + completion with its own tokenizer (which need not match the policy's),
rendering chat prompts with its own chat template when it has one.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rlft.model.loading import ensure_pad_token, load_sequence_classifier, load_tokenizer, resolve_dtype


class RewardModelScorer:
    """Callable reward: `scorer(prompts=..., completions=...) -> list[float]`.

    `model`: a folder, a hub model id, or a loaded sequence-classification model (TRL's reward_funcs
    entries); `tokenizer`: its processing class (TRL's reward_processing_classes), else loaded with
    it."""

    def __init__(self, model, tokenizer=None, batch_size: int = 16, max_length: int | None = None):
        source = (model if isinstance(model, str | Path)
                  else getattr(model, "name_or_path", "") or "reward_model")
        self.__name__ = Path(str(source)).name
        if tokenizer is None:
            tokenizer = load_tokenizer(source, padding_side="right")
        self.tokenizer = ensure_pad_token(tokenizer, str(source))
        self.tokenizer.padding_side = "right"
        self.model = load_sequence_classifier(model, resolve_dtype("auto"), self.tokenizer.pad_token_id)
        self.model.eval().requires_grad_(False)
        if torch.cuda.is_available() and not isinstance(model, torch.nn.Module):
            self.model.to("cuda")
        self.batch_size = batch_size
        self.max_length = max_length or getattr(self.model.config, "max_position_embeddings", None)

    def _text(self, prompt, completion) -> str:
        if isinstance(prompt, list):
            if not getattr(self.tokenizer, "chat_template", None):
                turns = [m["content"] for m in prompt] + [completion if isinstance(completion, str)
                                                          else completion[-1]["content"]]
                return "\n".join(turns)
            reply = (completion if isinstance(completion, list)
                     else [{"role": "assistant", "content": completion}])
            return self.tokenizer.apply_chat_template(prompt + reply, tokenize=False)
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        return prompt + text

    @torch.no_grad()
    def __call__(self, prompts, completions, **kwargs) -> list[float]:
        texts = [self._text(p, c) for p, c in zip(prompts, completions)]
        device = next(self.model.parameters()).device
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(texts[start:start + self.batch_size], return_tensors="pt", padding=True,
                                 truncation=self.max_length is not None,
                                 max_length=self.max_length).to(device)
            scores += self.model(**enc).logits[:, 0].float().tolist()
        return scores
