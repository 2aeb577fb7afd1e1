"""MMedAgent-RL as a graph: triage → specialists (fan-out) → attending (`graph`), its state and its steps."""
