"""`python -m slime_spec.train <flags>`: the RL loop, as slime's `train.py` is started; it lives in driver/loop.py."""

import sys

from slime_spec.driver.loop import main

if __name__ == "__main__":
    sys.exit(main())
