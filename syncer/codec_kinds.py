"""Codec names and the default block size, free of JAX so that the config can import them."""

KINDS: tuple[str, ...] = ("none", "bf16", "int8", "int4", "int2", "nf2")
DEFAULT_BLOCK_SIZE = 64
