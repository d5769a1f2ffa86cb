"""Draft-head training (Medusa, MLP speculator, EAGLE). Not yet implemented (see the draft heads
issue)."""
