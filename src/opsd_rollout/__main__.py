import sys

from opsd_rollout.cli import main

sys.exit(main())
