"""`python -m ddp_helpers.train`: the training command line (ddp_helpers/cli/train.py), under this short name
because torchrun starts it by module name (`torchrun ... -m ddp_helpers.train`)."""
import sys

from .cli.train import main

if __name__ == "__main__":
    sys.exit(main())
