"""Gating: `inferlab gate` compares a candidate with a baseline (inputs, rules, statistics,
comparison) and `inferlab gate ab` runs interleaved A/B rounds before gating them."""
