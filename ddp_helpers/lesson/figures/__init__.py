"""The lesson's figures, one module per subject (style.py: what they share)."""
