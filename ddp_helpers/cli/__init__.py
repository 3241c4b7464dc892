"""The command lines: `python -m ddp_helpers.train` (train.py; torchrun.py for one rank of a torchrun job), its
output folder (outputs.py) and words (words.py), and `ddp-helpers-notebooks` (copy_notebooks.py)."""
