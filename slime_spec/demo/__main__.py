"""`python -m slime_spec.demo`: the demo's entry (demo/run.py)."""

import sys

from slime_spec.demo.run import main

sys.exit(main())
