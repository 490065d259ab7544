"""``python -m dpprof`` is ``dpprof``."""

from dpprof.cli.entry import main

if __name__ == "__main__":
    main()
