"""jaxinfer: local LLM inference on JAX.

    from jaxinfer.loading import load_model
    from jaxinfer.engine import Engine
    from jaxinfer.generate import Generation
"""

__version__ = "0.1.0"
