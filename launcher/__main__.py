"""``python -m dtensor.launcher --nproc N script.py args``: the same as ``dtlaunch``."""
import sys

from dtensor.launcher.cli import main

sys.exit(main())
