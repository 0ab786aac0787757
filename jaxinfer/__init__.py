"""jaxinfer: local LLM inference on JAX.

from jaxinfer.loading import load_model      # load_model() alone: the bundled model
from jaxinfer.engine import Engine           # one sequence, its cache kept across requests
from jaxinfer.generate import Generation     # text in, streamed text out
from jaxinfer.chat import ChatSession        # multi-turn, prefilling only what is new
from jaxinfer.batch import BatchRunner       # continuous batching over B cache slots
"""

__version__ = "0.1.0"
