"""JSON Lines journals: the gateway's logs on disk (numbered segments, the lock, retention, the
torn-last-line rule, the one writer and the one reader) and line framing on a byte stream (the
worker socketpair). It knows lines, not what they hold: the codecs stay with their types.
Imports nothing of the project."""
