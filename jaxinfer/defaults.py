"""What the library takes where a parameter is not given, in a module that imports nothing, so the
CLI's help can say them without starting JAX."""

MAX_CONTEXT = 4096  # cache positions: min(the model's trained positions, this)
NUM_DRAFT = 4  # tokens drafted per speculative step
# tokens generated when neither the request nor generation_config.json says; this default (never
# one given) shrinks to the room the prompt leaves in the context
MAX_TOKENS = 256
