"""The process shell: the `interlock` command line, `serve` (the composition root), the demo, and terminal rendering."""
