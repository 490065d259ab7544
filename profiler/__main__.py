"""``python -m dpprof`` is ``dpprof``."""

from dpprof.cli.app import main

if __name__ == "__main__":
    main()
