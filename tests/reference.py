"""transformers as the reference: its logits and greedy output, and ours to compare with them."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from jaxinfer import model as M
from jaxinfer.engine import Engine
from jaxinfer.generate import Generation
from jaxinfer.kvcache import KVCache


def reference(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy()


def our_prompt_logits(model, ids, S=64):
    """Logits [T, V] of one fresh prefill, and the cache it filled."""
    cache = KVCache.zeros(model.config, 1, S, M.compute_dtype(model.params))
    logits, cache = _prefill(model.params, jnp.asarray([ids]), cache, cfg=model.config, S=S)
    return np.asarray(logits)[0], cache


@partial(jax.jit, static_argnames=("cfg", "S"))
def _prefill(params, ids, cache, *, cfg, S):
    """Compiled: op by op, a pass dispatches hundreds of programs (test_gguf's logits test ×N slower)."""
    hidden, cache = M.forward(params, cfg, ids, jnp.arange(ids.shape[1])[None], cache, S)
    return M.logits(params, hidden, cfg), cache


def assert_close(ours, ref, rel=1e-4):
    bound = rel * np.abs(ref).max()
    assert np.abs(ours - ref).max() <= bound, (np.abs(ours - ref).max(), bound)


def greedy_reference(hf, ids, n):
    """transformers' greedy continuation with EOS switched off, so it always runs n tokens."""
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(ids) :].tolist()


def alone(model, request, context=128):
    """A batch request through the batch-1 engine `jaxinfer run` uses: what its result must equal."""
    engine = Engine(model.config, model.params, context, model.eos_ids)
    gen = Generation(
        model, engine, request.prompt_ids, request.sampling, request.max_tokens, request.seed, request.stop
    )
    list(gen)
    return gen
