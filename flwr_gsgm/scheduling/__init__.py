"""Work scheduling: each node's measured speed, and the local work each message asks for."""
