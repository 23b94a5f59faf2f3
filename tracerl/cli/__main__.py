import sys

from tracerl.cli import main

sys.exit(main())
