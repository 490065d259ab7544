"""The command line: one module per command, sharing the output helpers in `output`."""
