"""Integrations with frameworks (torch, vLLM, FSDP...). They import the core; the core
never imports them, except lazily by name when a user hands it their objects."""
