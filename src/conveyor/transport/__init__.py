"""Transports between roles: the trajectory buffer and versioned weight transports."""
