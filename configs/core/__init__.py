"""Gin configs (see configs/__init__.py)."""
