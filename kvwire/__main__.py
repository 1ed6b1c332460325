import sys

from kvwire.cli import main

sys.exit(main())
