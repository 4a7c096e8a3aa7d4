"""Speculative decoding: proposers (n-gram lookup, a draft model) suggest a few tokens per
sequence, the target model scores them all in one pass, and the rejection sampler keeps the
longest prefix the target's distribution allows (docs/engine_options.md, issue 19).

Modules: config (the typed `speculative_config`), proposer (the interface and the registry),
ngram and draft_model (the proposers), methods (imports both, so that they are registered),
rejection_sampler (verification)."""
