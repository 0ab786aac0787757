"""The typed parts a decoder layer is made of, each a module of pure functions over its leaves of the
layer's parameter dict: the feed-forward part (`feed_forward`: the dense gated MLP, or a mixture of
experts). `ModelConfig.feed_forward(i)` says which part layer i holds; `jaxinfer.model` composes
them with attention."""
