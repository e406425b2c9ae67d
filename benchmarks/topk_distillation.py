"""How far the served teacher's top-k divergence (rlft/core/sparse_distill.py) is from the exact one, at
Qwen's vocabulary (151,936), for k = 1, 5, 20, 100 and beta = 0 (forward KL), 0.5 (JSD), 1 (reverse KL).

A teacher served by `rlft vllm-serve` answers with its k most likely tokens' log-probs and the sampled
token's at each position, not its whole distribution; the student's side is exact (its full softmax). The
divergence is then taken between the two distributions cut into those tokens plus one tail bucket (a lower
bound of the exact divergence that tightens with k) or, without the tail, renormalised over them.

The teachers: next-token distributions with a Zipf-shaped rank profile, p_r proportional to r^-a over a
random order of the vocabulary at each position (the shape language models' next-token distributions have),
with `a` = 3.3, 2.0 and 1.5 for entropies of about 0.6, 1.6 and 3.2 nats (confident, typical, uncertain). The student
at each position: the teacher's log-probs times 0.8 plus Gaussian noise of standard deviation 1 (a student that
is flatter than its teacher and disagrees on the order of the tail). 256 positions per teacher, float32.

Reported, for each setting: the mean of the approximate D over the exact D (1 = exact), and the cosine between
the approximate and the exact gradient with respect to the student's logits (the direction the student is
pulled; 1 = the same), averaged over positions. The sampled token of each position is drawn from the student.

    python benchmarks/topk_distillation.py      # ~1 minute on 2 CPU cores; writes results-topk-distillation.json
"""

from __future__ import annotations

import json
import platform
from datetime import date
from pathlib import Path

import torch

from rlft.core.distill import divergence_from_logprobs
from rlft.core.sparse_distill import bucketed_logprobs

VOCAB, POSITIONS = 151_936, 256
KS, BETAS = (1, 5, 20, 100), (0.0, 0.5, 1.0)
EXPONENTS = {"confident": 3.3, "typical": 2.0, "uncertain": 1.5}


def teacher_logprobs(exponent: float, g: torch.Generator) -> torch.Tensor:
    """[POSITIONS, VOCAB] log-probs: a Zipf rank profile over a random order of the vocabulary."""
    profile = -exponent * torch.log(torch.arange(1, VOCAB + 1, dtype=torch.float32))
    order = torch.argsort(torch.rand(POSITIONS, VOCAB, generator=g), dim=-1)
    logits = profile[order]
    return logits - torch.logsumexp(logits, dim=-1, keepdim=True)


def served(teacher: torch.Tensor, sampled: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the server answers: top-k ids and the sampled token's (-1 padding), with their log-probs."""
    top = teacher.topk(k, dim=-1).indices
    extra = (top != sampled[:, None]).all(-1)
    ids = torch.cat([top, torch.where(extra, sampled, -1)[:, None]], dim=-1)
    return ids, teacher.gather(-1, ids.clamp(min=0))


def measure(teacher: torch.Tensor, student_logits: torch.Tensor, sampled: torch.Tensor) -> dict:
    rows = {}
    for beta in BETAS:
        z = student_logits.clone().requires_grad_(True)
        log_ps = z - torch.logsumexp(z, dim=-1, keepdim=True)
        exact = divergence_from_logprobs(log_ps, teacher, beta)
        (grad_exact,) = torch.autograd.grad(exact.sum(), z)
        for k in KS:
            ids, logps = served(teacher, sampled, k)
            for tail in (True, False):
                z = student_logits.clone().requires_grad_(True)
                log_ps = z - torch.logsumexp(z, dim=-1, keepdim=True)
                approx = divergence_from_logprobs(*bucketed_logprobs(log_ps, ids, logps, tail), beta)
                (grad,) = torch.autograd.grad(approx.sum(), z)
                cosine = torch.nn.functional.cosine_similarity(grad, grad_exact, dim=-1)
                rows[f"beta={beta} k={k} tail={tail}"] = {
                    "ratio": float(approx.detach().mean() / exact.detach().mean()), "cosine": float(cosine.mean()),
                    "exact": float(exact.detach().mean()), "approx": float(approx.detach().mean())}
    return rows


def main() -> None:
    torch.set_num_threads(2)
    results = {"date": str(date.today()), "machine": f"{platform.machine()}, torch {torch.__version__}",
               "vocab": VOCAB, "positions": POSITIONS, "settings": {}}
    for name, exponent in EXPONENTS.items():
        g = torch.Generator().manual_seed(0)
        teacher = teacher_logprobs(exponent, g)
        student = 0.8 * teacher + torch.randn(teacher.shape, generator=g)
        sampled = torch.multinomial(torch.softmax(student, -1), 1, generator=g).squeeze(-1)
        entropy = float(-(teacher.exp() * teacher).sum(-1).mean())
        results["settings"][name] = {"teacher_entropy": entropy, "rows": measure(teacher, student, sampled)}
        print(f"{name}: teacher entropy {entropy:.2f} nats", flush=True)
    table(results)
    out = Path(__file__).with_name("results-topk-distillation.json")
    out.write_text(json.dumps(results, indent=1) + "\n")


def table(results: dict) -> None:
    names = list(results["settings"])
    head = " | ".join(f"{n} ({results['settings'][n]['teacher_entropy']:.1f} nats) D ratio / grad cos"
                      for n in names)
    print(f"| beta | k | tail | {head} |")
    print("| --- | --- | --- |" + " --- |" * len(names))
    for key in results["settings"][names[0]]["rows"]:
        beta, k, tail = (part.split("=")[1] for part in key.split())
        cells = " | ".join("{ratio:.3f} / {cosine:.3f}".format(**results["settings"][n]["rows"][key])
                           for n in names)
        print(f"| {beta} | {k} | {'yes' if tail == 'True' else 'no'} | {cells} |")


if __name__ == "__main__":
    main()
