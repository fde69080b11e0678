"""Typed, JSON-ready reports built by the library and rendered by the CLI."""
