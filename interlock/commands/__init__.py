"""The verbs of the `interlock` command line, one module each (`interlock/cli.py` lists them)."""
