"""`python -m layerline`: the same command line as the `layerline` script."""

import sys

from layerline.cli import main

if __name__ == "__main__":
    sys.exit(main())
