"""Leaf helpers every layer may use: errors and file helpers. Standard library only; imports nothing of the package."""
