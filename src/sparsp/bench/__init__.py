"""Benchmarks (attention, end to end, kernels, transports) and their reports: JSON + PNG under
bench/results/ from GPUs, under results/bench/ from a CPU."""
