import sys

from dpgrad.tools.cli import main

sys.exit(main())
