"""`python -m distbelief`: the same command line as the installed `distbelief`."""

import sys

from distbelief.cli import main

sys.exit(main())
