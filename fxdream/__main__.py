import sys

from fxdream.cli import main

sys.exit(main())
