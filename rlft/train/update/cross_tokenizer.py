"""A teacher with another tokenizer (GOLD with `use_uld_loss`; the loss: rlft/core/uld.py).

For each scored row the teacher reads its own tokens: the student's prompt as text (its special tokens
kept, as TRL's GOLD gives the teacher `original_prompt_text`), tokenized by the teacher's tokenizer
with its special tokens and without a trailing EOS, then the student's completion as text tokenized by
the teacher, then the teacher's EOS where the student's completion ended with one. The completion's
text is built from the student's tokens themselves: each token's UTF-8 bytes (a ByteLevel BPE piece
maps one character to one byte; an added token is its content; a special token, EOS included, is
zero-width), so each student token's byte span is exact, with no decode / re-encode round trip; the
teacher's spans come from its own tokens the same way. Both tokenizers must be ByteLevel for the byte
alignment (`use_extended_uld`; TRL's rule); positional ULD takes any tokenizer.

EOS: with `uld_skip_student_eos` / `uld_skip_teacher_eos` (TRL's defaults) a completion's EOS is left
out of the comparison. Only an EOS is left out: a completion cut at max_completion_length keeps its
last token (TRL drops the last token either way).
"""

from __future__ import annotations

import functools

import torch

from rlft.core.fused_head import fused_kept_logprobs
from rlft.core.uld import (
    Hybrid,
    ULDPlan,
    align_by_byte_ends,
    build_pairs,
    matched_vocabulary,
    positional_groups,
)
from rlft.errors import ConfigError


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """ByteLevel BPE's map from a piece's characters back to bytes (GPT-2's byte-to-unicode table)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars, extra = list(kept), 0
    for b in range(256):
        if b not in kept:
            kept.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(kept, chars, strict=True)}


def is_byte_level(tokenizer) -> bool:
    """A fast tokenizer whose pieces are bytes (Qwen, Llama-3, GPT-2, SmolLM, Phi ...)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and ("ByteLevel" in repr(backend.pre_tokenizer)
                                    or "ByteLevel" in repr(backend.decoder))


class TokenBytes:
    """Each token id's UTF-8 bytes under one tokenizer (cached per id). `text_specials`: the tokens were
    read from text, so a special token stands for its own text (the teacher's side); else a special
    token was generated and is zero-width (the student's)."""

    def __init__(self, tokenizer, text_specials: bool = False):
        self.tokenizer = tokenizer
        self.special = set() if text_specials else set(tokenizer.all_special_ids)
        self.added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = self._bytes(token_id)
        return found

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self.special:
            return b""
        if token_id in self.added:
            return self.added[token_id].encode("utf-8")
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        table = _byte_decoder()
        if piece is None or any(ch not in table for ch in piece):
            raise ConfigError(f"token {token_id} ({piece!r}) of {type(self.tokenizer).__name__} is not a "
                              "ByteLevel BPE piece: byte alignment (use_extended_uld) needs ByteLevel "
                              "tokenizers on both sides; set use_extended_uld: false to pair tokens by "
                              "position")
        return bytes(table[ch] for ch in piece)

    def ends(self, ids: list[int]) -> list[int]:
        """Each token's end offset in the bytes of `ids` concatenated."""
        out, at = [], 0
        for token_id in ids:
            at += len(self(token_id))
            out.append(at)
        return out


