"""Integrations with model libraries (Diffusers). The core never imports this package."""
