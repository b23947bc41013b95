import sys

from dpgrad.cli import main

sys.exit(main())
