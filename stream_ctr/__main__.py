import sys

from stream_ctr.cli import main

if __name__ == "__main__":
    sys.exit(main())
