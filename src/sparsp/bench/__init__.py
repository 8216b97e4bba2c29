"""Benchmarks: transport, attention (JSON + PNG under bench/results/)."""
