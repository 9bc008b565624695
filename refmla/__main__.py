import sys

from refmla.cli import main

sys.exit(main())
