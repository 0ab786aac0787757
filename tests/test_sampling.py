"""The sampler draws from exactly the filtered distribution (temperature, top-k, top-p, min-p), on
its fast path (the cut inside the top candidates) and on its sorting one, and a row's token never
depends on its batch-mates. The reference is written here in numpy, from the definitions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxinfer.sampling import CANDIDATES, SamplerArrays, Sampling
from jaxinfer.sampling import sample as sample_eagerly

V = 1000
DRAWS = 6000
sample = jax.jit(sample_eagerly)


def reference(logits: np.ndarray, s: Sampling) -> np.ndarray:
    """The probabilities transformers' warpers give, in float64: temperature, top-k, then top-p
    normalised over the top-k set, then min-p against the most likely token."""
    scaled = logits.astype(np.float64) / s.temperature
    ordered = np.sort(scaled)[::-1]
    k = s.top_k if 0 < s.top_k < V else V
    top = np.exp(ordered[:k] - ordered[0])
    top /= top.sum()
    kept = k if s.top_p >= 1 else min(int(np.sum(np.cumsum(top) - top < s.top_p)), k)
    threshold = ordered[kept - 1]
    if s.min_p > 0:
        threshold = max(threshold, ordered[0] + np.log(s.min_p))
    probs = np.where(scaled >= threshold, np.exp(scaled - ordered[0]), 0.0)
    return probs / probs.sum()


def draws(logits: np.ndarray, s: Sampling, n: int = DRAWS) -> np.ndarray:
    rows = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (n, V))
    keys = jax.random.split(jax.random.key(7), n)
    return np.asarray(sample(rows, jnp.zeros((n, V), bool), keys, SamplerArrays.from_settings([s] * n)))


PEAKED = np.random.default_rng(0).normal(size=V) * 3  # a nucleus of a few dozen tokens
FLAT = np.random.default_rng(1).normal(size=V) * 0.3  # a nucleus of most of the vocabulary

CASES = {
    "top-k inside the candidates": (PEAKED, Sampling(temperature=1.0, top_k=40)),
    "nucleus inside": (PEAKED, Sampling(temperature=0.8, top_p=0.9)),
    "nucleus past the candidates: sorted": (FLAT, Sampling(temperature=1.0, top_p=0.9)),
    "top-k past the candidates: sorted": (FLAT, Sampling(temperature=1.0, top_k=600, top_p=0.95)),
    "the whole vocabulary": (FLAT, Sampling(temperature=1.3)),
    "min-p floor inside": (FLAT, Sampling(temperature=0.5, min_p=0.2)),
    "min-p over a wide nucleus": (FLAT, Sampling(temperature=0.3, top_p=0.99, min_p=0.3)),
}


@pytest.mark.parametrize("case", CASES)
def test_draws_follow_the_filtered_distribution(case):
    logits, s = CASES[case]
    expected = reference(logits, s)
    counts = np.bincount(draws(logits, s), minlength=V)
    assert counts[expected == 0].sum() == 0, "drew a token the filters cut"
    # Chi-square over the kept tokens, the unlikely ones pooled so each cell expects ≥ 5 draws.
    order = np.argsort(expected)[::-1]
    order = order[expected[order] > 0]
    cells, observed, acc_e, acc_o = [], [], 0.0, 0
    for token in order:
        acc_e += expected[token] * DRAWS
        acc_o += counts[token]
        if acc_e >= 5:
            cells.append(acc_e)
            observed.append(acc_o)
            acc_e, acc_o = 0.0, 0
    cells[-1] += acc_e
    observed[-1] += acc_o
    assert len(cells) > 3, "the case should spread its draws"
    assert stats.chisquare(observed, cells).pvalue > 1e-4


def test_cases_take_both_paths():
    # The cases above mean something only if some cuts fall past the candidates.
    sizes = {case: int(np.sum(reference(*CASES[case]) > 0)) for case in CASES}
    assert sizes["top-k inside the candidates"] < CANDIDATES
    assert sizes["nucleus past the candidates: sorted"] > CANDIDATES
    assert sizes["top-k past the candidates: sorted"] > CANDIDATES
    assert sizes["min-p over a wide nucleus"] < CANDIDATES


def test_a_rows_token_does_not_depend_on_its_batch_mates():
    # A fast-path row beside rows that make the batch sort and draw from the whole vocabulary.
    settings = [
        Sampling(temperature=0.8, top_k=40),
        Sampling(temperature=1.0, top_p=0.9),
        Sampling(),
        Sampling(temperature=1.2),
    ]
    logits = jnp.asarray(np.stack([PEAKED, FLAT, FLAT, FLAT]), jnp.float32)
    for draw in range(16):
        keys = jax.random.split(jax.random.key(draw), 4)
        together = sample(logits, jnp.zeros((4, V), bool), keys, SamplerArrays.from_settings(settings))
        for row in range(4):
            alone = sample(
                logits[row : row + 1],
                jnp.zeros((1, V), bool),
                keys[row : row + 1],
                SamplerArrays.from_settings(settings[row : row + 1]),
            )
            assert int(alone[0]) == int(together[row]), (draw, row)


def test_greedy_is_the_first_most_likely_token():
    logits = jnp.asarray([[0.0, 3.0, 1.0, 3.0], [-1.0, -2.0, -1.0, -5.0]], jnp.float32)
    keys = jax.random.split(jax.random.key(0), 2)
    got = sample(logits, jnp.zeros(logits.shape, bool), keys, SamplerArrays.from_settings([Sampling()] * 2))
    assert got.tolist() == [1, 0]


@pytest.mark.parametrize(
    "s", [Sampling(temperature=0.8, top_p=0.95), Sampling(temperature=1.0)], ids=["candidates", "whole vocabulary"]
)
def test_two_near_distributions_drawn_with_the_same_keys_mostly_agree(s):
    # What a draft model's tokens rest on: drawn with the key the target's token at that position
    # is drawn with, they equal it with probability ≥ (1 - TV) / (1 + TV) (Gumbel-max coupling;
    # Daliri et al. 2024), where a shared uniform through an inverse CDF falls far below.
    base = PEAKED if s.top_p < 1 else FLAT
    near = base + np.random.default_rng(2).normal(size=V) * 0.3
    tv = 0.5 * np.abs(reference(base, s) - reference(near, s)).sum()
    agree = np.mean(draws(base, s) == draws(near, s))
    assert 0.1 < tv < 0.5
    assert agree >= (1 - tv) / (1 + tv) - 0.03, (agree, tv)
