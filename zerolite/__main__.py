import sys

from zerolite.cli import main

sys.exit(main())
