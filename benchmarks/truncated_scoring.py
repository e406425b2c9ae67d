"""What replaying truncated sampling costs the trainer: the scoring forward + backward of a policy micro-batch
(the fused LM head, rlft/model/scoring.py) with each completion token's kept ids (renormalised log-probs) against
the same without them (full vocabulary), at Qwen's vocabulary on random weights. Rounds alternate the two,
so load on the machine skews both alike; the ratio of the medians is the cost.

    python benchmarks/truncated_scoring.py [--rounds 6] [--kept 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlft.model.scoring import install_scoring, score_rows
from rlft.rollout.base import Rollout

VOCAB, HIDDEN, LAYERS, ROWS, PROMPT, COMPLETION = 151_936, 256, 2, 8, 64, 512


def rollout(kept: int) -> Rollout:
    g = torch.Generator().manual_seed(0)
    completion_ids = torch.randint(0, VOCAB, (ROWS, COMPLETION), generator=g)
    ids = torch.randint(0, VOCAB, (ROWS, COMPLETION, kept), generator=g, dtype=torch.long).to(torch.int32)
    ids[..., 0] = completion_ids.to(torch.int32)  # the sampled token is among what the sampler kept
    return Rollout(torch.randint(0, VOCAB, (ROWS, PROMPT), generator=g), torch.ones(ROWS, PROMPT, dtype=torch.long),
                   completion_ids, torch.ones(ROWS, COMPLETION, dtype=torch.long), torch.zeros(ROWS, dtype=torch.bool),
                   sampling_kept=ids)


def seconds(model, batch: Rollout) -> float:
    started = time.perf_counter()
    scored = score_rows(model, batch, slice(0, ROWS), 1.0, entropy=True)
    (scored.logps.sum() + 0.01 * scored.entropy.sum()).backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--kept", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config)
    install_scoring(model)
    with_kept = rollout(args.kept)
    without = Rollout(with_kept.prompt_ids, with_kept.prompt_mask, with_kept.completion_ids,
                      with_kept.completion_mask, with_kept.truncated)
    seconds(model, without)  # warm-up
    times = {"full vocabulary": [], f"renormalised over {args.kept} kept ids": []}
    for _ in range(args.rounds):
        times["full vocabulary"].append(seconds(model, without))
        times[f"renormalised over {args.kept} kept ids"].append(seconds(model, with_kept))
    base = statistics.median(times["full vocabulary"])
    print(f"Qwen2 random weights, vocabulary {VOCAB}, hidden {HIDDEN}, {LAYERS} layers; {ROWS} rows x {PROMPT} prompt "
          f"+ {COMPLETION} completion tokens; scoring forward + backward (with entropy), median of {args.rounds}:")
    for name, values in times.items():
        print(f"  {name:<32} {statistics.median(values):7.3f} s  ({statistics.median(values) / base:.3f}x)")


if __name__ == "__main__":
    main()
