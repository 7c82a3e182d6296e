import sys

from hetspec.daemon.cli import main

sys.exit(main())
