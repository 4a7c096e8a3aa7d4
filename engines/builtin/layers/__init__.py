"""Building blocks of the transformer: linear layers with a storage hook, norms, rotary."""
