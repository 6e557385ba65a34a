"""`python -m shiftlm ...` (and `torchrun -m shiftlm train ...`) is the `shiftlm` command."""

import sys

from shiftlm.cli import main

sys.exit(main())
