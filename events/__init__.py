"""Event vocabulary (`events.types`) and the event-log codec (`events.log`); imports nothing else of the project."""
