"""``python -m mixedad``: see mixedad.cli."""
import sys

from mixedad.cli import main

if __name__ == "__main__":
    sys.exit(main())
