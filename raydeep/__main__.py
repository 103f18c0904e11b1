import sys

from raydeep.cli import main

sys.exit(main())
