"""A discrete-event model of fan-out (in progress)."""
