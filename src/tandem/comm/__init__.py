"""Communication: the backend protocol, the engines, and the user-facing collectives."""
