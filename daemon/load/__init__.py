"""Choices made when models load: can a pair be served, where, in which runtime."""
