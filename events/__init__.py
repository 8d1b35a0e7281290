"""The vocabulary: the config schema (`events.config`), every event (`events.types`) and the
event-log codec (`events.log`). Imports nothing else of the project."""
