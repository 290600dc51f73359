"""The sampler draws from the distribution it claims (tempered softmax, cut by top-k / top-p), from noise that is a
pure function of (seed, step, vocab id), and a vocabulary split into slices scores each id as the whole would."""

from __future__ import annotations

import pytest
import torch

from moebius.layers.sampler import SamplingBatch, race_scores, sample

V = 6
LOGITS = torch.tensor([1.0, 0.5, -0.3, 2.0, 0.0, -1.0])


def _batch(n: int, temperature: float, top_k: int = V, top_p: float = 1.0, vocab: int = V) -> SamplingBatch:
    return SamplingBatch(temperature=torch.full((n,), temperature), top_k=torch.full((n,), top_k, dtype=torch.int64),
                         top_p=torch.full((n,), top_p), seeds=torch.arange(n), steps=torch.zeros(n, dtype=torch.int64),
                         all_greedy=temperature == 0, any_top_k=top_k < vocab, any_top_p=top_p < 1.0)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.8, V, 1.0), (1.5, V, 1.0), (1.0, 2, 1.0), (1.0, V, 0.7)])
def test_draws_follow_the_cut_tempered_softmax(temperature: float, top_k: int, top_p: float) -> None:
    n = 40000
    drawn = sample(LOGITS.expand(n, V), _batch(n, temperature, top_k, top_p))
    freq = torch.bincount(drawn, minlength=V).float() / n
    p = torch.softmax(LOGITS / temperature, -1)
    keep = torch.zeros(V, dtype=torch.bool)
    order = p.argsort(descending=True)
    mass = 0.0
    for i in order[:top_k].tolist():  # top-k, then the smallest prefix reaching top-p
        if mass >= top_p:
            break
        keep[i] = True
        mass += float(p[i])
    want = torch.where(keep, p, 0.0)
    want /= want.sum()
    assert (freq - want).abs().max() < 0.015, (freq, want)  # ~4 standard deviations at n = 40000


def test_greedy_rows_take_the_argmax_in_a_sampled_batch() -> None:
    sb = _batch(4, 1.0)
    sb.temperature[1] = 0.0
    rows = LOGITS.expand(4, V).clone()
    assert sample(rows, sb)[1] == 3 and race_scores(rows, sb).argmax(-1)[1] == 3


@pytest.mark.parametrize("parts", [2, 3])
def test_vocabulary_slices_score_as_the_whole(parts: int) -> None:
    torch.manual_seed(0)
    logits = torch.randn(64, 12 * parts)
    sb = _batch(64, 0.9, top_k=12 * parts, vocab=12 * parts)
    sb.temperature[::5] = 0.0  # greedy rows mixed in
    width = logits.shape[1] // parts
    sliced = torch.cat([race_scores(s, sb, first=i * width) for i, s in enumerate(logits.split(width, dim=1))], 1)
    assert torch.equal(sliced, race_scores(logits, sb))
    assert torch.equal(sliced.argmax(-1), sample(logits, sb))


def test_a_top_p_below_float32s_range_keeps_the_most_likely_token() -> None:
    """top_p 1e-50 is valid (in (0, 1]) but reads 0 as float32: the most likely token stays, as with any top_p."""
    sb = _batch(8, 1.0, top_p=1e-50)
    assert sb.top_p[0] == 0.0  # (what the step's tensor holds)
    assert sample(LOGITS.expand(8, V), sb).tolist() == [3] * 8
