"""Measuring: the metric registry, phases, roofline, monitors (memory, GPU), hardware specs,
profiling, provenance, the quality probe and the KV-cache memory calculator."""
