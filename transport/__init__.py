"""Domain-free HTTP/1.1 transport: the lean client both the probes and the proxy use; imports nothing of the project."""
