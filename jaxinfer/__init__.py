"""jaxinfer: local LLM inference on JAX.

from jaxinfer.loading import open_model      # open_model() alone: the bundled model, ready to generate
from jaxinfer.engine import Engine           # one sequence, its cache kept across requests
from jaxinfer.generate import Generation     # text in, streamed text out
from jaxinfer.chat import ChatSession        # multi-turn, prefilling only what is new
from jaxinfer.scheduler import Scheduler     # continuous batching over B cache slots (batch, serve)

opened = open_model(speculate="ngram")
model = opened.model
engine = Engine(model.config, model.params, opened.context, model.eos_ids, opened.decoding)
"""

__version__ = "0.1.0"