class CrossTokenizerTeacher:
    """A loaded teacher model (`model`, prepared by the training engine) with its own tokenizer, and
    the ULD settings of the run's GOLDConfig (module docstring)."""

    def __init__(self, model, tokenizer, student_tokenizer, args, student_eos: list[int]):
        self.model, self.tokenizer, self.student_tokenizer = model, tokenizer, student_tokenizer
        self.extended, self.strategy = args.use_extended_uld, args.uld_token_merge_strategy
        self.skip_student_eos, self.skip_teacher_eos = args.uld_skip_student_eos, args.uld_skip_teacher_eos
        self.temperatures = (args.uld_student_temperature, args.uld_teacher_temperature)
        self.weights = (args.uld_distillation_weight, args.uld_crossentropy_weight)
        self.student_eos = set(student_eos)
        if self.extended:
            for side, tok in (("student", student_tokenizer), ("teacher", tokenizer)):
                if not is_byte_level(tok):
                    raise ConfigError(f"the {side}'s tokenizer ({type(tok).__name__}) is not ByteLevel BPE: "
                                      "byte alignment (use_extended_uld) needs ByteLevel tokenizers on both "
                                      "sides; set use_extended_uld: false to pair tokens by position")
        if tokenizer.eos_token_id is None:
            raise ConfigError("the teacher's tokenizer has no eos_token: set one in its "
                              "tokenizer_config.json")
        self.student_bytes = TokenBytes(student_tokenizer)
        self.teacher_bytes = TokenBytes(tokenizer, text_specials=True)
        self.hybrid = self._hybrid(args) if args.uld_use_hybrid_loss else None
        self._prompts: dict[tuple[int, ...], list[int]] = {}

    def _hybrid(self, args) -> Hybrid:
        student_ids, teacher_ids = matched_vocabulary(self.student_tokenizer.get_vocab(),
                                                      self.tokenizer.get_vocab())
        matched, unmatched = args.uld_hybrid_matched_weight, args.uld_hybrid_unmatched_weight
        if matched is None:  # TRL's adaptive weights: the matched share of the teacher's vocabulary
            matched = len(teacher_ids) / max(1, len(self.tokenizer))
            unmatched = 1.0 - matched
        return Hybrid(torch.tensor(student_ids, dtype=torch.long),
                      torch.tensor(teacher_ids, dtype=torch.long), float(matched), float(unmatched),
                      float(args.beta))

    def record(self) -> dict:
        from rlft.train.run.runs import model_record

        record = model_record(getattr(self.model, "module", self.model), weights=True)
        record["tokenizer"] = getattr(self.tokenizer, "name_or_path", type(self.tokenizer).__name__)
        return record

    # ---- the teacher's rows --------------------------------------------------------------------
    def _teacher_prompt(self, prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in self._prompts:
            if len(self._prompts) >= 4096:  # (a rollout's rows share prompts; a dataset's need not stay)
                self._prompts.clear()
            text = self.student_tokenizer.decode(prompt, skip_special_tokens=False,
                                                 clean_up_tokenization_spaces=False)
            ids = self.tokenizer(text, add_special_tokens=True)["input_ids"]
            if ids and ids[-1] == self.tokenizer.eos_token_id:
                ids = ids[:-1]
            self._prompts[key] = ids
        return self._prompts[key]

    def _row(self, prompt: list[int], completion: list[int]):
        """(teacher prompt ids, teacher completion ids, student groups, teacher groups) of one row;
        groups index the row's completion tokens."""
        ended = bool(completion) and completion[-1] in self.student_eos
        body = completion[:-1] if ended else completion
        text = b"".join(self.student_bytes(i) for i in body).decode("utf-8", errors="replace")
        teacher_body = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        teacher = teacher_body + ([self.tokenizer.eos_token_id] if ended else [])
        s_kept = len(completion) - (ended and self.skip_student_eos)
        t_kept = len(teacher) - (ended and self.skip_teacher_eos)
        if not self.extended:
            s_groups, t_groups = positional_groups(s_kept, t_kept)
        else:  # (each side's EOS, where kept, zero-width at the end)
            s_ends = self.student_bytes.ends(completion[:s_kept])
            t_ends = self.teacher_bytes.ends(teacher_body)
            t_ends = (t_ends + [t_ends[-1] if t_ends else 0])[:t_kept]
            s_groups, t_groups = align_by_byte_ends(s_ends, t_ends)
        return self._teacher_prompt(prompt), teacher, s_groups, t_groups

    def batch(self, rollout, rows, width: int):
        """The teacher's padded batch for these rows (ids, mask, position ids, its completion mask
        [b, c_t], its completion tokens [n_t]) and the groups' Pairs over the student's scored
        positions (the completion mask's, first `width` columns) and the teacher's."""
        prompt_ids, prompt_mask = rollout.prompt_ids[rows], rollout.prompt_mask[rows]
        completion_ids = rollout.completion_ids[rows, :width]
        completion_mask = rollout.completion_mask[rows, :width]
        made, s_starts, t_starts, s_at, t_at = [], [], [], 0, 0
        for p, pm, c, cm in zip(prompt_ids.tolist(), prompt_mask.tolist(), completion_ids.tolist(),
                                completion_mask.tolist(), strict=True):
            completion = [t for t, m in zip(c, cm, strict=True) if m]
            made.append(self._row([t for t, m in zip(p, pm, strict=True) if m], completion))
            s_starts.append(s_at)
            t_starts.append(t_at)
            s_at, t_at = s_at + len(completion), t_at + len(made[-1][1])
        pairs = build_pairs([(sg, tg) for _, _, sg, tg in made], s_starts, t_starts, s_at, self.strategy)
        return (*self._padded([(p, c) for p, c, _, _ in made], prompt_ids.device), pairs)

    def _padded(self, rows: list[tuple[list[int], list[int]]], device):
        pad = self.tokenizer.pad_token_id  # (load_tokenizer gave it one)
        p_width = max(len(p) for p, _ in rows)
        c_width = max(max(len(c) for _, c in rows), 1)
        ids = torch.full((len(rows), p_width + c_width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, (p, c) in enumerate(rows):  # prompts left-padded, completions right-padded
            ids[r, p_width - len(p):p_width + len(c)] = torch.tensor(p + c, dtype=torch.long)
            mask[r, p_width - len(p):p_width + len(c)] = 1
        ids, mask = ids.to(device), mask.to(device)
        completion_mask = mask[:, p_width:]
        targets = ids[:, p_width:][completion_mask.bool()]
        return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), completion_mask, targets

    def uld_states(self, rollout, rows, width: int, beta: float, tile: int | None):
        """TeacherStates for score_rows (rlft/model/scoring.py): the teacher's hidden states at its
        own completion positions, and `uld`: its token log-probs and the groups."""
        from rlft.model.scoring import teacher_states

        ids, mask, positions, completion_mask, targets, pairs = self.batch(rollout, rows, width)
        states = teacher_states(self.model, ids, mask, positions, completion_mask, beta)
        states.uld = ULDPlan(pairs, self.token_logps(states, targets, tile), self.temperatures, self.weights,
                             self.hybrid)
        return states

    @torch.no_grad()
    def token_logps(self, states, targets: torch.Tensor, tile: int | None) -> torch.Tensor:
        """The teacher's log-prob [n_t] of each of its completion tokens, at its ULD temperature."""
        head = states.head
        weight = head.weight if head.vocab is None else head.weight[:head.vocab]
        return fused_kept_logprobs(states.hidden.to(weight.dtype), weight, targets, None, head.bias,
                                   self.temperatures[1], head.scale, head.softcap, tile=tile,
                                   whole=head.whole)[0]

